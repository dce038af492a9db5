"""Chained block hashes: equal hash at block i means equal content in blocks 0..i.

A prompt is cut into fixed-size blocks (tokens, or characters when no tokenizer is at
hand); block i's hash folds in block i-1's hash, so two prompts share the hash of block i
exactly when they share the whole prefix up to and including that block. Only full blocks
are hashed, as engines cache only full blocks.

Token blocks hash tuples of ints with Python's ``hash``, which is deterministic for ints
across processes (PYTHONHASHSEED salts only str and bytes). Text blocks use BLAKE2b for the
same reason. Both are 63-bit non-negative ints.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

__all__ = ["BLOCK_TOKENS", "ROOT_HASH", "text_block_hashes", "token_block_hashes"]

ROOT_HASH = 0x1505_CAFE  # the "parent" of block 0
# tokens per hashed prompt block, for the prefix index and the simulated engines alike:
# vLLM's default KV block (``EngineLimits.block_size``), so a hash names a cache block
BLOCK_TOKENS = 16
_MASK = (1 << 63) - 1


def token_block_hashes(
    token_ids: Sequence[int], block_size: int, parent: int = ROOT_HASH
) -> list[int]:
    """Chained hashes of every full ``block_size`` block of ``token_ids``."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    hashes: list[int] = []
    full = len(token_ids) - len(token_ids) % block_size
    for start in range(0, full, block_size):
        parent = hash((parent, tuple(token_ids[start : start + block_size]))) & _MASK
        hashes.append(parent)
    return hashes


def text_block_hashes(text: str, block_chars: int, parent: int = ROOT_HASH) -> list[int]:
    """Chained hashes of every full ``block_chars``-byte block of ``text`` (UTF-8)."""
    if block_chars <= 0:
        raise ValueError("block_chars must be positive")
    hashes: list[int] = []
    data = text.encode("utf-8", "surrogatepass")
    full = len(data) - len(data) % block_chars
    for start in range(0, full, block_chars):
        digest = hashlib.blake2b(
            data[start : start + block_chars], digest_size=8, key=parent.to_bytes(8, "little")
        ).digest()
        parent = int.from_bytes(digest, "little") & _MASK
        hashes.append(parent)
    return hashes
