"""A paged KV-cache block pool with automatic prefix caching (vLLM-style, counts only).

The pool holds ``num_blocks`` blocks of ``block_size`` tokens. It stores no tensors, only
which blocks are in use and which full prompt blocks are cached under their chained hash
(``isocost.prefix.hashing.token_block_hashes``), so a block is named by its hash:

* a *private* block belongs to one request and has no hash yet (a partial block, a
  generated-token block, or a prompt block still being prefilled);
* a *cached* block has a hash and a reference count; several requests that share a
  prefix share its cached blocks;
* a cached block whose count drops to zero stays cached but becomes *free*: it sits in an
  LRU queue and is evicted only when an allocation finds no never-cached free block left.

Invariant: ``num_free_uncached + len(free cached) + in-use blocks == num_blocks``, where
in-use blocks are private blocks plus cached blocks with a positive reference count.
Unlike vLLM, an allocation prefers never-cached free blocks to evicting cached ones, which
only keeps cached prefixes alive longer.

With ``log_changes`` the pool also keeps, in order, what an engine's KV-cache events
report: blocks newly cached (with the token ids the committer gives) and blocks evicted.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from isocost.engine.records import BlocksEvicted, BlocksStored, CacheChange

__all__ = ["BlockPool"]


class BlockPool:
    """Counts of free, private and cached blocks; cached blocks keyed by chained hash."""

    __slots__ = ("_free_cached", "_refs", "changes", "num_blocks", "num_free_uncached")

    def __init__(self, num_blocks: int, *, log_changes: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.num_free_uncached = num_blocks
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # LRU first
        self._refs: dict[int, int] = {}  # hash -> requests holding the cached block
        # blocks cached and evicted, in order, until the owner takes them (None: not kept)
        self.changes: list[CacheChange] | None = [] if log_changes else None

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take (never-cached ones plus evictable cached ones)."""
        return self.num_free_uncached + len(self._free_cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free_uncached - len(self._free_cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1 (vLLM's ``kv_cache_usage_perc``)."""
        return self.num_used / self.num_blocks

    def is_cached(self, block_hash: int) -> bool:
        return block_hash in self._refs or block_hash in self._free_cached

    def match(self, block_hashes: Sequence[int], max_blocks: int) -> tuple[int, int]:
        """``(hit blocks, how many of them are free)`` for the longest cached prefix of
        ``block_hashes``, at most ``max_blocks`` long."""
        hits = free_hits = 0
        for block_hash in block_hashes[:max_blocks]:
            if block_hash in self._refs:
                hits += 1
            elif block_hash in self._free_cached:
                hits += 1
                free_hits += 1
            else:
                break
        return hits, free_hits

    def acquire(self, block_hashes: Sequence[int]) -> None:
        """Take a reference on each cached block in ``block_hashes`` (all must be cached)."""
        for block_hash in block_hashes:
            if block_hash in self._refs:
                self._refs[block_hash] += 1
            else:
                del self._free_cached[block_hash]
                self._refs[block_hash] = 1

    def allocate(self, num_blocks: int) -> bool:
        """Take ``num_blocks`` private blocks, evicting LRU cached ones if needed; False
        (and nothing taken) when too few are free."""
        if num_blocks > self.num_free:
            return False
        from_uncached = min(num_blocks, self.num_free_uncached)
        self.num_free_uncached -= from_uncached
        evicted = [
            self._free_cached.popitem(last=False)[0] for _ in range(num_blocks - from_uncached)
        ]
        if evicted and self.changes is not None:
            self.changes.append(BlocksEvicted(tuple(evicted)))
        return True

    def commit(
        self,
        block_hashes: Sequence[int],
        parent: int | None = None,
        token_ids: Sequence[int] = (),
    ) -> None:
        """Turn private blocks, now full of prompt tokens, into the cached blocks
        ``block_hashes`` (in order); a hash already cached is shared and its copy freed.
        ``parent`` (the block before them) and ``token_ids`` (theirs, a whole number of
        equal blocks) name what is newly cached in ``changes``."""
        refs = self._refs
        free_cached = self._free_cached
        copies = 0
        new: list[int] = []  # positions newly cached
        for i, block_hash in enumerate(block_hashes):
            count = refs.get(block_hash)
            if count is not None:
                refs[block_hash] = count + 1
                copies += 1
            else:
                if block_hash in free_cached:
                    del free_cached[block_hash]
                    copies += 1
                else:
                    new.append(i)
                refs[block_hash] = 1
        self.num_free_uncached += copies
        if new and self.changes is not None:
            self._log_stored(block_hashes, new, parent, token_ids)

    def _log_stored(
        self,
        block_hashes: Sequence[int],
        new: list[int],
        parent: int | None,
        token_ids: Sequence[int],
    ) -> None:
        """One ``BlocksStored`` per run of consecutive newly cached blocks."""
        assert self.changes is not None
        size = len(token_ids) // len(block_hashes)
        start = new[0]
        for end, following in zip(new, [*new[1:], None], strict=True):
            if following == end + 1:
                continue
            self.changes.append(
                BlocksStored(
                    tuple(block_hashes[start : end + 1]),
                    block_hashes[start - 1] if start else parent,
                    tuple(token_ids[start * size : (end + 1) * size]),
                )
            )
            if following is not None:
                start = following

    def release(self, cached_hashes: Sequence[int], num_private: int) -> None:
        """Return a request's blocks. Cached ones are released last block first, so a
        prefix's tail is evicted before its head."""
        self.num_free_uncached += num_private
        refs = self._refs
        free_cached = self._free_cached
        for block_hash in reversed(cached_hashes):
            count = refs.pop(block_hash)
            if count > 1:
                refs[block_hash] = count - 1
            else:
                free_cached[block_hash] = None
