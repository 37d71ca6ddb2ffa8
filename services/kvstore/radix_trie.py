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
dropped too.

Lookups (``root``, ``walk``) are read-only; ``attach_chain`` and ``remove_resident`` mutate.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from .keys import DIGEST_SIZE, BlockKey, Namespace

if TYPE_CHECKING:
    from .block_pool import Block


class Node:
    """A published block key: the chain of block contents from its namespace root."""

    __slots__ = ("content", "parent", "children", "depth", "key", "residency", "namespace")

    def __init__(self, content: bytes, parent: Node | None, key: BlockKey, namespace: Namespace):
        self.content = content
        self.parent = parent
        self.children: dict[bytes, Node] = {}
        self.depth = 0 if parent is None else parent.depth + 1  # root 0, block j at depth j+1
        self.key = key
        self.residency: dict[str, Block] = {}  # worker id -> block holding this node there
        self.namespace = namespace

    @property
    def is_root(self) -> bool:
        return self.parent is None


class RadixTrie:
    """All namespaces' roots and the node count."""

    def __init__(self) -> None:
        self.roots: dict[Namespace, Node] = {}
        self.num_nodes = 0  # non-root nodes

    def root(self, namespace: Namespace) -> Node | None:
        """The namespace's root, or None if nothing is published in it (read-only)."""
        return self.roots.get(namespace)

    def root_or_create(self, namespace: Namespace) -> Node:
        root = self.roots.get(namespace)
        if root is None:
            root = self.roots[namespace] = Node(b"", None, namespace.root_key(), namespace)
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

    def attach_chain(
        self,
        parent: Node,
        contents: list[bytes],
        worker_id: str,
        blocks: list[Block],
        first_material: bytes | None,
    ) -> list[Node]:
        """Make ``blocks[k]`` the copy of the node spelled by ``contents[:k+1]`` below ``parent``
        on ``worker_id``, creating missing nodes (mutates; sets ``block.node``). The worker must
        hold none of these nodes yet. A node's key chains ``blake2b-256(parent key || material)``
        where material is the content, except below a root: ``first_material`` (the leading
        digest form, see ``KeyStream.block_key_material``). Returns the nodes in chain order."""
        out: list[Node] = []
        blake2b = hashlib.blake2b
        for content, block in zip(contents, blocks):
            child = parent.children.get(content)
            if child is None:
                material = content if parent.parent is not None else first_material
                key = blake2b(parent.key + material, digest_size=DIGEST_SIZE).digest()  # a BlockKey
                child = Node(content, parent, key, parent.namespace)
                parent.children[content] = child
                self.num_nodes += 1
            child.residency[worker_id] = block
            block.node = child
            out.append(child)
            parent = child
        return out

    def remove_resident(self, node: Node, worker_id: str) -> None:
        """Forget that ``worker_id`` holds ``node``; prune it (and childless roots) once nothing
        holds it (mutates). Callers remove deeper nodes first, keeping residency prefix-closed."""
        del node.residency[worker_id]
        while not node.residency and not node.children and node.parent is not None:
            parent = node.parent
            del parent.children[node.content]
            node.parent = None  # detached: a stale reference can no longer reach the trie
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
