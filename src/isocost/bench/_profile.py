"""``isocost profile``: one idle replica's prefill and decode times, measured over HTTP.

What ``core.profile`` fits a catalog GPU entry to. Every prompt is random token ids (the
OpenAI completions API takes them; no tokenizer needed, and no two prompts share a cached
block), answered with ``ignore_eos`` so that each asks for exactly the work it names:

* prefill: for each prompt length, ``repeats`` prompts streamed one at a time for one
  output token, timed from send to that token's event (what the gateway's first-token
  clock sees: HTTP, the engine's scheduler and the prefill); the fastest per length is
  the sample (other work on the machine only ever adds time, so the fastest of a few is
  the one it touched least: on a busy 2-core machine the median of three missed a
  16-token prompt by up to 20%), the repeats taken in rounds over every length (so that
  a spell of other work slows one prompt of several lengths, not every prompt of one);
* cached prefill (a check the fit does not see): each of those prompts again with
  ``cached_suffix_tokens`` more, where the engine says how many were found cached
  (vLLM's ``--enable-prompt-tokens-details``);
* decode: for each batch, ``repeats`` pairs of rounds of ``batch`` streams at once, one
  of ``_SHORT_DECODE`` tokens each and one of ``decode_tokens``; a step is how much
  longer the fastest long round took than the fastest short one, over the steps between
  (``_Probe.decode``);
* its ``/metrics`` text, where vLLM's ``cache_config_info`` says the KV tokens it holds.

The replica must be idle: anything else it serves is measured as its own cost.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import aiohttp
import msgspec
from aiohttp.http_exceptions import LineTooLong

from isocost.bench._client import error_snippet
from isocost.bench._runner import EndpointError, normalize_url, served_model
from isocost.core.jsontext import UNDECODABLE
from isocost.core.profile import DecodeSample, PrefillSample
from isocost.openai import sse
from isocost.openai.http import read_capped

__all__ = ["Measurements", "ProfilePlan", "measure_replica"]

_FIRST_ID = 3  # token ids below are often BOS/EOS/PAD: kept out of the prompts
_WARMUP = 2  # requests first sent and not counted (allocation, compilation)
_SHORT_DECODE = 16  # tokens per stream of the shorter decode round


@dataclass(frozen=True, slots=True)
class ProfilePlan:
    """What to send; ``max_prompt_tokens`` is capped by the engine's ``max_model_len``."""

    max_prompt_tokens: int = 2048
    repeats: int = 3
    decode_batches: tuple[int, ...] = (1, 4, 16)
    decode_tokens: int = 64
    decode_prompt_tokens: int = 128
    cached_suffix_tokens: int = 16
    timeout_s: float = 120.0
    seed: int | None = None  # None: a new one each run (a second run's prompts were cached)

    def lengths(self, longest: int) -> list[int]:
        """Prompt lengths from 16 tokens to ``longest``, spread over its octaves."""
        return sorted({n for n in (16, 64, longest // 8, longest // 4, longest // 2, longest)
                       if n >= 8})  # fmt: skip


@dataclass(frozen=True, slots=True)
class Measurements:
    model: str
    prompt_tokens_cap: int  # the longest prompt sent
    prefill: tuple[PrefillSample, ...]
    decode: tuple[DecodeSample, ...]
    metrics_text: str | None  # its /metrics as the run ended (vLLM's names the KV it holds)
    notes: tuple[str, ...]


Progress = Callable[[str], None]  # called once per request or round sent, with its phase


@dataclass(frozen=True, slots=True)
class _Answer:
    """When a probe's answer came and what the engine said of it."""

    events_s: tuple[float, ...]  # seconds from send to each event carrying a token
    completion_tokens: int
    cached_tokens: int | None  # prompt tokens found cached, where the engine says


class _Details(msgspec.Struct):
    cached_tokens: Annotated[int, msgspec.Meta(ge=0)] | None = None


class _Usage(msgspec.Struct):
    completion_tokens: Annotated[int, msgspec.Meta(ge=0)] | None = None
    prompt_tokens_details: _Details | None = None


class _Choice(msgspec.Struct):
    text: str | None = None


class _Event(msgspec.Struct):
    """One stream event, as far as a probe reads it: a shape it does not expect is a
    ``msgspec.ValidationError`` naming the field, not a crash further on."""

    choices: list[_Choice] = []
    usage: _Usage | None = None
    error: Any = None


_events = msgspec.json.Decoder(_Event)


class _Probe:
    """One session against one replica, every request checked. Answers are timed by
    their events, not their text: a random-weight model's token may decode to nothing."""

    def __init__(
        self, session: aiohttp.ClientSession, base: str, model: str, headers: dict[str, str],
        plan: ProfilePlan, vocab_size: int, progress: Progress,
    ) -> None:  # fmt: skip
        self.session, self.base, self.model, self.headers = session, base, model, headers
        self.plan, self.progress = plan, progress
        self.rng = random.Random(plan.seed)
        self.vocab_size = vocab_size

    def prompt(self, tokens: int) -> list[int]:
        return [self.rng.randrange(_FIRST_ID, self.vocab_size) for _ in range(tokens)]

    async def send(self, prompt: list[int], max_tokens: int) -> _Answer:
        """Stream a completion of ``prompt``; each token's time and the usage."""
        payload: dict[str, Any] = {
            "model": self.model, "prompt": prompt, "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True},
        }  # fmt: skip
        what = f"a probe of {len(prompt)} prompt tokens"
        try:
            async with asyncio.timeout(self.plan.timeout_s):
                return await self._exchange(payload)
        except TimeoutError:
            raise EndpointError(f"{what}: no answer in {self.plan.timeout_s:g} s") from None
        except aiohttp.ClientError as exc:
            raise EndpointError(f"{what} failed: {str(exc) or type(exc).__name__}") from None
        except (*UNDECODABLE, ValueError) as exc:  # nested too deep included
            raise EndpointError(f"{what}: not an OpenAI completion answer ({exc})") from None
        except LineTooLong:  # aiohttp >= 3.13 (ValueError before)
            raise EndpointError(f"{what}: a line longer than the reader's limit") from None

    async def _exchange(self, payload: dict[str, Any]) -> _Answer:
        url = f"{self.base}/v1/completions"
        sent = time.perf_counter()
        async with self.session.post(
            url, data=msgspec.json.encode(payload), headers=self.headers, allow_redirects=False
        ) as response:
            if response.status != 200:
                raise EndpointError(f"{url} answered {response.status}: "
                                    f"{await error_snippet(response)}")  # fmt: skip
            events: list[float] = []
            usage = _Usage()
            async for raw in response.content:
                data = sse.line_data(raw)
                if data is None:
                    continue
                if data == sse.DONE:
                    break
                event = _events.decode(data)
                if event.error is not None:
                    raise ValueError(f"an error event: {str(event.error)[:200]}")
                if event.choices and event.choices[0].text is not None:  # a token, maybe ""
                    events.append(time.perf_counter() - sent)
                usage = event.usage or usage
            else:
                raise ValueError("the stream ended without data: [DONE]")
        if not events:
            raise ValueError("no output token")
        tokens = usage.completion_tokens  # a stream without usage: one per event
        tokens = tokens if tokens else len(events)
        details = usage.prompt_tokens_details
        return _Answer(tuple(events), tokens, None if details is None else details.cached_tokens)

    async def prefill(self, lengths: Sequence[int]) -> tuple[list[PrefillSample], list[str]]:
        samples: list[PrefillSample] = []
        notes: list[str] = []
        uncached_by: dict[int, list[float]] = {n: [] for n in lengths}
        cached_by: dict[int, list[tuple[int, float]]] = {n: [] for n in lengths}
        for _ in range(self.plan.repeats):  # in rounds over every length (module docstring)
            for n in lengths:
                prompt = self.prompt(n)
                uncached_by[n].append((await self.send(prompt, 1)).events_s[0])
                self.progress("prefill")
                longer = prompt + self.prompt(self.plan.cached_suffix_tokens)
                answer = await self.send(longer, 1)
                self.progress("prefill")
                hit = answer.cached_tokens
                if hit and hit < len(longer):  # more than it was sent is not a cache hit
                    cached_by[n].append((hit, answer.events_s[0]))
        for n in lengths:
            uncached, cached = uncached_by[n], cached_by[n]
            samples.append(PrefillSample(n, 0, min(uncached)))
            if cached:
                hit = min(c for c, _ in cached)
                new = n + self.plan.cached_suffix_tokens - hit
                samples.append(PrefillSample(new, hit, min(s for _, s in cached)))
        if not any(s.cached_tokens for s in samples):
            notes.append(
                "the engine did not report cached prompt tokens (vLLM: "
                "--enable-prompt-tokens-details): no cached-prefix check"
            )
        return samples, notes

    async def decode(self) -> list[DecodeSample]:
        """A step: how much longer a round of ``batch`` streams takes to its last token
        with ``decode_tokens`` each than with ``_SHORT_DECODE``, over the steps between,
        the fastest round of each length taken (a slowed short round alone would shorten
        the step). Differences of whole rounds, not gaps between events: an engine starved
        of CPU sends tokens in bursts, and the prefills and connections cancel out. Each batch
        size first runs one round unmeasured: an engine may compile or allocate for a
        batch shape the first time it meets it, which would lengthen the short round and
        shorten the step (one profile of a CPU vLLM found 0.28 ms per step at 16 streams
        against 1.47 at one)."""
        plan = self.plan
        samples = []
        for batch in plan.decode_batches:
            await self._round(batch, _SHORT_DECODE)
            shorts: list[float] = []
            fulls: list[float] = []
            for _ in range(plan.repeats):
                shorts.append(await self._round(batch, _SHORT_DECODE))
                fulls.append(await self._round(batch, plan.decode_tokens))
                self.progress("decode")
            step = (min(fulls) - min(shorts)) / (plan.decode_tokens - _SHORT_DECODE)
            mean_context = plan.decode_prompt_tokens + (plan.decode_tokens + _SHORT_DECODE) // 2
            samples.append(DecodeSample(batch, batch * mean_context, step))
        return samples

    async def _round(self, batch: int, tokens: int) -> float:
        """Seconds from sending ``batch`` streams of ``tokens`` at once to their last event."""
        answers = await asyncio.gather(
            *(self.send(self.prompt(self.plan.decode_prompt_tokens), tokens) for _ in range(batch))
        )
        short = min(a.completion_tokens for a in answers)
        if short != tokens:
            raise EndpointError(
                f"a decode probe asked for {tokens} tokens with ignore_eos got {short}: "
                "the engine does not generate what it is asked to"
            )
        return max(a.events_s[-1] for a in answers)  # each timed from its send: all at once


_METRICS_BYTES = 8 * 1024 * 1024  # an engine's /metrics is a few hundred KiB at most


async def _scrape(
    session: aiohttp.ClientSession, url: str, headers: dict[str, str], timeout_s: float
) -> tuple[str | None, str | None]:
    """``/metrics`` as text, or a note why not: it comes after every probe and only adds
    the KV capacity, so a missing or broken one must not cost the measurements."""
    try:
        async with (
            asyncio.timeout(timeout_s),
            session.get(url, headers=headers, allow_redirects=False) as response,
        ):
            if response.status != 200:
                return None, f"{url} answered {response.status}: no KV capacity"
            body = await read_capped(response, _METRICS_BYTES)
    except (aiohttp.ClientError, TimeoutError) as exc:
        return None, f"{url} failed ({str(exc) or type(exc).__name__}): no KV capacity"
    if body is None:
        return None, f"{url} answered over {_METRICS_BYTES} bytes: no KV capacity"
    return body.decode(errors="replace"), None


def _probe_count(plan: ProfilePlan, lengths: int) -> int:
    """How many times ``measure_replica`` calls its progress callback."""
    return _WARMUP + 2 * plan.repeats * lengths + plan.repeats * len(plan.decode_batches)


async def measure_replica(
    url: str,
    vocab_size: int,
    plan: ProfilePlan,
    *,
    model: str | None = None,
    api_key: str | None = None,
    progress: Progress | None = None,
    on_plan: Callable[[int], None] | None = None,
) -> Measurements:
    """Measure the replica at ``url`` (module docstring); ``vocab_size``: the served
    model's, which the random prompts stay within; ``on_plan`` is told how many progress
    calls to expect once the prompt lengths are known. EndpointError when it cannot be
    reached or a probe fails."""
    base = normalize_url(url)
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    connector = aiohttp.TCPConnector(limit=max(plan.decode_batches) + 1)
    async with aiohttp.ClientSession(connector=connector) as session:
        served, limit = await served_model(session, base, model, plan.timeout_s, api_key)
        posts = headers | {"content-type": "application/json"}
        headroom = plan.cached_suffix_tokens + 2  # the cached check's longer prompt fits
        longest = plan.max_prompt_tokens if limit is None else min(
            plan.max_prompt_tokens, limit - headroom
        )  # fmt: skip
        lengths = plan.lengths(longest)
        if len(lengths) < 2:
            raise EndpointError(
                f"{served} takes prompts of at most {limit} tokens: too few to profile"
            )
        if on_plan is not None:
            on_plan(_probe_count(plan, len(lengths)))
        tick = progress or (lambda _: None)
        probe = _Probe(session, base, served, posts, plan, vocab_size, tick)
        for _ in range(_WARMUP):
            await probe.send(probe.prompt(longest), 2)
            tick("warm-up")
        prefill, notes = await probe.prefill(lengths)
        decode = await probe.decode()
        metrics, failed = await _scrape(session, f"{base}/metrics", headers, plan.timeout_s)
        notes += [failed] if failed else []
    return Measurements(served, longest, tuple(prefill), tuple(decode), metrics, tuple(notes))
