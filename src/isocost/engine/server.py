"""``isocost engine``: engine-model replicas served over OpenAI HTTP in real time.

One process serves N replicas (``ServedReplica``, each with its own loop), each on its own
port with its own aiohttp application. A completion handler decodes the body (the OpenAI
structs of ``isocost.openai``), validates it (``validation``), passes the replica's faults
(``faults``), submits it, waits to be woken by the replica's loop and writes the answer
(``replies``); every error leaves as OpenAI error JSON from the one middleware, aiohttp's
own (unknown path, wrong method, body over the size limit) included. A client that leaves
cancels its handler (``handler_cancellation``), which aborts its request, streamed or not:
its KV blocks are freed and it counts as ``finished_reason="abort"``. A request carrying
``kv_transfer_params`` is one half of vLLM's prefill/decode protocol (``disagg``): a
prefill that hands its KV off, or a decode that pulls it first. Below the routes
(``intake``): deadlines for a request's head and body, and JSON for what aiohttp's parser
refuses.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import zmq
from aiohttp import web

from isocost.core.catalog import Catalog
from isocost.core.costmodel import CostModel, EngineLimits
from isocost.core.errors import ConfigError, DoesNotFitError
from isocost.engine.config import EngineReplicaConfig
from isocost.engine.disagg import add_pull_route, kv_source, pull_kv
from isocost.engine.faults import add_fault_routes, answer_and_exit
from isocost.engine.handoff import handoff_params
from isocost.engine.intake import READ_TIMEOUT, expect_continue, listen, read_body
from isocost.engine.kvevents import KvEventPublisher
from isocost.engine.model import EngineModel
from isocost.engine.records import RequestSpec
from isocost.engine.replica import ServedReplica, ServeOptions
from isocost.engine.replies import Reply, stream_reply
from isocost.engine.tokens import Tokenizer, filler_start, load_tokenizer
from isocost.engine.validation import chat_text, prompt_ids, prompt_text, validate
from isocost.files import resolve_model
from isocost.openai.errors import ApiError, error_response
from isocost.openai.http import close_unread
from isocost.openai.requests import (
    KV_TRANSFER_MS_HEADER,
    ChatRequest,
    CompletionRequest,
    decode_body,
)
from isocost.openai.responses import json_response
from isocost.serving import run_serving, stop_requested

__all__ = ["build_models", "build_tokenizers", "run_engine"]


# -- HTTP ------------------------------------------------------------------------------

REPLICA = web.AppKey("replica", ServedReplica)
PULLS = web.AppKey("pulls", aiohttp.ClientSession)  # a decode replica's KV pulls


def _shutting_down() -> ApiError:
    return ApiError(503, "the replica is shutting down", type_="server_error", code="shutting_down")


_COUNTED = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models"})


@web.middleware
async def _faults_and_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Hold requests while the replica hangs (``/admin/*`` never), refuse them while it
    shuts down, answer every ApiError, and aiohttp's own refusals, as OpenAI error JSON,
    and count the OpenAI routes' answers by status class (vLLM's ``http_requests_total``)."""
    replica = request.app[REPLICA]
    response: web.StreamResponse
    try:
        if not request.path.startswith("/admin/"):
            await replica.faults.unhung.wait()
            if replica.closing:
                raise _shutting_down()
        response = await handler(request)
    except ApiError as error:
        response = error_response(error)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        response = error_response(ApiError.from_http(exc))
    if request.path in _COUNTED:
        replica.metrics.count_http(request.path, request.method, response.status)
    return await close_unread(request, response)  # a 408's rest is not waited for


async def _completions(request: web.Request) -> web.StreamResponse:
    replica = request.app[REPLICA]
    body = decode_body(await read_body(request), CompletionRequest)
    ids = prompt_ids(replica, body.prompt)
    text = prompt_text(body.prompt)
    start = 0 if text is None else filler_start(text)
    return await _generate(request, replica, body, ids, start, chat=False)


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    replica = request.app[REPLICA]
    body = decode_body(await read_body(request), ChatRequest)
    text = chat_text(body)
    ids = replica.tokenizer.encode(text)
    return await _generate(request, replica, body, ids, filler_start(text), chat=True)


async def _generate(
    request: web.Request,
    replica: ServedReplica,
    body: ChatRequest | CompletionRequest,
    ids: list[int],
    filler_from: int,
    *,
    chat: bool,
) -> web.StreamResponse:
    generation = validate(replica, body, ids)
    params = body.kv_transfer_params
    source = kv_source(replica, params)
    replica.faults.check_admission()
    spec = generation.spec
    headers: dict[str, str] = {}
    if source is not None:
        pulled = await pull_kv(request.app[PULLS], replica, source, spec)
        spec = pulled.spec
        headers[KV_TRANSFER_MS_HEADER] = f"{pulled.transfer_s * 1000:.3f}"
    finish_reason = "length" if spec.max_output_tokens == generation.max_tokens else "stop"
    wake_every = replica.options.stream_interval if generation.stream else spec.max_output_tokens
    waiter = replica.submit(spec, wake_every, finish_reason)
    state = waiter.state
    cached = (lambda: state.num_prefix_hit_tokens) if replica.options.prompt_details else None
    reply = Reply(chat, replica.served_model_name, spec, finish_reason, filler_from, cached)
    try:
        if generation.stream:
            return await stream_reply(request, replica, waiter, reply, generation, headers)
        while waiter.state.finished_s is None:
            await waiter.wait()
            if replica.closing:
                raise _shutting_down()
        answer = reply.whole()
        hands_off = params is not None and params.do_remote_decode
        if hands_off:
            answer["kv_transfer_params"] = _hand_off(replica, spec)
        response = json_response(answer)
        response.headers.update(headers)
        if hands_off and replica.faults.faults.crash_after_handoff:
            await answer_and_exit(request, response)
        return response
    finally:
        replica.release(waiter)


def _hand_off(replica: ServedReplica, spec: RequestSpec) -> dict[str, Any] | None:
    """Hold a finished prefill's KV for a decode replica: the answer's
    ``kv_transfer_params``, or None (as vLLM answers) when there is no room to hold it."""
    held = replica.hold_kv(spec.request_id, spec.prompt_tokens)
    if held is None:
        return None
    return handoff_params(
        held,
        replica.engine_id,
        replica.options.host,
        replica.port,
        replica.model.cost.tensor_parallel,
    )


async def _models(request: web.Request) -> web.Response:
    replica = request.app[REPLICA]
    entry = {
        "id": replica.served_model_name,
        "object": "model",
        "created": replica.created,
        "owned_by": "isocost",
        "root": replica.spec.model,
        "max_model_len": replica.model.max_request_tokens,
    }
    return json_response({"object": "list", "data": [entry]})


async def _health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def _metrics(request: web.Request) -> web.Response:
    replica = request.app[REPLICA]
    return web.Response(
        body=replica.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"}
    )


def _application(replica: ServedReplica, pulls: aiohttp.ClientSession) -> web.Application:
    app = web.Application(middlewares=[_faults_and_errors])
    app[REPLICA] = replica
    app[READ_TIMEOUT] = replica.options.read_timeout_s
    routes = app.router
    routes.add_post("/v1/completions", _completions, expect_handler=expect_continue)
    routes.add_post("/v1/chat/completions", _chat_completions, expect_handler=expect_continue)
    routes.add_get("/v1/models", _models, expect_handler=expect_continue)
    routes.add_get("/health", _health, expect_handler=expect_continue)
    routes.add_get("/metrics", _metrics, expect_handler=expect_continue)
    app[PULLS] = pulls
    add_fault_routes(app, replica.faults, replica.set_faults)
    add_pull_route(app, replica)
    return app


# -- process ---------------------------------------------------------------------------


def build_models(
    specs: list[EngineReplicaConfig],
    catalog: Catalog,
    limits: EngineLimits,
    *,
    cache_events: bool = False,
) -> list[EngineModel]:
    """An engine model per spec (``cache_events``: reporting its prefix cache's changes);
    a model that does not fit its GPUs is an error."""
    models = []
    for spec in specs:
        cost = CostModel(
            resolve_model(spec.model, catalog), catalog.gpu(spec.gpu), spec.tp, limits=limits
        )
        if spec.num_gpu_blocks is None and cost.kv_capacity_blocks < 1:
            raise DoesNotFitError(
                f"{spec.model} on {spec.tp}x {spec.gpu} leaves no memory for the KV cache"
            )
        models.append(
            EngineModel(
                cost,
                num_blocks=spec.num_gpu_blocks,
                record_inter_token_gaps=True,
                cache_events=cache_events,
            )
        )
    return models


def build_tokenizers(models: list[EngineModel], path: str | None) -> list[Tokenizer]:
    """A tokenizer per model, shared between models of the same vocabulary size."""
    by_vocab: dict[int, Tokenizer] = {}
    for model in models:
        vocab = model.cost.model.vocab_size
        if vocab not in by_vocab:
            by_vocab[vocab] = load_tokenizer(path, vocab)
    return [by_vocab[model.cost.model.vocab_size] for model in models]


async def serve(
    specs: list[EngineReplicaConfig],
    models: list[EngineModel],
    tokenizers: list[Tokenizer],
    options: ServeOptions,
    ports: list[int],
    on_ready: Callable[[list[tuple[ServedReplica, str]]], None],
    publishers: list[KvEventPublisher | None],
) -> None:
    """Serve every replica until SIGINT or SIGTERM, then shut down within a second."""
    replicas = [
        ServedReplica(index, spec, model, tokenizer, options, publisher)
        for index, (spec, model, tokenizer, publisher) in enumerate(
            zip(specs, models, tokenizers, publishers, strict=True)
        )
    ]
    runners: list[web.AppRunner] = []
    listeners: list[asyncio.Server] = []
    tasks = [asyncio.create_task(r.run(), name=f"replica-{r.index}") for r in replicas]
    stop = stop_requested()
    pulls = aiohttp.ClientSession()
    try:
        urls = []
        for replica, port in zip(replicas, ports, strict=True):
            runner = web.AppRunner(
                _application(replica, pulls),
                shutdown_timeout=1.0,
                handler_cancellation=True,  # a client gone aborts its request at once
            )
            await runner.setup()
            runners.append(runner)
            listener = await listen(runner, options.host, port, options.read_timeout_s)
            listeners.append(listener)
            bound = replica.port = listener.sockets[0].getsockname()[1]
            urls.append((replica, f"http://{options.host}:{bound}"))
        on_ready(urls)
        await stop.wait()
    finally:
        for listener in listeners:
            listener.close()
        for replica in replicas:
            replica.close()
        for publisher in publishers:
            if publisher is not None:
                publisher.close()
        for runner in runners:
            await runner.cleanup()
        await pulls.close()
        for task in tasks:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks)


def run_engine(
    specs: list[EngineReplicaConfig],
    catalog: Catalog,
    limits: EngineLimits,
    options: ServeOptions,
    ports: list[int],
    on_ready: Callable[[list[tuple[ServedReplica, str]]], None],
) -> None:
    """Build the replicas' models and tokenizers (errors surface before any port opens)
    and serve."""
    events_port = options.kv_events_port
    models = build_models(specs, catalog, limits, cache_events=events_port is not None)
    tokenizers = build_tokenizers(models, options.tokenizer_path)
    publishers = bind_kv_events(models, options)
    run_serving(serve(specs, models, tokenizers, options, ports, on_ready, publishers))


def bind_kv_events(
    models: list[EngineModel], options: ServeOptions
) -> list[KvEventPublisher | None]:
    """A KV-event publisher per replica on ``--kv-events-port`` + its index (none without
    it); a port that cannot be bound is a ``ConfigError`` before any HTTP port opens."""
    base = options.kv_events_port
    if base is None:
        return [None] * len(models)
    publishers: list[KvEventPublisher | None] = []
    for index, model in enumerate(models):
        endpoint = f"tcp://{options.host}:{base + index}"
        try:
            publishers.append(KvEventPublisher(endpoint, model.block_size))
        except zmq.ZMQError as exc:
            for bound in publishers:
                if bound is not None:
                    bound.close()
            raise ConfigError("--kv-events-port", f"{endpoint}: {exc}") from None
    return publishers
