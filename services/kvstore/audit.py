"""The full invariant audit behind ``KVStore.check_invariants`` (read-only, O(state)).

What it proves, per worker and for the shared trie:

* conservation: free + cached + in use = total; counters match block states; the free queue holds
  exactly the free blocks, once each; every evictable leaf has a live heap entry;
* refcounts = live pins: each block's reference count equals the number of live reservations
  whose table holds it (so nothing is leaked or double-freed), and no table holds a block twice;
* residency: a published block's node names it as the worker's copy and vice versa; a node
  resident on w has its parent resident on w, held by the block's ``parent`` link;
  ``resident_children`` counts are exact;
* trie: every non-root node is resident somewhere and reachable from its namespace's root; keys
  chain correctly; the node counter is right;
* reservations: published blocks spell the reservation's own key stream from the root; the
  unpublished ones are private (ref 1, no node); the request index agrees.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from .block_pool import BlockState
from .keys import DIGEST_SIZE, chain_key

if TYPE_CHECKING:
    from .radix_trie import RadixTrie
    from .records import ReservationRecord, WorkerRecord


def check(
    workers: dict[str, WorkerRecord],
    trie: RadixTrie,
    reservations: dict[str, ReservationRecord],
    by_request: dict[str, ReservationRecord],
) -> list[str]:
    out: list[str] = []
    for wid, worker in workers.items():
        out += worker.pool.audit(f"worker {wid}")
        out += _check_pins(wid, worker)
        out += _check_residency(wid, worker)
    out += _check_trie(workers, trie)
    out += _check_reservations(workers, trie, reservations, by_request)
    return out


def _check_pins(wid: str, worker: WorkerRecord) -> list[str]:
    out = []
    pins = [0] * worker.pool.num_blocks
    for record in worker.reservations.values():
        ids = [b.block_id for b in record.blocks]
        if len(set(ids)) != len(ids):
            out.append(f"worker {wid}: reservation {record.reservation_id} holds a block twice")
        for block in record.blocks:
            if worker.pool.blocks[block.block_id] is not block:
                out.append(f"worker {wid}: reservation {record.reservation_id} holds a foreign block")
            else:
                pins[block.block_id] += 1
    for block in worker.pool.blocks:
        if block.ref_count != pins[block.block_id]:
            out.append(f"worker {wid}: block {block.block_id} ref {block.ref_count} != {pins[block.block_id]} live pins")
        if (block.state is BlockState.IN_USE) != (pins[block.block_id] > 0):
            out.append(f"worker {wid}: block {block.block_id} is {block.state.name} with {pins[block.block_id]} pins")
    return out


def _check_residency(wid: str, worker: WorkerRecord) -> list[str]:
    out = []
    for block in worker.pool.blocks:
        node = block.node
        if node is None:
            if block.resident_children:
                out.append(f"worker {wid}: unpublished block {block.block_id} counts resident children")
            continue
        if node.residency.get(wid) is not block:
            out.append(f"worker {wid}: block {block.block_id}'s node does not name it as resident")
        if node.parent is None:
            out.append(f"worker {wid}: block {block.block_id} holds a detached or root node")
            continue
        if node.parent.parent is not None and wid not in node.parent.residency:
            out.append(f"worker {wid}: block {block.block_id} resident but its parent node is not")
        elif block.parent is not (node.parent.residency[wid] if node.parent.parent is not None else None):
            out.append(f"worker {wid}: block {block.block_id} does not link the block of its parent node")
        children = sum(1 for c in node.children.values() if wid in c.residency)
        if children != block.resident_children:
            out.append(f"worker {wid}: block {block.block_id} counts {block.resident_children} resident children, has {children}")
    return out


def _check_trie(workers: dict[str, WorkerRecord], trie: RadixTrie) -> list[str]:
    out = []
    count = 0
    for namespace, root in trie.roots.items():
        if root.namespace != namespace or root.key != namespace.root_key() or root.depth != 0:
            out.append(f"trie: root of {namespace} is inconsistent")
        if not root.children:
            out.append(f"trie: root of {namespace} has no children")
    for node in trie.iter_nodes():
        count += 1
        parent = node.parent
        if parent is None or parent.children.get(node.content) is not node or node.depth != parent.depth + 1:
            out.append(f"trie: node at depth {node.depth} is not linked to its parent")
            continue
        if not node.residency:
            out.append(f"trie: node at depth {node.depth} is resident nowhere")
        for wid, block in node.residency.items():
            worker = workers.get(wid)
            if worker is None or worker.pool.blocks[block.block_id] is not block:
                out.append(f"trie: node at depth {node.depth} resident on a dropped worker {wid}")
            elif block.node is not node or block.state is BlockState.FREE:
                out.append(f"trie: worker {wid} block {block.block_id} does not hold the node naming it")
            elif worker.namespace(node.namespace.cache_salt) != node.namespace:
                out.append(f"trie: worker {wid} holds a node of a foreign namespace")
        span = node.namespace.span
        if node.depth == 1:
            head = (span + 1) * 4
            material = _blake(node.content[:head]) + node.content[head:]
        else:
            material = node.content
        bs = node.namespace.block_size
        expected_len = (bs + span if node.depth == 1 else bs) * 4
        if len(node.content) != expected_len:
            out.append(f"trie: node at depth {node.depth} has content of {len(node.content)} bytes")
        if node.key != chain_key(parent.key, material):
            out.append(f"trie: node at depth {node.depth} has a key that does not chain from its parent")
    if count != trie.num_nodes:
        out.append(f"trie: counter says {trie.num_nodes} nodes, found {count}")
    return out


def _blake(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=DIGEST_SIZE).digest()


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
        if record.published > min(len(record.blocks), stream.num_keyed_blocks):
            out.append(f"reservation {rid}: {record.published} published blocks exceed table/keyed blocks")
            continue
        node = trie.root(record.namespace) if record.published else None
        for j, block in enumerate(record.blocks):
            if j < record.published:
                expected = node.children.get(stream.block_content(j)) if node is not None else None
                if expected is None or block.node is not expected:
                    out.append(f"reservation {rid}: published block {j} does not spell its key stream")
                    break
                node = expected
            elif block.node is not None or block.ref_count != 1:
                out.append(f"reservation {rid}: own block {j} (id {block.block_id}) is shared or published")
    return out
