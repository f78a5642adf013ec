"""A radix tree of cached prefixes with SGLang's semantics.

Follows SGLang ``mem_cache/radix_cache.py``: edges carry runs of tokens; a lookup returns the
longest cached prefix (page-aligned when ``page_size > 1``) and splits a node when the match
ends inside its run; nodes on a running request's path are locked (``lock_ref``) and never
evicted; eviction removes unlocked *leaves*, least recently used first (or least frequently
used, FIFO, MRU via the strategy), and a parent whose last child went becomes a leaf itself.
Extra keys (cache salt, LoRA) live in separate namespaces under the root, so no match crosses
them (SGLang's ``RadixKey.extra_key``).

The tree stores *units*: token ids for a token-level cache, or block keys (``unit_tokens`` =
block size) when a trace only carries block ids. Capacity and eviction are counted in units;
``block_size`` (for the common interface) is ``page_size * unit_tokens``.
Time for LRU is a logical counter, so the structure needs no clock.
"""

from __future__ import annotations

import heapq
from typing import Callable, Hashable, Sequence

from prefixroute.core.caches.base import CacheEventListener, CacheStats, cacheable_blocks
from prefixroute.core.errors import ConfigError


class TreeNode:
    __slots__ = ("children", "parent", "key", "lock_ref", "last_access", "hit_count",
                 "created", "namespace", "removed")

    def __init__(self, parent: "TreeNode | None", key: tuple, namespace: Hashable = None):
        self.children: dict[Hashable, TreeNode] = {}
        self.parent = parent
        self.key = key  # the run of units on the edge into this node
        self.lock_ref = 0
        self.last_access = 0
        self.hit_count = 0
        self.created = 0
        self.namespace = namespace
        self.removed = False


# Eviction strategies: the priority a leaf is popped by (smallest first).
EVICTION_POLICIES: dict[str, Callable[[TreeNode], tuple]] = {
    "lru": lambda n: (n.last_access,),
    "lfu": lambda n: (n.hit_count, n.last_access),
    "fifo": lambda n: (n.created,),
    "mru": lambda n: (-n.last_access,),
}


class RadixCache:
    """SGLang-style radix tree: ``match_prefix``, ``insert``, ``evict``, lock references."""

    def __init__(self, capacity_units: int, page_size: int = 1, unit_tokens: int = 1,
                 eviction_policy: str = "lru", listener: CacheEventListener | None = None):
        if not isinstance(capacity_units, int) or capacity_units < 0:
            raise ConfigError(f"capacity must be a non-negative integer, got {capacity_units!r}")
        if not isinstance(page_size, int) or page_size < 1:
            raise ConfigError(f"page size must be an integer of at least 1, got {page_size!r}")
        if eviction_policy not in EVICTION_POLICIES:
            raise ConfigError(f"unknown eviction policy {eviction_policy!r}; choose one of "
                              f"{', '.join(EVICTION_POLICIES)}")
        self.capacity_units = capacity_units
        self.page_size = page_size
        self.unit_tokens = unit_tokens
        self.block_size = page_size * unit_tokens
        self.eviction_policy = eviction_policy
        self._priority = EVICTION_POLICIES[eviction_policy]
        self.listener = listener
        self.stats = CacheStats()
        self.root = TreeNode(None, ())
        self.root.lock_ref = 1  # the root is never evicted
        self._tick = 0
        self.total_units = 0  # units stored in the tree
        self.protected_units = 0  # units on locked paths
        self._reserved: dict[Hashable, tuple[TreeNode, int]] = {}  # owner -> (locked node, units)
        self._reserved_units = 0
        # Eviction candidates: a lazy heap of (priority, seq, leaf). An entry is pushed whenever
        # a leaf's priority or evictability may have changed and checked when popped, so an
        # eviction costs O(log n) per leaf instead of SGLang's scan of every leaf.
        self._heap: list = []
        self._seq = 0

    # -- sizes --------------------------------------------------------------------------------
    @property
    def capacity_blocks(self) -> int:
        return self.capacity_units // self.page_size

    @property
    def cached_blocks(self) -> int:
        return self.total_units // self.page_size

    @property
    def evictable_units(self) -> int:
        return self.total_units - self.protected_units

    # -- the four verbs -----------------------------------------------------------------------
    def match_prefix(self, units: Sequence[Hashable], namespace: Hashable = None,
                     split: bool = True) -> tuple[int, TreeNode]:
        """Longest cached, page-aligned prefix of ``units``: (matched units, last node).

        Touches the matched path (access time, hit count); with ``split`` a match that ends
        inside a node's run splits that node so the returned node ends exactly there.
        """
        page = self.page_size
        units = units[:len(units) // page * page]
        node = self._namespace_root(namespace, create=False)
        if node is None:
            return 0, self.root
        self._tick += 1
        now = self._tick
        matched = 0
        n = len(units)
        while matched < n:
            child = node.children.get(self._child_key(units, matched))
            if child is None:
                break
            run = child.key
            length = self._common_length(run, units, matched)
            child.last_access = now
            if not child.children:
                self._push(child)  # its eviction priority changed
            if length < len(run):
                if length and split:
                    child = self._split(child, length)
                    matched += length
                    node = child
                break
            child.hit_count += 1
            matched += length
            node = child
        if not node.children:
            self._push(node)
        return matched, node

    def insert(self, units: Sequence[Hashable], namespace: Hashable = None) -> int:
        """Cache ``units`` (truncated to whole pages); returns how many were already cached.

        Makes room first by evicting unlocked leaves; if that is not enough the tail that does
        not fit is not cached (SGLang would have failed the allocation earlier).
        """
        page = self.page_size
        units = units[:len(units) // page * page]
        node = self._namespace_root(namespace, create=True)
        self._tick += 1
        now = self._tick
        pos = 0
        n = len(units)
        while pos < n:
            child = node.children.get(self._child_key(units, pos))
            if child is None:
                break
            length = self._common_length(child.key, units, pos)
            child.last_access = now
            if not child.children:
                self._push(child)  # its eviction priority changed
            if length < len(child.key):
                child = self._split(child, length)
            pos += length
            node = child
        already = pos
        remaining = n - pos
        if remaining:
            free = self.capacity_units - self.total_units - self._reserved_units
            if remaining > free:
                self.evict_units(remaining - free, keep=node)
                free = self.capacity_units - self.total_units - self._reserved_units
                remaining = min(remaining, free // page * page)
            if remaining > 0:
                leaf = TreeNode(node, tuple(units[pos:pos + remaining]), node.namespace)
                leaf.last_access = now
                leaf.created = now
                node.children[self._child_key(units, pos)] = leaf
                self.total_units += remaining
                self._push(leaf)
                self._notify_stored(leaf)
        elif not node.children:
            self._push(node)
        return already

    def evict_units(self, num_units: int, keep: TreeNode | None = None) -> int:
        """Evict unlocked leaves in policy order until ``num_units`` are freed; never a node on
        the path to ``keep``."""
        keep_path = set()
        while keep is not None:
            keep_path.add(id(keep))
            keep = keep.parent
        heap = self._heap
        spared = []
        freed = 0
        while freed < num_units and heap:
            priority, _, leaf = heapq.heappop(heap)
            if (leaf.removed or leaf.children or leaf.lock_ref > 0
                    or priority != self._priority(leaf)):
                continue  # stale entry: a fresher one exists, or the leaf is not evictable now
            if id(leaf) in keep_path:
                spared.append((priority, leaf))
                continue
            parent = leaf.parent
            del parent.children[self._child_key(leaf.key, 0)]
            leaf.removed = True
            freed += len(leaf.key)
            self.total_units -= len(leaf.key)
            self.stats.evicted_blocks += len(leaf.key) // self.page_size
            self._notify_removed(leaf)
            # A parent whose last child went is a leaf now (namespace anchors hold no units).
            if parent.key != () and not parent.children:
                self._push(parent)
        for priority, leaf in spared:
            self._push(leaf)
        if len(heap) > 4 * (self.total_units + 64):
            self._rebuild_heap()
        return freed

    def inc_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root and node is not None and node.key != ():
            if node.lock_ref == 0:
                self.protected_units += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root and node is not None and node.key != ():
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.protected_units -= len(node.key)
                if not node.children:
                    self._push(node)
            node = node.parent

    # -- the common PrefixCache interface -------------------------------------------------------
    def match(self, keys: Sequence[Hashable], namespace: Hashable = None) -> int:
        """Leading blocks cached, without changing the tree."""
        matched, _ = self._peek(keys, namespace)
        return matched // self.page_size

    def admit(self, owner: Hashable, keys: Sequence[Hashable], num_tokens: int,
              namespace: Hashable = None) -> int | None:
        """Match (last-token rule: at most ``floor((n-1)/B)`` blocks), lock the matched path and
        reserve room for the rest; ``None`` when even eviction cannot make room."""
        if owner in self._reserved:
            raise ConfigError(f"request {owner!r} is already admitted")
        limit_units = cacheable_blocks(num_tokens, self.block_size) * self.page_size
        matched, node = self.match_prefix(keys[:limit_units], namespace)
        needed = max(0, -(-num_tokens // self.unit_tokens) - matched)
        free = self.capacity_units - self.total_units - self._reserved_units
        if needed > free:
            self.inc_lock_ref(node)  # protect our own prefix while making room
            self.evict_units(needed - free)
            self.dec_lock_ref(node)
            free = self.capacity_units - self.total_units - self._reserved_units
            if needed > free:
                return None
        self.inc_lock_ref(node)
        self._reserved[owner] = (node, needed)
        self._reserved_units += needed
        cached_tokens = matched * self.unit_tokens
        self.stats.queried_tokens += num_tokens
        self.stats.hit_tokens += cached_tokens
        return cached_tokens

    def commit(self, owner: Hashable, keys: Sequence[Hashable], computed_tokens: int,
               namespace: Hashable = None) -> None:
        """Insert the computed prefix and move the owner's lock to its end
        (``cache_unfinished_req`` / ``cache_finished_req``)."""
        node, reserved = self._reserved[owner]
        units = list(keys[:computed_tokens // self.unit_tokens])
        # The reservation turns into tree units: release it before inserting so the room is
        # there, and take back what is still pending.
        self._reserved_units -= reserved
        before = self.total_units
        self.insert(units, namespace)
        added = self.total_units - before
        self.stats.stored_blocks += added // self.page_size
        _, new_node = self._peek(units[:len(units) // self.page_size * self.page_size],
                                 namespace, want_node=True)
        self.inc_lock_ref(new_node)
        self.dec_lock_ref(node)
        still = max(0, reserved - added)
        self._reserved[owner] = (new_node, still)
        self._reserved_units += still

    def release(self, owner: Hashable) -> None:
        node, reserved = self._reserved.pop(owner)
        self._reserved_units -= reserved
        self.dec_lock_ref(node)

    def evict(self, num_blocks: int) -> int:
        return self.evict_units(num_blocks * self.page_size) // self.page_size

    def reset(self) -> bool:
        if self._reserved:
            return False
        self.root = TreeNode(None, ())
        self.root.lock_ref = 1
        self.total_units = 0
        self.protected_units = 0
        self._heap = []
        if self.listener is not None:
            self.listener.on_cleared()
        return True

    # -- internals ----------------------------------------------------------------------------
    def _namespace_root(self, namespace: Hashable, create: bool) -> TreeNode | None:
        if namespace is None:
            return self.root
        node = self.root.children.get(("ns", namespace))
        if node is None and create:
            node = TreeNode(self.root, (), namespace)
            node.lock_ref = 1  # namespace anchors hold no units and are never evicted
            self.root.children[("ns", namespace)] = node
        return node

    def _child_key(self, units: Sequence[Hashable], pos: int) -> Hashable:
        if self.page_size == 1:
            return units[pos]
        return tuple(units[pos:pos + self.page_size])

    def _common_length(self, run: tuple, units: Sequence[Hashable], pos: int) -> int:
        page = self.page_size
        limit = min(len(run), len(units) - pos)
        i = 0
        while i < limit and run[i] == units[pos + i]:
            i += 1
        return i // page * page

    def _split(self, child: TreeNode, length: int) -> TreeNode:
        """Cut ``child``'s run after ``length`` units; returns the new upper node."""
        parent = child.parent
        upper = TreeNode(parent, child.key[:length], child.namespace)
        upper.last_access = child.last_access
        upper.hit_count = child.hit_count
        upper.created = child.created
        upper.lock_ref = child.lock_ref
        parent.children[self._child_key(child.key, 0)] = upper
        child.key = child.key[length:]
        child.parent = upper
        upper.children[self._child_key(child.key, 0)] = child
        return upper

    def _peek(self, units: Sequence[Hashable], namespace: Hashable,
              want_node: bool = False) -> tuple[int, TreeNode]:
        page = self.page_size
        units = units[:len(units) // page * page]
        node = self._namespace_root(namespace, create=False)
        if node is None:
            return 0, self.root
        matched = 0
        n = len(units)
        while matched < n:
            child = node.children.get(self._child_key(units, matched))
            if child is None:
                break
            length = self._common_length(child.key, units, matched)
            if length < len(child.key):
                if want_node and length:
                    child = self._split(child, length)
                    matched += length
                    node = child
                else:
                    matched += length
                break
            matched += length
            node = child
        return matched, node

    def _push(self, node: TreeNode) -> None:
        if node.key != () and not node.removed:
            self._seq += 1
            heapq.heappush(self._heap, (self._priority(node), self._seq, node))

    def _rebuild_heap(self) -> None:
        self._heap = []
        for leaf in self._leaves():
            self._push(leaf)

    def _leaves(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self.root and node.key != ():
                yield node

    def _path_units(self, node: TreeNode) -> list:
        runs = []
        while node is not None and node.key != ():
            runs.append(node.key)
            node = node.parent
        out: list = []
        for run in reversed(runs):
            out.extend(run)
        return out

    def _notify_stored(self, leaf: TreeNode) -> None:
        if self.listener is None:
            return
        start = self._path_units(leaf.parent)
        parent = start[-1] if start else None
        self.listener.on_stored(list(leaf.key), parent, None)

    def _notify_removed(self, leaf: TreeNode) -> None:
        if self.listener is not None:
            self.listener.on_removed(list(leaf.key))
