"""The radix trie of published blocks, shared by all workers.

One root per ``Namespace``; below it every edge is one block, labelled by the block's exact
content bytes (see ``keys``), so a path from the root spells a prefix of the key stream::

    root(ns) ──content(b0)──▶ N1 ──content(b1)──▶ N2 ──...
                               │ residency {gpu0: block 7, gpu1: block 3}
                               └─content(b1')──▶ N2'   residency {gpu1: block 9}

A node records on which workers it is resident and under which ``Block``. Residency is
prefix-closed per worker (resident on w ⇒ parent resident on w), which the store keeps by
publishing in order and evicting leaves only. A node with no residency has no children either
and is pruned at once, so every non-root node is resident somewhere. Roots without children are
dropped too. Keys are derived lazily from ``Chain`` records, which events keep alive instead of
the (short-lived) nodes.

Evictions prune ~one node per evicted block and the next Publish creates as many: pruned nodes
go to a small spare list and ``attach_chain`` refills them (allocation and teardown of a node and
its two dicts cost more than the rest of its bookkeeping). Only nodes nobody can still name are
refilled: not ``anchor`` nodes (some ``Chain`` or STORED event derives keys from them), and not
nodes pruned by ``remove_resident`` (worker drops), which are simply released.

Lookups (``root``, ``walk``) are read-only; ``attach_chain`` and ``remove_resident`` mutate.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .keys import BlockKey, Namespace, chain_key, first_block_material

if TYPE_CHECKING:
    from .block_pool import Block


class Chain:
    """The nodes one ``attach_chain`` call created, as key material: the node they hang below
    and their contents in order. Keys are derived from it on first read and memoized, so
    publishing hashes nothing; events keep the chain (not its nodes) to name evicted blocks.

    ``nodes`` are those of the chain's nodes still in the trie. Each is the parent of the next,
    so only a childless tail can be pruned and the ones left are always a prefix: a walk that
    reaches ``nodes[i]`` may compare the next ``m`` blocks of its prompt with ``joined`` in one
    slice compare and jump to ``nodes[i + m]``::

        parent ── nodes[0] ── nodes[1] ── ... ── nodes[-1]      (pruned tail: gone from nodes)
                  |content 0|content 1| ... |       joined = content 0 + content 1 + ...
    """

    __slots__ = ("parent", "contents", "keys", "nodes", "first_len", "joined")

    def __init__(self, parent: Node, contents: list[bytes]):
        self.parent = parent
        self.contents = contents  # never mutated
        self.keys: list[BlockKey] = []  # memo: keys of contents[: len(keys)]
        self.nodes: list[Node] = []  # the chain's nodes still in the trie (a prefix)
        self.first_len = len(contents[0])  # block 0 below a root is D positions longer
        self.joined: bytes | None = None  # b"".join(contents), made by the first walk that needs it

    def join(self) -> bytes:
        """``joined``, built and kept on first use (mutates the memo only)."""
        joined = self.joined = b"".join(self.contents)
        return joined

    def pruned(self, index: int) -> None:
        """Node ``index`` (and so every later one) left the trie (mutates): forget them, and the
        joined contents once none is left (events keep pruned chains alive)."""
        nodes = self.nodes
        del nodes[index:]
        if not nodes:
            self.joined = None

    def key_at(self, index: int) -> BlockKey:
        """``blake2b-256(previous key || material)`` chained from ``parent.key`` (read-only apart
        from the memo); material is the content, or ``first_block_material`` below a root."""
        keys = self.keys
        if index < len(keys):
            return keys[index]
        parent, contents = self.parent, self.contents
        key = keys[-1] if keys else parent.key
        for k in range(len(keys), index + 1):
            content = contents[k]
            if k == 0 and parent.depth == 0:
                content = first_block_material(content, parent.namespace.span)
            key = chain_key(key, content)
            keys.append(key)
        return key


class Node:
    """A published block key: the chain of block contents from its namespace root.

    ``key`` (the 256-bit ``BlockKey``) is derived on first read from the node's ``Chain``; roots
    get theirs at creation.
    """

    __slots__ = ("content", "parent", "children", "depth", "residency", "namespace", "chain", "index", "_key", "anchor")

    def __init__(self, content: bytes, parent: Node | None, namespace: Namespace, chain: Chain | None, index: int,
                 depth: int, residency: dict[str, Block], key: BlockKey | None = None):
        # Positional and precomputed (depth, residency): attach_chain creates ~one node per
        # published block, so this constructor is on the Publish hot path.
        self.content = content
        self.parent = parent
        self.children: dict[bytes, Node] = {}
        self.depth = depth  # root 0, block j at depth j+1
        self.residency = residency  # worker id -> block holding this node there
        self.namespace = namespace
        self.chain = chain  # where its key comes from (None for a root)
        self.index = index
        self._key = key
        self.anchor = False  # a Chain (or an event) derives keys from this node: never recycle it

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def key(self) -> BlockKey:
        """The node's ``BlockKey`` (read-only apart from the memo)."""
        key = self._key
        if key is None:
            key = self._key = self.chain.key_at(self.index)
        return key

    @key.setter
    def key(self, value: BlockKey) -> None:  # tests corrupt keys to exercise the audit
        self._key = value


class RadixTrie:
    """All namespaces' roots and the node count."""

    def __init__(self) -> None:
        self.roots: dict[Namespace, Node] = {}
        self.num_nodes = 0  # non-root nodes
        self._spare: list[Node] = []  # pruned nodes for attach_chain to refill (no stale holders)
        self.version = 0  # bumped whenever a node or root is added or removed (paths may change)

    def root(self, namespace: Namespace) -> Node | None:
        """The namespace's root, or None if nothing is published in it (read-only)."""
        return self.roots.get(namespace)

    def root_or_create(self, namespace: Namespace) -> Node:
        root = self.roots.get(namespace)
        if root is None:
            root = self.roots[namespace] = Node(b"", None, namespace, None, 0, 0, {}, namespace.root_key())
            self.version += 1
        return root

    @staticmethod
    def walk(root: Node | None, contents: list[bytes]) -> list[Node]:
        """Nodes along the longest path from ``root`` spelled by ``contents`` (read-only)."""
        path: list[Node] = []
        node = root
        if node is None:
            return path
        for content in contents:
            node = node.children.get(content)
            if node is None:
                break
            path.append(node)
        return path

    def attach_chain(self, parent: Node, contents: list[bytes], worker_id: str, blocks: list[Block]) -> list[Node]:
        """Make ``blocks[k]`` the copy of the node spelled by ``contents[:k+1]`` below ``parent``
        on ``worker_id``, creating missing nodes (mutates; sets ``block.node``). The worker must
        hold none of these nodes yet. New nodes share one ``Chain`` (no hashing here). Returns
        the nodes in chain order; ``contents`` must not change afterwards."""
        out: list[Node] = []
        append = out.append
        parent.anchor = True  # the STORED event names it as the parent
        k, n = 0, len(contents)
        while k < n:  # nodes that exist already (published on another worker)
            child = parent.children.get(contents[k])
            if child is None:
                break
            child.residency[worker_id] = blocks[k]
            blocks[k].node = child
            append(child)
            parent = child
            k += 1
        if k < n:  # the rest is new: a fresh node has no children, so no lookups
            namespace = parent.namespace
            parent.anchor = True
            chain = Chain(parent, contents[k:] if k else contents)
            depth = parent.depth
            index = 0
            spare = self._spare
            for content, block in zip(chain.contents, blocks[k:] if k else blocks):
                depth += 1
                if spare:  # a node pruned by an eviction: refill it instead of allocating
                    child = parent.children[content] = spare.pop()
                    child.content = content
                    child.parent = parent
                    child.depth = depth
                    child.residency[worker_id] = block
                    child.namespace = namespace
                    child.chain = chain
                    child.index = index
                    child._key = None
                else:
                    child = parent.children[content] = Node(
                        content, parent, namespace, chain, index, depth, {worker_id: block}
                    )
                block.node = child
                append(child)
                parent = child
                index += 1
            chain.nodes = out[k:]
            self.num_nodes += n - k
            self.version += 1
        return out

    def remove_residents(self, nodes: list[Node], worker_id: str) -> None:
        """``remove_resident`` for each node in order (mutates): the batch form for evictions,
        whose victims come deepest first."""
        self.version += 1
        pruned = 0
        spare = self._spare
        for node in nodes:
            residency = node.residency
            del residency[worker_id]
            if residency or node.children:
                continue
            parent = node.parent
            del parent.children[node.content]
            node.parent = None  # detached: a stale reference can no longer reach the trie
            chain = node.chain  # Chain.pruned, inlined: this is the eviction hot loop
            chain_nodes = chain.nodes
            del chain_nodes[node.index :]
            if not chain_nodes:
                chain.joined = None
            if not node.anchor:
                spare.append(node)
            pruned += 1
            if not parent.children and not parent.residency:  # else the usual case: still resident
                self._prune(parent)
        self.num_nodes -= pruned
        if len(spare) > 1024:  # bound what is kept for reuse
            del spare[1024:]

    def remove_resident(self, node: Node, worker_id: str) -> None:
        """Forget that ``worker_id`` holds ``node``; prune it (and childless roots) once nothing
        holds it (mutates). Callers remove deeper nodes first, keeping residency prefix-closed."""
        del node.residency[worker_id]
        self.version += 1
        self._prune(node)

    def _prune(self, node: Node) -> None:
        """Drop ``node`` and its ancestors while they are resident nowhere and childless, then
        the root if it is left childless (mutates)."""
        while not node.residency and not node.children and node.parent is not None:
            parent = node.parent
            del parent.children[node.content]
            node.parent = None  # detached: a stale reference can no longer reach the trie
            node.chain.pruned(node.index)
            self.num_nodes -= 1
            node = parent
        if node.parent is None and not node.children and self.roots.get(node.namespace) is node:
            del self.roots[node.namespace]

    def iter_nodes(self):
        """Every non-root node, parents before children (read-only; for audits)."""
        stack = [child for root in self.roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
