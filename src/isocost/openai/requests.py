"""OpenAI request bodies and the one decoder every HTTP edge reads them with.

Requests decode with msgspec; fields nobody here uses (tools, logit_bias, ...) are
accepted and skipped without building objects for them, as engines do, so a 100 kB
prompt costs one pass over the bytes. The sampling fields vLLM refuses bad values of
(``temperature`` >= 0, ``top_p`` in (0, 1], ``seed`` an int64, ``stop`` a string or
strings, ``logprobs`` an int of -1 or more on completions and a bool on chat, token ids
>= 0) are declared with those bounds, so the engine and the gateway refuse the same
bodies, with the field named, through this one definition. The structs take what the
OpenAI API allows (a completion ``prompt`` may be one string, token ids, or a batch of
either); each edge adds its own rules on top (the engine simulator serves one prompt per
request, the gateway routes a batch by its first prompt).

Every HTTP edge reads the output cap through ``output_cap``, so the gateway checks and
charges the very number an engine executes (see its docstring).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, TypeVar

import msgspec

from isocost.openai.errors import ApiError

__all__ = [
    "KV_TRANSFER_MS_HEADER",
    "ChatMessage",
    "ChatRequest",
    "CompletionRequest",
    "ContentPart",
    "KvTransferParams",
    "RequestError",
    "StreamOptions",
    "decode_body",
    "output_cap",
]

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # what OpenAI and vLLM run when /v1/completions omits it


class StreamOptions(msgspec.Struct, frozen=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage so far in every chunk


# isocost's engine says a decode's modelled KV-transfer time in this response header
KV_TRANSFER_MS_HEADER = "x-isocost-kv-transfer-ms"


class KvTransferParams(msgspec.Struct, frozen=True, kw_only=True):
    """vLLM's disaggregated-serving fields (NixlConnector): a prefill request asks for
    ``do_remote_decode``; its answer, passed on to the decode request, says
    ``do_remote_prefill`` and where the KV waits (engine, request, blocks, host, port)."""

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_request_id: str | None = None
    remote_block_ids: list[Any] | None = None  # flat, or one list per KV-cache group
    remote_host: str | None = None
    remote_port: int | None = None
    tp_size: int = 1
    remote_num_tokens: int | None = None


_TokenId = Annotated[int, msgspec.Meta(ge=0)]


class _Common(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    n: int = 1
    user: str | None = None
    kv_transfer_params: KvTransferParams | None = None
    # read for their bounds only (vLLM's, see the module docstring)
    temperature: Annotated[float, msgspec.Meta(ge=0)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    seed: Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)] | None = None
    stop: str | list[str] | None = None


class CompletionRequest(_Common, frozen=True, kw_only=True):
    prompt: str | list[str | _TokenId | list[_TokenId]]
    logprobs: bool | Annotated[int, msgspec.Meta(ge=-1)] | None = None  # -1: all


class ContentPart(msgspec.Struct, frozen=True):
    type: str = "text"
    text: str | None = None


class ChatMessage(msgspec.Struct, frozen=True):
    role: str
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        """The message's text: its string content, or its text parts joined."""
        content = self.content
        if isinstance(content, list):
            return "".join(part.text or "" for part in content if part.type == "text")
        return content or ""


class ChatRequest(_Common, frozen=True, kw_only=True):
    messages: list[ChatMessage]
    logprobs: bool | None = None
    # vLLM's chat template switches: continue the last (assistant) message as it is, or
    # open a new assistant turn (the default)
    continue_final_message: bool = False
    add_generation_prompt: bool = True


class RequestError(ApiError):
    """A body that is not a valid request (400); ``param`` names the offending field when
    known, ``code`` is ``invalid_json`` for bytes that are no JSON, else ``invalid_value``."""

    def __init__(
        self, message: str, *, param: str | None = None, code: str = "invalid_value"
    ) -> None:
        super().__init__(400, message, code=code, param=param)


_T = TypeVar("_T")
_AT = re.compile(r"at `\$\.?([^`]*)`")
_MISSING = re.compile(r"missing required field `([^`]*)`")


def decode_body(body: bytes, kind: type[_T]) -> _T:
    """The request body as ``kind``, or a RequestError naming the offending field."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        text = str(exc)
        raise RequestError(text, param=_field(text)) from None
    except msgspec.DecodeError as exc:
        raise RequestError(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    except UnicodeDecodeError:  # msgspec raises it for invalid UTF-8 inside a JSON string
        raise RequestError("request body is not valid UTF-8", code="invalid_json") from None
    except RecursionError:  # msgspec's own depth limit, even in fields it skips
        raise RequestError("request body is nested too deeply", code="invalid_json") from None


def output_cap(body: ChatRequest | CompletionRequest) -> tuple[int | None, str]:
    """The most output tokens an engine will run for ``body``, and the field that says so.

    Engines disagree on which field wins: vLLM reads ``max_completion_tokens or
    max_tokens`` on chat, older engines and most completion endpoints read ``max_tokens``
    only, some read ``max_completion_tokens`` on both endpoints. So both fields count on
    both endpoints, and a body that gives both with different values is refused: any
    engine then runs the one number that was checked. Without either, ``/v1/completions``
    runs OpenAI's default of 16 and chat runs to the model's context (None). A cap below
    1 is a RequestError.
    """
    given = [
        (name, value)
        for name, value in (
            ("max_completion_tokens", body.max_completion_tokens),
            ("max_tokens", body.max_tokens),
        )
        if value is not None
    ]
    if len({value for _, value in given}) > 1:
        raise RequestError(
            "max_tokens and max_completion_tokens differ; engines read different ones, "
            "so send one (or both equal)",
            param="max_completion_tokens",
        )
    if not given:
        if isinstance(body, ChatRequest):
            return None, "max_completion_tokens"
        return COMPLETIONS_DEFAULT_MAX_TOKENS, "max_tokens"
    param, cap = given[0]
    if cap < 1:
        raise RequestError(f"{param} must be at least 1, got {cap}", param=param)
    return cap, param


def _field(message: str) -> str | None:
    """The field a msgspec validation message points at: ``messages[0].role``, ``prompt``."""
    at, missing = _AT.search(message), _MISSING.search(message)
    path = [found.group(1) for found in (at, missing) if found and found.group(1)]
    return ".".join(path) or None
