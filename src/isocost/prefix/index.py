"""Per-replica approximate prefix index: which prompt blocks were routed to which replica.

The gateway cannot see an engine's prefix cache, so it remembers what it sent: every
dispatched request's chained block hashes (``isocost.prefix.hashing``) are inserted for the
replica that got it, and each replica's set is bounded, least recently used first, by the
number of blocks its KV cache holds. Like SGLang's approximate radix tree and Dynamo's
approximate KV indexer, it over-reports after the engine evicted on its own and is corrected
only by capacity; that is the price of needing no engine cooperation.

Layout, chosen so that a lookup costs time in the request's blocks, not in replicas:

* ``holders[h]``: the replica holding block hash ``h``, as a plain int while it is the only
  one (the common case, and no set to build or free per block), as a set of two or more
  replicas otherwise;
* ``lru[r]``: replica ``r``'s blocks in recency order, capacity ``capacity[r]`` blocks.

Insertion touches a request's blocks deepest-first, so a prefix's first block is the most
recently used and eviction (from the cold end) removes deep blocks before shallow ones;
the held set thus stays prefix-closed in practice. ``match`` walks the chain from block 0
keeping the set of replicas that held every block so far (a C-level set intersection per
block, shrinking as it goes), records each replica's depth as it drops out, and stops
when none is left: at most ``len(block_hashes)`` steps. A reported match is never longer
than the contiguous run, from the first block, of what was inserted (and not yet
evicted) for that replica.

Replicas are small non-negative ints (the caller's dense slot numbers), so results can fill
numpy arrays indexed by slot directly.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from itertools import islice, takewhile

import numpy as np
import numpy.typing as npt

__all__ = ["PrefixIndex"]

_EMPTY = np.zeros(0, dtype=np.int64)


class PrefixIndex:
    """Block hashes held per replica, LRU-bounded by each replica's KV capacity in blocks."""

    __slots__ = ("_capacity", "_counts", "_holders", "_lru")

    def __init__(self) -> None:
        self._holders: dict[int, int | set[int]] = {}  # one holder: the int; more: a set
        self._lru: dict[int, OrderedDict[int, None]] = {}
        self._capacity: dict[int, int] = {}
        self._counts = np.zeros(16, dtype=np.int64)  # blocks held per replica

    def add_replica(self, replica: int, capacity_blocks: int) -> None:
        """Start tracking ``replica`` (a dense non-negative int) with room for that many blocks."""
        if replica < 0:
            raise ValueError("replica must be a non-negative int")
        if capacity_blocks < 0:
            raise ValueError("capacity_blocks must be >= 0")
        self._lru.setdefault(replica, OrderedDict())
        self._capacity[replica] = capacity_blocks
        if replica >= self._counts.size:
            size = max(replica + 1, 2 * self._counts.size)
            counts = np.zeros(size, dtype=np.int64)
            counts[: self._counts.size] = self._counts
            self._counts = counts
        self.evict(replica, len(self._lru[replica]) - capacity_blocks)

    def num_blocks(self, replica: int) -> int:
        lru = self._lru.get(replica)
        return len(lru) if lru is not None else 0

    @property
    def block_counts(self) -> npt.NDArray[np.int64]:
        """Blocks held per replica, indexed by replica (read-only view; may be longer)."""
        view = self._counts.view()
        view.flags.writeable = False
        return view

    def capacity_blocks(self, replica: int) -> int:
        return self._capacity.get(replica, 0)

    def insert(self, replica: int, block_hashes: Sequence[int]) -> None:
        """Record that ``replica`` now caches these blocks (a prompt's chained hashes)."""
        lru = self._lru[replica]
        holders = self._holders
        claim = holders.setdefault
        before = len(lru)
        for block in reversed(block_hashes):
            if block in lru:
                lru.move_to_end(block)
                continue
            lru[block] = None
            owners = claim(block, replica)
            if owners != replica:  # held elsewhere already (never here: it was not in lru)
                if isinstance(owners, int):
                    holders[block] = {owners, replica}
                else:
                    owners.add(replica)
        added = len(lru) - before
        if added:
            self._counts[replica] += added
            self.evict(replica, len(lru) - self._capacity[replica])

    def evict(self, replica: int, num_blocks: int) -> int:
        """Forget the ``num_blocks`` least recently used blocks of ``replica``; returns how many."""
        lru = self._lru.get(replica)
        if lru is None or num_blocks <= 0:
            return 0
        num_blocks = min(num_blocks, len(lru))
        holders, pop = self._holders, lru.popitem
        for _ in range(num_blocks):
            block = pop(last=False)[0]
            owners = holders[block]
            if isinstance(owners, int):  # it was the only holder (no function call: hot)
                del holders[block]
            else:
                self._drop_shared(block, owners, replica)
        self._counts[replica] -= num_blocks
        return num_blocks

    def discard(self, replica: int, block_hashes: Sequence[int]) -> int:
        """Forget these blocks of ``replica`` (the engine said it evicted them); returns how
        many it held. Blocks it did not hold are ignored."""
        lru = self._lru.get(replica)
        if lru is None:
            return 0
        removed = 0
        for block in block_hashes:
            if lru.pop(block, 0) is None:  # held (the value is None); 0 when absent
                owners = self._holders[block]
                if isinstance(owners, int):
                    del self._holders[block]
                else:
                    self._drop_shared(block, owners, replica)
                removed += 1
        self._counts[replica] -= removed
        return removed

    def remove_replica(self, replica: int) -> None:
        """Forget everything about ``replica`` (it left the fleet or restarted)."""
        lru = self._lru.pop(replica, None)
        self._capacity.pop(replica, None)
        if lru is None:
            return
        self._counts[replica] = 0
        holders = self._holders
        for block in lru:
            owners = holders[block]
            if isinstance(owners, int):
                del holders[block]
            else:
                self._drop_shared(block, owners, replica)

    def match(
        self, block_hashes: Sequence[int]
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """Replicas holding at least the first block, and their contiguous matched blocks.

        Returns ``(replicas, matched_blocks)``, two aligned arrays; replicas absent from
        ``replicas`` match nothing.
        """
        holders = self._holders
        first = holders.get(block_hashes[0]) if block_hashes else None
        if first is None:
            return _EMPTY, _EMPTY
        current = {first} if isinstance(first, int) else first
        depth: dict[int, int] = {}
        for i in range(1, len(block_hashes)):
            if len(current) == 1:  # one replica left: walk its own blocks, no set algebra
                (replica,) = current
                depth[replica] = i + self._run_length(replica, block_hashes, i)
                break
            deeper = holders.get(block_hashes[i])
            if deeper is None:
                kept: set[int] = set()
            elif isinstance(deeper, int):
                kept = {deeper} if deeper in current else set()
            else:
                kept = current & deeper
            if len(kept) < len(current):
                for replica in current - kept:
                    depth[replica] = i
                if not kept:
                    break
            current = kept
        else:
            for replica in current:
                depth[replica] = len(block_hashes)
        replicas = np.fromiter(depth.keys(), dtype=np.int64, count=len(depth))
        matched = np.fromiter(depth.values(), dtype=np.int64, count=len(depth))
        return replicas, matched

    def match_replica(self, replica: int, block_hashes: Sequence[int]) -> int:
        """Contiguous blocks of ``block_hashes`` that ``replica`` holds, from the start."""
        return self._run_length(replica, block_hashes, 0)

    def _run_length(self, replica: int, block_hashes: Sequence[int], start: int) -> int:
        """Consecutive blocks from ``block_hashes[start]`` on that ``replica`` holds."""
        lru = self._lru.get(replica)
        if lru is None:
            return 0
        return len(list(takewhile(lru.__contains__, islice(block_hashes, start, None))))

    def _drop_shared(self, block: int, owners: set[int], replica: int) -> None:
        """``replica`` no longer holds ``block``, which ``owners`` (2 or more) held."""
        owners.discard(replica)
        if len(owners) == 1:
            self._holders[block] = owners.pop()
