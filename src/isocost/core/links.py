"""KV-transfer links between replicas: what a prefill -> decode hand-off costs.

A disaggregated request is prefilled on one replica and decoded on another; the decode
replica pulls the KV of the tokens it does not hold already. That pull takes::

    kv_transfer_s = latency_s + tokens * kv_bytes_per_token / bandwidth_bytes_per_s

``kv_bytes_per_token`` is the whole model's KV per token (``CostModel.kv_bytes_per_token``,
all layers, all tensor-parallel shards): a TP group pulls its shards in parallel over as
many links, which ``bandwidth_bytes_per_s`` (per replica) absorbs. Bandwidths are what one
hand-off can drive in one direction, taken a little below the line rate (protocol and
RDMA overheads, NIXL/UCX measure 80-90% of line rate on large messages):

* ``nvlink``: NVLink 4 on H100/H200 SXM, 18 links x 25 GB/s = 450 GB/s per direction per
  GPU (NVIDIA H100 datasheet: 900 GB/s bidirectional); taken at 400 GB/s, 5 us latency.
  Only within one node (P and D on the same HGX board).
* ``infiniband``: NDR 400 Gb/s per HCA (NVIDIA ConnectX-7 / Quantum-2 datasheets), one HCA
  per GPU on DGX H100: 50 GB/s line rate, taken at 45 GB/s, 10 us RDMA latency.
* ``roce``: RoCE v2 on 200 Gb/s Ethernet NICs (ConnectX-6 Dx / -7, the common cloud
  build): 25 GB/s line rate, taken at 22 GB/s, 20 us latency.
* ``tcp``: a 25 Gb/s Ethernet NIC without RDMA (a typical cloud VM): 3.1 GB/s line rate,
  taken at 2.5 GB/s (kernel copies), 100 us latency.

For scale: Llama-3.1-8B (128 KiB of KV per token) moving an 8k-token prompt takes 2.7 ms
over NVLink, 24 ms over InfiniBand, 49 ms over RoCE and 0.43 s over TCP.
Pure: no I/O; override a figure with ``dataclasses.replace`` where a fabric differs.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BUILTIN_LINKS", "LINK_KINDS", "Link", "kv_transfer_s", "link"]

_GB = 1e9
_US = 1e-6


@dataclass(frozen=True, slots=True)
class Link:
    """One kind of replica-to-replica link for KV hand-offs."""

    kind: str  # "nvlink", "infiniband", "roce" or "tcp"
    bandwidth_bytes_per_s: float  # per direction, what one hand-off can drive
    latency_s: float  # per transfer: connection set-up, RDMA handshake

    def __post_init__(self) -> None:
        if self.bandwidth_bytes_per_s <= 0 or self.latency_s < 0:
            raise ValueError(f"link {self.kind}: bandwidth must be > 0 and latency >= 0")


BUILTIN_LINKS: dict[str, Link] = {
    "nvlink": Link("nvlink", 400 * _GB, 5 * _US),
    "infiniband": Link("infiniband", 45 * _GB, 10 * _US),
    "roce": Link("roce", 22 * _GB, 20 * _US),
    "tcp": Link("tcp", 2.5 * _GB, 100 * _US),
}
LINK_KINDS: tuple[str, ...] = tuple(BUILTIN_LINKS)


def link(kind: str) -> Link:
    """The built-in link of ``kind``; an unknown kind raises ``KeyError`` naming the valid."""
    found = BUILTIN_LINKS.get(kind)
    if found is None:
        raise KeyError(f"unknown link {kind!r}; valid: {', '.join(LINK_KINDS)}")
    return found


def kv_transfer_s(tokens: float, kv_bytes_per_token: float, via: Link) -> float:
    """Seconds to move the KV of ``tokens`` tokens over ``via`` (0 tokens: nothing to move,
    no latency paid)."""
    if tokens <= 0:
        return 0.0
    return via.latency_s + tokens * kv_bytes_per_token / via.bandwidth_bytes_per_s
