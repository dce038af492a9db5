"""KV hand-offs of a disaggregated engine replica (prefill -> decode), pure, clock passed in.

A prefill replica answers a request that asks for remote decode (vLLM's
``kv_transfer_params: {do_remote_decode: true}``) after its prefill, and keeps the prompt's
KV blocks (``EngineModel.hold_blocks``) until a decode replica pulls them or
``hold_timeout_s`` passes (vLLM frees them after ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``, 480 s
by default). The answer's ``kv_transfer_params`` say where they are (``handoff_params``);
the decode replica sends them back to pull (``KvHandoffs.pull``).

Held blocks are private blocks beside the prompt's cached copies, so the held KV shows in
``kv_cache_usage_perc`` as it does on vLLM, where the finished request keeps its blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from isocost.engine.model import EngineModel

__all__ = ["DEFAULT_HOLD_TIMEOUT_S", "HeldKv", "KvHandoffs", "handoff_params"]

DEFAULT_HOLD_TIMEOUT_S = 480.0  # vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT


@dataclass(frozen=True, slots=True)
class HeldKv:
    """One prefilled prompt's KV, held for a decode replica."""

    request_id: str
    num_tokens: int  # prompt tokens whose KV is held
    block_ids: tuple[int, ...]
    expires_s: float


class KvHandoffs:
    """The KV a prefill replica holds, each until pulled or expired; see the module
    docstring."""

    def __init__(self, model: EngineModel, hold_timeout_s: float = DEFAULT_HOLD_TIMEOUT_S) -> None:
        if hold_timeout_s <= 0:
            raise ValueError("the KV hold timeout must be > 0")
        self.model = model
        self.hold_timeout_s = hold_timeout_s
        self._held: dict[str, HeldKv] = {}  # in expiry order: one timeout for all
        self._next_block_id = 0
        self.num_expired = 0

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, request_id: str, num_tokens: int, now_s: float) -> HeldKv | None:
        """Hold the KV of ``num_tokens`` prompt tokens; None when the engine has no room."""
        self.expire(now_s)
        num_blocks = -(-num_tokens // self.model.block_size)
        if not self.model.hold_blocks(num_blocks):
            return None
        first = self._next_block_id
        self._next_block_id += num_blocks
        block_ids = tuple(range(first, first + num_blocks))
        held = HeldKv(request_id, num_tokens, block_ids, now_s + self.hold_timeout_s)
        self._held[request_id] = held
        return held

    def pull(self, request_id: str, now_s: float) -> HeldKv | None:
        """Release a hand-off's blocks to the decode replica that pulls them; None when it
        is unknown, pulled already or expired."""
        self.expire(now_s)
        held = self._held.pop(request_id, None)
        if held is not None:
            self.model.free_held_blocks(len(held.block_ids))
        return held

    def expire(self, now_s: float) -> int:
        """Free every hand-off held past its timeout; how many were."""
        expired = 0
        for request_id, held in list(self._held.items()):
            if held.expires_s > now_s:
                break
            del self._held[request_id]
            self.model.free_held_blocks(len(held.block_ids))
            expired += 1
        self.num_expired += expired
        return expired

    def next_expiry_s(self) -> float | None:
        return next(iter(self._held.values())).expires_s if self._held else None


def handoff_params(
    held: HeldKv, engine_id: str, host: str, port: int, tp_size: int
) -> dict[str, Any]:
    """The ``kv_transfer_params`` a prefill answer carries, in vLLM's NixlConnector fields
    (``remote_host``/``remote_port``: where to pull, here the engine's own HTTP port)."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": list(held.block_ids),
        "remote_engine_id": engine_id,
        "remote_request_id": held.request_id,
        "remote_host": host,
        "remote_port": port,
        "tp_size": tp_size,
        "remote_num_tokens": held.num_tokens,
    }
