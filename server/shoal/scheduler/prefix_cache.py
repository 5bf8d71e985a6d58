"""Prefix caches over the KV pool: a radix tree of token ids whose nodes own KV slots.

Ownership: a slot belongs either to the free list, to a request (tokens it computed that are not
in the cache), or to the cache (a node's `slots`). A request that matched a prefix holds a lock
on the node that ends the match; locked nodes and their ancestors are never evicted.
"""

from __future__ import annotations

import heapq
import itertools
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from shoal.engine.kv_pool import TokenSlotAllocator


@dataclass(eq=False)
class TreeNode:
    key: list[int] = field(default_factory=list)        # token ids on the edge into this node
    slots: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    parent: TreeNode | None = None
    children: dict[int, TreeNode] = field(default_factory=dict)  # first token -> child
    lock_ref: int = 0
    last_access: float = field(default_factory=time.monotonic)

    @property
    def is_leaf(self) -> bool:
        return not self.children


@dataclass(frozen=True)
class PrefixMatch:
    slots: torch.Tensor  # KV slots of the matched prefix, in order
    node: TreeNode       # the node the match ends at: lock it while the slots are in use


class PrefixCache(ABC):
    """What the scheduler needs from a prefix cache; `NoPrefixCache` is the disabled one."""

    shares: bool = True  # whether a request can ever reuse another's KV through this cache

    @abstractmethod
    def match(self, ids: list[int]) -> PrefixMatch:
        """The longest cached prefix of `ids`. Does not change what is cached (it may split a
        node so the match ends on a node boundary). The slots are only safe to use after
        `lock(match.node)`."""

    @abstractmethod
    def insert(self, ids: list[int], slots: torch.Tensor) -> int:
        """Cache `slots` as the KV of `ids`. Returns how many leading tokens were already cached;
        the caller still owns (and must free) its own slots for those tokens, the cache owns the
        rest from now on."""

    @abstractmethod
    def lock(self, node: TreeNode) -> None:
        """Protect `node` and its ancestors from eviction (reference counted)."""

    @abstractmethod
    def unlock(self, node: TreeNode) -> None: ...

    @abstractmethod
    def evict(self, num_slots: int) -> int:
        """Free at least `num_slots` slots of unlocked entries, least recently used first, if
        that many are evictable. Returns how many were freed (may be more than asked)."""

    @property
    @abstractmethod
    def evictable_size(self) -> int: ...

    @property
    @abstractmethod
    def total_size(self) -> int:
        """Slots the cache owns, locked or not."""

    @abstractmethod
    def reset(self) -> None:
        """Free every slot the cache owns. Only valid when no request holds a lock."""


class NoPrefixCache(PrefixCache):
    """`--disable-radix-cache`: nothing is ever cached."""

    shares = False

    def __init__(self) -> None:
        self._root = TreeNode()

    def match(self, ids: list[int]) -> PrefixMatch:
        return PrefixMatch(torch.empty(0, dtype=torch.int64), self._root)

    def insert(self, ids: list[int], slots: torch.Tensor) -> int:
        return len(ids)  # "already cached": the caller frees all of its slots

    def lock(self, node: TreeNode) -> None:
        pass

    def unlock(self, node: TreeNode) -> None:
        pass

    def evict(self, num_slots: int) -> int:
        return 0

    @property
    def evictable_size(self) -> int:
        return 0

    @property
    def total_size(self) -> int:
        return 0

    def reset(self) -> None:
        pass


class RadixCache(PrefixCache):
    def __init__(self, allocator: TokenSlotAllocator) -> None:
        self.allocator = allocator
        self.root = TreeNode(lock_ref=1)  # the root is never evicted
        self._evictable = 0
        self._protected = 0

    @property
    def evictable_size(self) -> int:
        return self._evictable

    @property
    def total_size(self) -> int:
        return self._evictable + self._protected

    def match(self, ids: list[int]) -> PrefixMatch:
        end, _ = self._descend(ids)
        pieces, node = [], end
        while node is not self.root:
            pieces.append(node.slots)
            node = node.parent  # type: ignore[assignment]
        slots = torch.cat(pieces[::-1]) if pieces else torch.empty(0, dtype=torch.int64)
        return PrefixMatch(slots, end)

    def insert(self, ids: list[int], slots: torch.Tensor) -> int:
        node, matched = self._descend(ids)
        if matched < len(ids):
            leaf = TreeNode(key=ids[matched:], slots=slots[matched:].clone(), parent=node)
            node.children[ids[matched]] = leaf
            self._evictable += len(leaf.key)
        return matched

    def lock(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: TreeNode) -> None:
        while node is not self.root:
            node.lock_ref -= 1
            assert node.lock_ref >= 0, "unlock without lock"
            if node.lock_ref == 0:
                self._protected -= len(node.key)
                self._evictable += len(node.key)
            node = node.parent  # type: ignore[assignment]

    def evict(self, num_slots: int) -> int:
        order = itertools.count()
        heap = [(leaf.last_access, next(order), leaf) for leaf in self._leaves()
                if leaf.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_slots and heap:
            _, _, leaf = heapq.heappop(heap)
            self.allocator.free(leaf.slots)
            freed += len(leaf.key)
            self._evictable -= len(leaf.key)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[0]]
            if parent is not self.root and parent.is_leaf and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, next(order), parent))
        return freed

    def reset(self) -> None:
        assert self._protected == 0, "reset while requests hold cached prefixes"
        for node in self._nodes():
            self.allocator.free(node.slots)
        self.root.children.clear()
        self._evictable = 0

    def _descend(self, ids: list[int]) -> tuple[TreeNode, int]:
        """Walk down along `ids`, splitting the last edge where the match ends inside it, and
        touching every node passed. Returns the deepest node reached and the tokens matched."""
        node, matched = self.root, 0
        now = time.monotonic()
        while matched < len(ids) and ids[matched] in node.children:
            child = node.children[ids[matched]]
            n = common_prefix_len(child.key, ids[matched:])
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            matched += n
            node = child
        return node, matched

    def _split(self, node: TreeNode, n: int) -> TreeNode:
        """Cut `node`'s edge after `n` tokens; returns the new upper node."""
        parent = node.parent
        assert parent is not None
        upper = TreeNode(key=node.key[:n], slots=node.slots[:n], parent=parent,
                         lock_ref=node.lock_ref, last_access=node.last_access)
        upper.children[node.key[n]] = node
        parent.children[node.key[0]] = upper
        node.key, node.slots, node.parent = node.key[n:], node.slots[n:], upper
        return upper

    def _nodes(self) -> list[TreeNode]:
        nodes, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        return nodes

    def _leaves(self) -> list[TreeNode]:
        return [node for node in self._nodes() if node.is_leaf]


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
