"""The full invariant audit behind ``KVStore.check_invariants`` (read-only, O(state)).

What it proves, per worker and for the shared trie:

* conservation: every block is in exactly one place (free queue, one run, or one reservation's
  own blocks), so free + cached + in use = total; the counters match; every cached leaf run has a
  live eviction-heap entry;
* refcounts = live pins: each run's pin count equals the number of live reservations whose
  published prefix runs through it (so nothing is leaked or double-freed);
* residency: a run names its node and the node names it; a run's parent is the worker's run of
  the parent node (residency prefix-closed); ``resident_children`` counts are exact;
* trie: every non-root node is resident somewhere, holds ``size`` blocks of the right length,
  is reachable from its namespace's root under its first block; each worker's run has one id per
  block; keys (when kept) chain correctly; the node and block counters are right;
* reservations: published blocks spell the reservation's own key stream from the root; the
  request index agrees.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .block_pool import chain
from .keys import chain_key, first_block_material

if TYPE_CHECKING:
    from .radix_trie import Node, RadixTrie
    from .records import ReservationRecord, WorkerRecord


def check(
    workers: dict[str, WorkerRecord],
    trie: RadixTrie,
    reservations: dict[str, ReservationRecord],
    by_request: dict[str, ReservationRecord],
    ending: dict[str, ReservationRecord] | None = None,
) -> list[str]:
    out: list[str] = []
    ending = ending or {}
    nodes = list(trie.iter_nodes())
    for wid, worker in workers.items():
        runs = [n.residency[wid] for n in nodes if wid in n.residency]
        own = [r.own for r in (*worker.reservations.values(), *worker.ending.values())]
        out += worker.pool.audit(f"worker {wid}", runs, own)
        out += _check_pins(wid, worker, runs)
    out += _check_trie(workers, trie, nodes)
    out += _check_reservations(workers, trie, reservations, by_request)
    out += _check_ending(workers, reservations, ending)
    return out


def _check_ending(workers, reservations, ending) -> list[str]:
    """Ending reservations (two-phase end) sit on their worker, and are not live as well."""
    out = []
    on_workers = sum(len(w.ending) for w in workers.values())
    if on_workers != len(ending):
        out.append(f"ending reservations: index has {len(ending)}, workers hold {on_workers}")
    for rid, record in ending.items():
        worker = record.worker
        if workers.get(worker.worker_id) is not worker or worker.ending.get(rid) is not record:
            out.append(f"ending reservation {rid}: not on a live worker")
        if rid in reservations:
            out.append(f"ending reservation {rid}: also live")
    return out


def _check_pins(wid: str, worker: WorkerRecord, runs: list) -> list[str]:
    out = []
    pins: dict[int, int] = {}
    for record in (*worker.reservations.values(), *worker.ending.values()):
        published = 0
        for run in chain(record.last):
            pins[id(run)] = pins.get(id(run), 0) + 1
            published += len(run.ids)
            if run.node is None or run.node.residency.get(wid) is not run:
                out.append(f"worker {wid}: reservation {record.reservation_id} pins a run that is not resident")
        if published != record.published:
            out.append(f"worker {wid}: reservation {record.reservation_id} pins {published} blocks, says {record.published}")
    for run in runs:
        if run.ref != pins.get(id(run), 0):
            out.append(f"worker {wid}: run ending in block {run.ids[-1]} has ref {run.ref} != {pins.get(id(run), 0)} live pins")
    return out


def _check_trie(workers: dict[str, WorkerRecord], trie: RadixTrie, nodes: list[Node]) -> list[str]:
    out = []
    blocks = 0
    for namespace, root in trie.roots.items():
        if root.namespace != namespace or root.depth != 0 or root.keys != [namespace.root_key()]:
            out.append(f"trie: root of {namespace} is inconsistent")
        if not root.children:
            out.append(f"trie: root of {namespace} has no children")
    for node in nodes:
        blocks += node.size
        parent = node.parent
        where = f"trie: node at depth {node.depth}"
        if parent is None or parent.children.get(node.content[: node.head]) is not node:
            out.append(f"{where} is not linked to its parent")
            continue
        if node.depth != (1 if parent.parent is None else parent.depth + parent.size):
            out.append(f"{where} does not follow its parent's last block")
        bs, span = node.namespace.block_size, node.namespace.span
        head = (bs + span) * 4 if node.depth == 1 else bs * 4
        if node.size < 1 or node.head != head or len(node.content) != head + (node.size - 1) * bs * 4:
            out.append(f"{where} has {len(node.content)} content bytes for {node.size} blocks")
        if not node.residency:
            out.append(f"{where} is resident nowhere")
        for wid, run in node.residency.items():
            worker = workers.get(wid)
            if worker is None:
                out.append(f"{where} resident on a dropped worker {wid}")
                continue
            if run.node is not node or len(run.ids) != node.size:
                out.append(f"{where}: worker {wid}'s run does not hold it block for block")
            expected_parent = parent.residency.get(wid) if parent.parent is not None else None
            if parent.parent is not None and expected_parent is None:
                out.append(f"{where} resident on {wid} but its parent is not")
            elif run.parent is not expected_parent:
                out.append(f"{where}: worker {wid}'s run does not link the run of its parent node")
            children = sum(1 for c in node.children.values() if wid in c.residency)
            if children != run.resident_children:
                out.append(f"{where}: worker {wid}'s run counts {run.resident_children} resident children, has {children}")
            if worker.namespace(node.namespace.cache_salt) != node.namespace:
                out.append(f"{where}: worker {wid} holds a node of a foreign namespace")
        if node.keys is not None:
            out += _check_keys(node, where)
    if blocks != trie.num_blocks or len(nodes) != trie.num_nodes:
        out.append(f"trie: counters say {trie.num_nodes} nodes / {trie.num_blocks} blocks, found {len(nodes)} / {blocks}")
    return out


def _check_keys(node: Node, where: str) -> list[str]:
    key = node.parent.keys[-1]
    if len(node.keys) != node.size:
        return [f"{where} keeps {len(node.keys)} keys for {node.size} blocks"]
    for i in range(node.size):
        material = node.content[node.end_of(i) : node.end_of(i + 1)]
        if node.depth == 1 and i == 0:
            material = first_block_material(material, node.namespace.span)
        key = chain_key(key, material)
        if node.keys[i] != key:
            return [f"{where} has a key that does not chain from its parent"]
    return []


def _check_reservations(
    workers: dict[str, WorkerRecord],
    trie: RadixTrie,
    reservations: dict[str, ReservationRecord],
    by_request: dict[str, ReservationRecord],
) -> list[str]:
    out = []
    live_total = sum(len(w.reservations) for w in workers.values())
    if live_total != len(reservations) or len(by_request) != len(reservations):
        out.append(f"reservations: index sizes {len(reservations)}/{len(by_request)} vs {live_total} on workers")
    for rid, record in reservations.items():
        worker = record.worker
        if workers.get(worker.worker_id) is not worker or worker.reservations.get(rid) is not record:
            out.append(f"reservation {rid}: not on a live worker")
            continue
        if by_request.get(record.request_id) is not record:
            out.append(f"reservation {rid}: request index disagrees")
        stream = record.stream
        if record.published > stream.num_keyed_blocks:
            out.append(f"reservation {rid}: {record.published} published blocks exceed its keyed blocks")
            continue
        node = trie.root(record.namespace) if record.published else None
        for j in range(record.published):
            # Walk block by block, as a from-scratch reader of the key scheme would.
            child = _block_child(node, stream.block_content(j), j)
            if child is None:
                out.append(f"reservation {rid}: published block {j} does not spell its key stream")
                break
            node = child
        else:
            if record.last is not None and node != (record.last.node, record.last.node.size):
                out.append(f"reservation {rid}: its published prefix does not end at its last run")
    return out


def _block_child(at: tuple | Node | None, content: bytes, j: int):
    """One block further down from ``at`` = (node, blocks of it consumed) or a root node."""
    if at is None:
        return None
    node, used = at if isinstance(at, tuple) else (at, at.size)
    if used < node.size:
        if node.content[node.end_of(used) : node.end_of(used + 1)] != content:
            return None
        return node, used + 1
    child = node.children.get(content)
    return None if child is None else (child, 1)
