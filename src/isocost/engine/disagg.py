"""Disaggregated serving over HTTP: vLLM's two-step protocol between engine replicas.

1. A client (the gateway, vLLM's toy proxy) sends the *prefill* request to a ``prefill`` (or
   ``both``) replica with ``kv_transfer_params: {do_remote_decode: true}`` and
   ``max_tokens: 1``. The replica prefills, holds the prompt's KV (``handoff.KvHandoffs``)
   and answers with ``kv_transfer_params`` naming itself (``handoff.handoff_params``).
2. The client sends the original request, with those params, to a ``decode`` (or
   ``both``) replica. Before it is queued the decode replica *pulls* the KV: a real HTTP
   call, ``POST /kv/pull`` on the prefill replica (vLLM's NIXL side channel in miniature),
   which releases the held blocks and says how many prompt tokens they cover; then the
   transfer itself is waited out in modelled time: ``core.links.kv_transfer_s`` of the
   tokens the decode replica's own prefix cache lacks, over the replica's ``link``. The
   request is then admitted with those tokens computed (``RequestSpec.kv_ready_tokens``)
   and decodes without their prefill. The answer says the transfer's modelled time in
   ``x-isocost-kv-transfer-ms`` (``KV_TRANSFER_MS_HEADER``).

A pull that fails (the prefill replica is gone, answers an error, or no longer holds the
KV: pulled already, expired, restarted) fails the decode request with 502
``kv_transfer_failed`` before anything is queued, so the client can prefill again
elsewhere. A role refuses the other role's half (400): a ``prefill`` replica takes no
``do_remote_prefill`` request, a ``decode`` replica no ``do_remote_decode`` one; plain
requests go anywhere, as on vLLM. Where to pull from comes from the client, so it is
checked before anything is sent (400 ``kv_transfer_params``): ``remote_host`` a bare
hostname or IP literal, ``remote_port`` a TCP port; nothing else can pick the pull's
host, port or path.
"""

from __future__ import annotations

import asyncio
import dataclasses

import aiohttp
import msgspec
from aiohttp import web
from yarl import URL

from isocost.core.hosts import is_host, is_port
from isocost.core.jsontext import UNDECODABLE
from isocost.core.links import kv_transfer_s
from isocost.engine.intake import expect_continue, read_body
from isocost.engine.records import RequestSpec
from isocost.engine.replica import ServedReplica
from isocost.openai.errors import ApiError
from isocost.openai.requests import KvTransferParams, decode_body
from isocost.openai.responses import json_response

__all__ = [
    "PULL_PATH",
    "KvSource",
    "PulledKv",
    "add_pull_route",
    "kv_source",
    "pull_kv",
]

PULL_PATH = "/kv/pull"
_PULL_TIMEOUT_S = 10.0


class _PullRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    remote_request_id: str
    remote_engine_id: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class PulledKv:
    """A decode replica's pulled KV: the request to queue and the transfer's cost."""

    spec: RequestSpec  # with the pulled tokens as computed ones (``kv_ready_tokens``)
    moved_tokens: int  # tokens whose KV crossed the link (the rest was cached here)
    transfer_s: float  # modelled seconds of the transfer


@dataclasses.dataclass(frozen=True, slots=True)
class KvSource:
    """Where a decode request's KV waits, checked: the pull's URL and the held request."""

    url: URL
    request_id: str
    engine_id: str | None


def kv_source(replica: ServedReplica, params: KvTransferParams | None) -> KvSource | None:
    """The prefill replica a ``do_remote_prefill`` request pulls from (None for any other
    request); 400 for the half of the two-step protocol this replica's role does not
    serve, and for a pull address that is not a host and a port."""
    if params is None:
        return None
    role = replica.spec.role
    refused = {"prefill": params.do_remote_prefill, "decode": params.do_remote_decode}
    if refused.get(role, False):
        other = "do_remote_prefill" if role == "prefill" else "do_remote_decode"
        raise _bad_params(f"this replica's role is {role}: it takes no {other} request")
    if not params.do_remote_prefill:
        return None
    host, port, remote_id = params.remote_host, params.remote_port, params.remote_request_id
    if not host or port is None or not remote_id:
        raise _bad_params("do_remote_prefill needs remote_host, remote_port and remote_request_id")
    if not is_host(host):
        raise _bad_params(f"remote_host must be a host name or an IP address, got {host[:100]!r}")
    if not is_port(port):
        raise _bad_params(f"remote_port must be a TCP port (1..65535), got {port}")
    url = URL.build(scheme="http", host=host, port=port, path=PULL_PATH)
    return KvSource(url, remote_id, params.remote_engine_id)


def _bad_params(message: str) -> ApiError:
    return ApiError(400, message, param="kv_transfer_params")


def _transfer_failed(reason: str) -> ApiError:
    return ApiError(
        502, f"KV transfer failed: {reason}", type_="server_error", code="kv_transfer_failed"
    )


async def pull_kv(
    session: aiohttp.ClientSession,
    replica: ServedReplica,
    source: KvSource,
    spec: RequestSpec,
) -> PulledKv:
    """Pull ``spec``'s prompt KV from the prefill replica at ``source`` and wait out the
    transfer; ApiError 502 ``kv_transfer_failed`` when it cannot be had."""
    local_tokens = replica.model.cached_prefix_tokens(spec.block_hashes)
    body = {"remote_request_id": source.request_id, "remote_engine_id": source.engine_id}
    try:
        async with session.post(
            source.url,
            json=body,
            timeout=aiohttp.ClientTimeout(total=_PULL_TIMEOUT_S),
        ) as answer:
            data = await answer.read()
            if answer.status != 200:
                raise _transfer_failed(f"the prefill replica answered {answer.status}")
        num_tokens = msgspec.json.decode(data, type=_Pulled).num_tokens
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        raise _transfer_failed(
            f"the prefill replica is unreachable ({type(exc).__name__})"
        ) from None
    except UNDECODABLE:
        raise _transfer_failed("the prefill replica's answer is not a pull result") from None
    ready = min(num_tokens, spec.prompt_tokens)
    moved = max(0, ready - local_tokens)
    transfer_s = kv_transfer_s(moved, replica.model.cost.kv_bytes_per_token, replica.link)
    await asyncio.sleep(transfer_s * replica.options.time_scale)
    pulled = dataclasses.replace(spec, kv_ready_tokens=ready)
    return PulledKv(pulled, moved, transfer_s)


class _Pulled(msgspec.Struct, frozen=True):
    num_tokens: int
    num_blocks: int


def add_pull_route(app: web.Application, replica: ServedReplica) -> None:
    """``POST /kv/pull``: hand a held prefill's KV to the decode replica asking (404
    ``kv_not_found`` when this replica does not hold it)."""

    async def pull(request: web.Request) -> web.Response:
        asked = decode_body(await read_body(request), _PullRequest)
        wrong_engine = asked.remote_engine_id not in (None, replica.engine_id)
        held = None if wrong_engine else replica.pull_kv(asked.remote_request_id)
        if held is None:
            raise ApiError(
                404,
                f"no KV held for request {asked.remote_request_id!r} on engine "
                f"{replica.engine_id} (pulled already, expired, or another engine's)",
                code="kv_not_found",
            )
        return json_response({"num_tokens": held.num_tokens, "num_blocks": len(held.block_ids)})

    app.router.add_post(PULL_PATH, pull, expect_handler=expect_continue)
