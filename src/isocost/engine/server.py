"""``isocost engine``: engine-model replicas served over OpenAI HTTP in real time.

One process serves N replicas, each on its own port with its own aiohttp application.
Each replica runs exactly one asyncio task, its *loop*, which maps wall time to modelled
time (``modelled = elapsed / time_scale``), advances the pure ``EngineModel`` to now,
feeds the metrics, wakes the request handlers whose request has enough new tokens, and
sleeps until the model's next step ends (at least ``_TICK_S``, so that very fast modelled
GPUs advance in batches of steps instead of spinning). Handlers never step the model;
they tokenize, submit, wait to be woken and write. Token *timing* therefore comes from the
model, not from how punctual the event loop is; the loop only decides when bytes leave.

Fault injection (``Faults``) per replica, from flags, spec fields or
``POST /admin/fault`` (the body replaces the whole fault set; ``{}`` clears it):
``slowdown`` stretches every step, ``error_rate`` answers that share of completion
requests with 500, ``hang`` holds every request except ``/admin/*`` until cleared,
``max_waiting`` answers 503 + Retry-After while the queue is that long, ``crash`` exits
the process (code 70) right after answering. ``GET /admin/fault`` shows the current set.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web

from isocost.core.catalog import Catalog
from isocost.core.costmodel import CostModel, EngineLimits
from isocost.core.errors import DoesNotFitError
from isocost.engine.config import EngineReplicaConfig, Faults
from isocost.engine.metrics import ReplicaMetrics
from isocost.engine.model import EngineModel
from isocost.engine.protocol import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    chunk_bytes,
    decode_body,
)
from isocost.engine.records import Finished, FirstToken, RequestSpec, RequestState
from isocost.engine.tokens import Tokenizer, filler_text, load_tokenizer, render_chat
from isocost.files import resolve_model
from isocost.prefix.hashing import token_block_hashes

__all__ = [
    "OUTPUT_DISTRIBUTIONS",
    "OutputLengths",
    "Replica",
    "ServeOptions",
    "build_models",
    "build_tokenizers",
    "run_engine",
]

_TICK_S = 0.001  # shortest sleep of a replica loop, in wall seconds
_CRASH_EXIT_CODE = 70
_COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
OUTPUT_DISTRIBUTIONS = ("exponential", "uniform", "max")


@dataclass(frozen=True, slots=True)
class ServeOptions:
    """Settings shared by every replica of one ``isocost engine`` process."""

    host: str = "127.0.0.1"
    time_scale: float = 1.0  # wall seconds per modelled second
    stream_interval: int = 1  # output tokens per SSE chunk
    output_dist: str = "exponential"
    output_mean_tokens: float = 128.0
    seed: int = 0
    tokenizer_path: str | None = None


class OutputLengths:
    """How many tokens a request generates when it does not ``ignore_eos``: drawn from a
    seeded distribution, capped by ``max_tokens``.

    * ``exponential``: ``1 + Exp(mean - 1)`` tokens, the heavy tail of chat answers;
    * ``uniform``: uniform on ``1..max_tokens``;
    * ``max``: always ``max_tokens``.
    """

    def __init__(self, dist: str, mean_tokens: float, rng: random.Random) -> None:
        if dist not in OUTPUT_DISTRIBUTIONS:
            raise ValueError(f"output distribution must be one of {OUTPUT_DISTRIBUTIONS}")
        if mean_tokens < 1:
            raise ValueError("mean output tokens must be >= 1")
        self.dist = dist
        self.mean_tokens = mean_tokens
        self._rng = rng

    def draw(self, max_tokens: int) -> int:
        if self.dist == "max":
            return max_tokens
        if self.dist == "uniform":
            return self._rng.randint(1, max_tokens)
        extra = self._rng.expovariate(1.0 / self.mean_tokens) if self.mean_tokens > 1 else 0.0
        return min(max_tokens, 1 + int(extra))


class _Waiter:
    """A handler's claim on one request: woken once ``wake_at`` tokens exist or it ends."""

    __slots__ = ("event", "finish_reason", "state", "wake_at")

    def __init__(self, state: RequestState, wake_at: int, finish_reason: str) -> None:
        self.state = state
        self.wake_at = wake_at
        self.finish_reason = finish_reason
        self.event = asyncio.Event()

    async def wait(self) -> None:
        await self.event.wait()
        self.event.clear()


class Replica:
    """One engine model, its metrics, faults and loop; see the module docstring."""

    def __init__(
        self,
        index: int,
        spec: EngineReplicaConfig,
        model: EngineModel,
        tokenizer: Tokenizer,
        options: ServeOptions,
    ) -> None:
        self.index = index
        self.spec = spec
        self.model = model
        self.tokenizer = tokenizer
        self.options = options
        self.metrics = ReplicaMetrics(model, spec.served_model_name)
        self.created = int(time.time())
        self.faults = Faults()
        self.unhung = asyncio.Event()
        self.set_faults(spec.faults)
        self._rng = random.Random(f"{options.seed}/{index}")
        self.output_lengths = OutputLengths(
            options.output_dist, options.output_mean_tokens, self._rng
        )
        self._waiters: dict[str, _Waiter] = {}
        self._wakeup: asyncio.Future[None] | None = None
        self._origin = asyncio.get_running_loop().time()
        self.closing = False

    @property
    def served_model_name(self) -> str:
        return self.spec.served_model_name

    def describe(self) -> str:
        cost = self.model.cost
        return (
            f"replica {self.index} {self.served_model_name} ({cost.model.id} on "
            f"{cost.tensor_parallel}x {cost.gpu.id}, {self.model.pool.num_blocks} KV blocks)"
        )

    def set_faults(self, faults: Faults) -> None:
        self.faults = faults
        self.model.slowdown = faults.slowdown
        if faults.hang:
            self.unhung.clear()
        else:
            self.unhung.set()

    def draw_error(self) -> bool:
        return self.faults.error_rate > 0 and self._rng.random() < self.faults.error_rate

    def model_now(self) -> float:
        return (asyncio.get_running_loop().time() - self._origin) / self.options.time_scale

    # -- the loop ----------------------------------------------------------------------

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._advance(self.model_now())
            self._wakeup = wakeup = loop.create_future()
            due = self.model.next_event_time()
            timer = None
            if due is not None:
                when = self._origin + due * self.options.time_scale
                timer = loop.call_at(max(when, loop.time() + _TICK_S), _resolve, wakeup)
            await wakeup
            if timer is not None:
                timer.cancel()

    def _advance(self, now: float) -> None:
        """Advance the model to ``now``: metrics from its events, wake-ups for handlers."""
        model, metrics, scale = self.model, self.metrics, self.options.time_scale
        steps_before = model.counters.num_steps
        for event in model.advance_to(now):
            if isinstance(event, FirstToken):
                metrics.ttft.observe(event.ttft_s * scale)
            elif isinstance(event, Finished):
                metrics.e2e.observe(event.e2e_s * scale)
                waiter = self._waiters.get(event.request_id)
                if waiter is not None:
                    metrics.finished[waiter.finish_reason] += 1
        gaps = model.counters.inter_token_gaps
        for gap_s, times in gaps:
            metrics.inter_token.observe(gap_s * scale, times)
        gaps.clear()
        if model.counters.num_steps != steps_before:
            for waiter in self._waiters.values():
                state = waiter.state
                if state.num_output_tokens >= waiter.wake_at or state.finished_s is not None:
                    waiter.event.set()

    # -- requests ----------------------------------------------------------------------

    def submit(self, spec: RequestSpec, wake_every: int, finish_reason: str) -> _Waiter:
        now = self.model_now()
        self._advance(now)  # collect events due before now, as the model's contract asks
        state = self.model.submit(spec, now)
        waiter = _Waiter(state, wake_every, finish_reason)
        self._waiters[spec.request_id] = waiter
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)
        return waiter

    def close(self) -> None:
        """Shutdown: wake every held request and handler so each ends at once."""
        self.closing = True
        self.unhung.set()
        for waiter in self._waiters.values():
            waiter.event.set()

    def release(self, waiter: _Waiter) -> None:
        """Forget a handler's request; an unfinished one (client gone) is aborted."""
        request_id = waiter.state.spec.request_id
        self._waiters.pop(request_id, None)
        if waiter.state.finished_s is None:
            self.model.abort(request_id)
            self.metrics.finished["abort"] += 1


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


# -- HTTP ------------------------------------------------------------------------------

REPLICA = web.AppKey("replica", Replica)


def _shutting_down() -> ApiError:
    return ApiError(503, "the replica is shutting down", type_="server_error", code="shutting_down")


_JSON = msgspec.json.Encoder()


def _json_response(
    body: Any, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        body=_JSON.encode(body), status=status, headers=headers, content_type="application/json"
    )


def _error_response(error: ApiError) -> web.Response:
    headers = {"Retry-After": "1"} if error.status == 503 else None
    return _json_response(error.body(), error.status, headers)


@web.middleware
async def _faults_and_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    replica = request.app[REPLICA]
    try:
        if not request.path.startswith("/admin/"):
            await replica.unhung.wait()
            if replica.closing:
                raise _shutting_down()
        return await handler(request)
    except ApiError as error:
        return _error_response(error)


@dataclass(frozen=True, slots=True)
class _Generation:
    """A validated completion request, ready to submit."""

    spec: RequestSpec
    max_tokens: int
    stream: bool
    include_usage: bool


def _prompt_ids(replica: Replica, prompt: str | list[str | int]) -> list[int]:
    if isinstance(prompt, str):
        return replica.tokenizer.encode(prompt)
    if len(prompt) == 1 and isinstance(prompt[0], str):
        return replica.tokenizer.encode(prompt[0])
    if all(isinstance(p, int) for p in prompt):
        return [p for p in prompt if isinstance(p, int)]
    raise ApiError(400, "prompt must be one string or one list of token ids", param="prompt")


def _chat_text(body: ChatRequest) -> str:
    if not body.messages:
        raise ApiError(400, "messages must not be empty", param="messages")
    rendered: list[tuple[str, str]] = []
    for message in body.messages:
        content = message.content
        if isinstance(content, list):
            content = "".join(part.text or "" for part in content if part.type == "text")
        rendered.append((message.role, content or ""))
    return render_chat(rendered)


def _validate(
    replica: Replica, body: ChatRequest | CompletionRequest, prompt_ids: list[int]
) -> _Generation:
    if body.model != replica.served_model_name:
        raise ApiError(
            404,
            f"The model `{body.model}` does not exist.",
            param="model",
            code="model_not_found",
        )
    if body.n != 1:
        raise ApiError(400, "only n=1 is supported", param="n")
    requested = body.max_tokens
    param = "max_tokens"
    if isinstance(body, ChatRequest) and body.max_completion_tokens is not None:
        requested, param = body.max_completion_tokens, "max_completion_tokens"
    if requested is not None and requested < 1:
        raise ApiError(400, f"{param} must be at least 1, got {requested}", param=param)
    num_prompt = len(prompt_ids)
    if num_prompt < 1:
        raise ApiError(400, "the prompt must not be empty", param="prompt")
    limit = replica.model.max_request_tokens
    if requested is not None and requested > limit:
        raise ApiError(
            400,
            f"{param}={requested} cannot be greater than max_model_len={limit}. "
            "Please request fewer output tokens.",
            param=param,
        )
    if num_prompt >= limit:
        raise ApiError(
            400,
            f"This model's maximum context length is {limit} tokens. However, your prompt "
            f"contains {num_prompt} input tokens, which leaves no room for output tokens. "
            "Please reduce the length of the input prompt.",
            param="messages" if isinstance(body, ChatRequest) else "prompt",
            code="context_length_exceeded",
        )
    if requested is None and isinstance(body, CompletionRequest):
        requested = _COMPLETIONS_DEFAULT_MAX_TOKENS
    # Like vLLM: what does not fit after the prompt is cut, and the answer ends "length".
    requested = min(requested or limit, limit - num_prompt)
    output = requested if body.ignore_eos else replica.output_lengths.draw(requested)
    block_hashes = token_block_hashes(prompt_ids, replica.model.block_size)
    spec = RequestSpec(uuid.uuid4().hex, num_prompt, output, tuple(block_hashes))
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    return _Generation(spec, requested, body.stream, include_usage)


async def _completions(request: web.Request) -> web.StreamResponse:
    replica = request.app[REPLICA]
    body = decode_body(await request.read(), CompletionRequest)
    return await _generate(request, replica, body, _prompt_ids(replica, body.prompt), chat=False)


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    replica = request.app[REPLICA]
    body = decode_body(await request.read(), ChatRequest)
    prompt_ids = replica.tokenizer.encode(_chat_text(body))
    return await _generate(request, replica, body, prompt_ids, chat=True)


async def _generate(
    request: web.Request,
    replica: Replica,
    body: ChatRequest | CompletionRequest,
    prompt_ids: list[int],
    *,
    chat: bool,
) -> web.StreamResponse:
    generation = _validate(replica, body, prompt_ids)
    cap = replica.faults.max_waiting
    if cap is not None and replica.model.num_waiting >= cap:
        raise ApiError(503, "the replica's queue is full", type_="server_error", code="overloaded")
    if replica.draw_error():
        raise ApiError(500, "injected engine failure", type_="server_error", code="internal")
    spec = generation.spec
    finish_reason = "length" if spec.max_output_tokens == generation.max_tokens else "stop"
    wake_every = replica.options.stream_interval if generation.stream else spec.max_output_tokens
    waiter = replica.submit(spec, wake_every, finish_reason)
    reply = _Reply(chat, replica.served_model_name, spec, finish_reason)
    try:
        if generation.stream:
            return await _stream(request, replica, waiter, reply, generation.include_usage)
        while waiter.state.finished_s is None:
            await waiter.wait()
            if replica.closing:
                raise _shutting_down()
        return _json_response(reply.whole())
    finally:
        replica.release(waiter)


class _Reply:
    """OpenAI response objects for one request (completion or chat, whole or chunks)."""

    def __init__(self, chat: bool, model_name: str, spec: RequestSpec, finish_reason: str):
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + spec.request_id
        self.created = int(time.time())
        self.model_name = model_name
        self.spec = spec
        self.finish_reason = finish_reason

    def usage(self) -> dict[str, int]:
        prompt, output = self.spec.prompt_tokens, self.spec.max_output_tokens
        return {
            "prompt_tokens": prompt,
            "completion_tokens": output,
            "total_tokens": prompt + output,
        }

    def _envelope(self, stream: bool) -> dict[str, Any]:
        if self.chat:
            kind = "chat.completion.chunk" if stream else "chat.completion"
        else:
            kind = "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model_name}

    def whole(self) -> dict[str, Any]:
        text = filler_text(0, self.spec.max_output_tokens)
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice |= {"logprobs": None, "finish_reason": self.finish_reason}
        return self._envelope(False) | {"choices": [choice], "usage": self.usage()}

    def chunk(
        self, text: str | None, finish_reason: str | None, include_usage: bool, role: bool = False
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            delta: dict[str, str] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        choice |= {"logprobs": None, "finish_reason": finish_reason}
        chunk = self._envelope(True) | {"choices": [choice]}
        if include_usage:
            chunk["usage"] = None
        return chunk

    def usage_chunk(self) -> dict[str, Any]:
        return self._envelope(True) | {"choices": [], "usage": self.usage()}


async def _stream(
    request: web.Request, replica: Replica, waiter: _Waiter, reply: _Reply, include_usage: bool
) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    with contextlib.suppress(ConnectionResetError):  # the client left: _generate aborts
        await _write_stream(response, replica, waiter, reply, include_usage)
    return response


async def _write_stream(
    response: web.StreamResponse,
    replica: Replica,
    waiter: _Waiter,
    reply: _Reply,
    include_usage: bool,
) -> None:
    if reply.chat:
        await response.write(chunk_bytes(reply.chunk("", None, include_usage, role=True)))
    state, sent = waiter.state, 0
    interval = replica.options.stream_interval
    while True:
        await waiter.wait()
        if replica.closing:
            return  # shutdown: the stream ends without [DONE], the request is aborted
        produced = state.num_output_tokens
        if produced > sent:
            text = filler_text(sent, produced - sent)
            await response.write(chunk_bytes(reply.chunk(text, None, include_usage)))
            sent = produced
        if state.finished_s is not None:
            break
        waiter.wake_at = sent + interval
    await response.write(chunk_bytes(reply.chunk(None, reply.finish_reason, include_usage)))
    if include_usage:
        await response.write(chunk_bytes(reply.usage_chunk()))
    await response.write(chunk_bytes("[DONE]"))
    await response.write_eof()


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
    return _json_response({"object": "list", "data": [entry]})


async def _health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def _metrics(request: web.Request) -> web.Response:
    replica = request.app[REPLICA]
    return web.Response(
        body=replica.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"}
    )


async def _get_fault(request: web.Request) -> web.Response:
    return _json_response(request.app[REPLICA].faults)


async def _post_fault(request: web.Request) -> web.StreamResponse:
    replica = request.app[REPLICA]
    faults = decode_body(await request.read() or b"{}", Faults)
    problem = faults.problem()
    if problem:
        raise ApiError(400, f"{problem[0]} {problem[1]}", param=problem[0])
    replica.set_faults(faults)
    response = _json_response(faults)
    if faults.crash:
        await response.prepare(request)
        await response.write_eof()
        os._exit(_CRASH_EXIT_CODE)
    return response


def _application(replica: Replica) -> web.Application:
    app = web.Application(middlewares=[_faults_and_errors])
    app[REPLICA] = replica
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/admin/fault", _get_fault)
    app.router.add_post("/admin/fault", _post_fault)
    return app


# -- process ---------------------------------------------------------------------------


def build_models(
    specs: list[EngineReplicaConfig], catalog: Catalog, limits: EngineLimits
) -> list[EngineModel]:
    """An engine model per spec; a model that does not fit its GPUs is an error."""
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
            EngineModel(cost, num_blocks=spec.num_gpu_blocks, record_inter_token_gaps=True)
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
    on_ready: Callable[[list[tuple[Replica, str]]], None],
) -> None:
    """Serve every replica until SIGINT or SIGTERM, then shut down within a second."""
    replicas = [
        Replica(index, spec, model, tokenizer, options)
        for index, (spec, model, tokenizer) in enumerate(
            zip(specs, models, tokenizers, strict=True)
        )
    ]
    runners: list[web.AppRunner] = []
    tasks = [asyncio.create_task(r.run(), name=f"replica-{r.index}") for r in replicas]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        urls = []
        for replica, port in zip(replicas, ports, strict=True):
            runner = web.AppRunner(_application(replica), shutdown_timeout=1.0, access_log=None)
            await runner.setup()
            runners.append(runner)
            site = web.TCPSite(runner, options.host, port)
            await site.start()
            bound = runner.addresses[0][1]
            urls.append((replica, f"http://{options.host}:{bound}"))
        on_ready(urls)
        await stop.wait()
    finally:
        for replica in replicas:
            replica.close()
        for runner in runners:
            await runner.cleanup()
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
    on_ready: Callable[[list[tuple[Replica, str]]], None],
) -> None:
    """Build the replicas' models and tokenizers (errors surface before any port opens)
    and serve."""
    models = build_models(specs, catalog, limits)
    tokenizers = build_tokenizers(models, options.tokenizer_path)
    try:
        import uvloop

        loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
    except ImportError:  # uvloop is not available on Windows
        loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(serve(specs, models, tokenizers, options, ports, on_ready))
