"""The radix trie of published blocks, shared by all workers, path-compressed into runs.

One root per ``Namespace``. Below it every node holds a **run** of consecutive blocks: its
``content`` is the exact bytes of their key-stream positions (see ``keys``), which is one
contiguous slice of any prompt that spells it, so a walk compares a whole run in one slice
compare. A child is filed under the content of its first block::

    root(ns) ──[b0 b1 b2 b3]──▶ A ──[b4 b5]──▶ B         A.residency {gpu0: Run(ids [7, 2, 9, 4]),
                                 │                                   gpu1: Run(ids [3, 5, 1, 8])}
                                 └──[b4' b5' b6']──▶ C    C.residency {gpu1: Run(ids [6, 0, 11])}

A node's ``residency`` maps each worker holding it to that worker's ``Run`` (block ids + pin
count, see ``block_pool``). Residency is whole-node and prefix-closed per worker (resident on w
⇒ parent resident on w). Where a walk, a reservation or an eviction needs a boundary inside a
node, the node is **split** there, for every worker at once (the old ``Run`` objects keep the
lower part, so reservations pointing at them stay right)::

    before:  P ──[b0 .. b5]──▶ N          N.residency {w: Run(ids [a0 .. a5])}
    split(N, 2):
             P ──[b0 b1]──▶ U ──[b2 .. b5]──▶ N
                            U.residency {w: Run(ids [a0 a1])}  (new, parent of the old one)
                                               N.residency {w: Run(ids [a2 .. a5])}  (same object)

A node with no residency has no children either and is pruned at once; roots without children
are dropped too. With ``keyed`` (events on) every node keeps the 256-bit ``BlockKey`` of each of
its blocks, computed when it is published; otherwise keys are never computed.

``root`` and ``walk`` are read-only; everything else mutates.
"""

from __future__ import annotations

from .block_pool import Run
from .keys import BlockKey, KeyStream, Namespace, chain_key, first_block_material


class Node:
    """A run of published blocks: ``size`` blocks starting at depth ``depth`` (root 0, the first
    block below a root 1), ``content`` their key-stream bytes; the first block is ``head`` bytes
    long (D positions longer below a root), the others ``step``."""

    __slots__ = ("content", "parent", "children", "depth", "size", "head", "step", "residency", "namespace", "keys")

    def __init__(self, content: bytes, parent: Node | None, depth: int, size: int, head: int, step: int,
                 namespace: Namespace, keys: list[BlockKey] | None):
        self.content = content
        self.parent = parent
        self.children: dict[bytes, Node] = {}
        self.depth = depth
        self.size = size
        self.head = head
        self.step = step
        self.residency: dict[str, Run] = {}
        self.namespace = namespace
        self.keys = keys  # one per block when the trie is keyed; a root holds [namespace root key]

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def end_of(self, blocks: int) -> int:
        """Byte length of the node's first ``blocks`` blocks (read-only)."""
        return self.head + (blocks - 1) * self.step if blocks else 0

    def last_key(self) -> BlockKey:
        """Key of the node's last block (keyed tries only; read-only)."""
        return self.keys[-1]


def common_blocks(node: Node, buf: bytes, pos: int, limit: int) -> int:
    """How many of the node's first ``limit`` blocks equal ``buf`` from byte ``pos`` (read-only).
    The first block is known to be equal (the caller found the node by it)."""
    content = node.content
    # bytes.startswith(x, pos) compares in place: one copy (of the node's part) per compare.
    if buf.startswith(content if limit == node.size else content[: node.end_of(limit)], pos):
        return limit
    lo, hi = 1, limit  # [0, lo) equal, hi not: bisect on slice compares
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        if buf.startswith(content[: node.end_of(mid)], pos):
            lo = mid
        else:
            hi = mid
    return lo


class RadixTrie:
    """All namespaces' roots; ``num_nodes`` runs and ``num_blocks`` distinct published blocks."""

    def __init__(self, keyed: bool = False) -> None:
        self.roots: dict[Namespace, Node] = {}
        self.keyed = keyed
        self.num_nodes = 0  # non-root nodes (runs)
        self.num_blocks = 0  # blocks over all non-root nodes (distinct published block keys)

    def root(self, namespace: Namespace) -> Node | None:
        """The namespace's root, or None if nothing is published in it (read-only)."""
        return self.roots.get(namespace)

    def root_or_create(self, namespace: Namespace) -> Node:
        root = self.roots.get(namespace)
        if root is None:
            step = namespace.block_size << 2
            root = self.roots[namespace] = Node(b"", None, 0, 0, 0, step, namespace, [namespace.root_key()])
        return root

    # -- lookup ------------------------------------------------------------------------------
    @staticmethod
    def walk(root: Node | None, stream: KeyStream) -> tuple[list[Node], list[int]]:
        """Nodes along the stream's reusable blocks and, per node, the blocks matched through it
        (read-only). Only the last node may be matched partly. The hot loop of Match/Reserve:
        one dict lookup and one slice compare per node."""
        path: list[Node] = []
        ends: list[int] = []
        cap = stream.reusable_block_cap
        if root is None or cap <= 0:
            return path, ends
        buf, step = stream.buf, stream.block_size << 2
        pos = 0
        node = root.children.get(buf[: step + (stream.span << 2)])
        blocks = 0
        while node is not None:
            size = node.size
            left = cap - blocks
            if size <= left:
                end = pos + len(node.content)
                m = size if buf.startswith(node.content, pos) else common_blocks(node, buf, pos, size)
            else:
                m = common_blocks(node, buf, pos, left)
            blocks += m
            path.append(node)
            ends.append(blocks)
            if m < size or blocks >= cap:
                break
            pos = end
            node = node.children.get(buf[pos : pos + step])
        return path, ends

    # -- structure ---------------------------------------------------------------------------
    def split(self, node: Node, k: int) -> Node:
        """Cut ``node`` after its first ``k`` blocks (0 < k < size); return the new upper node.
        Each worker's run is cut likewise: a new ``Run`` for the upper part becomes the parent
        of the old one, which keeps the lower part, its pins and its heap entry (its last block
        is unchanged)."""
        end = node.end_of(k)
        content = node.content
        keys = node.keys
        upper = Node(content[:end], node.parent, node.depth, k, node.head, node.step, node.namespace,
                     None if keys is None else keys[:k])
        node.parent.children[content[: node.head]] = upper
        node.content = content[end:]
        node.parent = upper
        node.depth += k
        node.size -= k
        node.head = node.step
        if keys is not None:
            del keys[:k]
        upper.children[node.content[: node.step]] = node
        residency = upper.residency
        for wid, run in node.residency.items():
            ids = run.ids
            up = Run(ids[:k], upper, run.parent, run.ref, run.tick)
            up.resident_children = 1
            del ids[:k]
            run.parent = up
            residency[wid] = up
        self.num_nodes += 1
        return upper

    def _keys(self, parent: Node, content: bytes, size: int, head: int, step: int) -> list[BlockKey] | None:
        if not self.keyed:
            return None
        key = parent.keys[-1]
        out = []
        if parent.parent is None:
            key = chain_key(key, first_block_material(content[:head], parent.namespace.span))
            out.append(key)
            start = head
        else:
            start = 0
        for at in range(start, len(content), step):
            key = chain_key(key, content[at : at + step])
            out.append(key)
        return out

    def attach(self, parent: Node, parent_run: Run | None, content: bytes, ids: list[int], worker_id: str,
               tick: int) -> Run:
        """A new child of ``parent`` holding ``len(ids)`` blocks spelled by ``content`` (whose
        first block must be new below ``parent``), resident on ``worker_id`` in ``ids``, pinned
        once by the publishing reservation. Returns the new run."""
        step = parent.step
        head = step + (parent.namespace.span << 2) if parent.parent is None else step
        size = len(ids)
        node = Node(content, parent, parent.depth + parent.size if parent.parent is not None else 1, size, head,
                    step, parent.namespace, self._keys(parent, content, size, head, step))
        parent.children[content[:head]] = node
        run = node.residency[worker_id] = Run(ids, node, parent_run, 1, tick)
        if parent_run is not None:
            parent_run.resident_children += 1
        self.num_nodes += 1
        self.num_blocks += size
        return run

    @staticmethod
    def add_residency(node: Node, parent_run: Run | None, ids: list[int], worker_id: str, tick: int) -> Run:
        """``worker_id`` now holds ``node`` (published by another worker) in ``ids``, pinned once."""
        run = node.residency[worker_id] = Run(ids, node, parent_run, 1, tick)
        if parent_run is not None:
            parent_run.resident_children += 1
        return run

    def evict_tail(self, run: Run, take: int, worker_id: str, victims: list[int], keys: list | None) -> Run | None:
        """Remove the last ``take`` blocks of a cached leaf ``run`` from the worker, deepest first,
        appending their ids (and keys, if ``keys`` is a list) to the outputs. Returns the run
        left holding the blocks before them, or None if the whole run went."""
        node = run.node
        ids = run.ids
        cut = len(ids) - take
        if cut:
            if len(node.residency) == 1 and not node.children:  # nobody else sees it: shorten in place
                victims.extend(ids[: cut - 1 : -1])
                if keys is not None:
                    keys.extend(node.keys[: cut - 1 : -1])
                    del node.keys[cut:]
                del ids[cut:]
                node.content = node.content[: node.end_of(cut)]
                node.size = cut
                self.num_blocks -= take
                return run
            rest = self.split(node, cut).residency[worker_id]
            self.remove_run(run, worker_id, victims, keys)
            return rest
        self.remove_run(run, worker_id, victims, keys)
        return None

    def remove_run(self, run: Run, worker_id: str, victims: list[int] | None = None, keys: list | None = None) -> None:
        """Forget the worker's copy of ``run.node`` (it must have no resident children there);
        prune the node (and a childless root) once nobody holds it."""
        node = run.node
        if victims is not None:
            victims.extend(reversed(run.ids))
            if keys is not None:
                keys.extend(reversed(node.keys))
        del node.residency[worker_id]
        run.node = None
        run.heap_key = -1
        parent = run.parent
        if parent is not None:
            parent.resident_children -= 1
        if node.residency or node.children:
            return
        up = node.parent
        del up.children[node.content[: node.head]]
        node.parent = None  # detached: a stale reference can no longer reach the trie
        self.num_nodes -= 1
        self.num_blocks -= node.size
        if up.parent is None and not up.children:
            del self.roots[up.namespace]

    def drop_worker(self, worker_id: str) -> None:
        """Remove every run of ``worker_id`` (deepest first keeps residency prefix-closed)."""
        runs = [n.residency[worker_id] for n in self.iter_nodes() if worker_id in n.residency]
        runs.sort(key=lambda r: -r.node.depth)
        for run in runs:
            self.remove_run(run, worker_id)

    def iter_nodes(self):
        """Every non-root node, parents before children (read-only)."""
        stack = [child for root in self.roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
