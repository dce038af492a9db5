"""Request validation of ``isocost engine``: a decoded OpenAI body -> what to submit.

The checks and messages follow vLLM's (unknown model 404, ``n`` other than 1, ``max_tokens``
below 1 or above the context, a prompt that leaves no room for output, a prompt token id
outside the vocabulary), and so does the cut: what does not fit after the prompt is cut,
and the answer ends ``length``. Field types and bounds the gateway checks as well are the
OpenAI structs' (``isocost.openai.requests``).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from isocost.engine.records import RequestSpec
from isocost.engine.replica import ServedReplica
from isocost.engine.tokens import render_chat
from isocost.openai.errors import ApiError
from isocost.openai.requests import ChatRequest, CompletionRequest
from isocost.prefix.hashing import token_block_hashes

__all__ = ["Generation", "chat_text", "prompt_ids", "prompt_text", "validate"]

_COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass(frozen=True, slots=True)
class Generation:
    """A validated completion request, ready to submit."""

    spec: RequestSpec
    max_tokens: int
    stream: bool
    include_usage: bool
    continuous_usage: bool  # usage so far in every chunk (vLLM's continuous_usage_stats)


def prompt_text(prompt: str | list[str | int | list[int]]) -> str | None:
    """The text of a completion prompt given as text (one string), else None."""
    if isinstance(prompt, str):
        return prompt
    if len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    return None


def prompt_ids(replica: ServedReplica, prompt: str | list[str | int | list[int]]) -> list[int]:
    """The token ids of a completion prompt: one string or one list of token ids (each
    in the model's vocabulary, as vLLM checks)."""
    text = prompt_text(prompt)
    if text is not None:
        return replica.tokenizer.encode(text)
    ids = [p for p in prompt if isinstance(p, int)]
    if len(ids) != len(prompt):
        raise ApiError(400, "prompt must be one string or one list of token ids", param="prompt")
    largest = max(ids, default=0)
    if largest >= replica.model.cost.model.vocab_size:
        raise ApiError(400, f"Token id {largest} is out of vocabulary", param="prompt")
    return ids


def chat_text(body: ChatRequest) -> str:
    """The chat rendered as the replica's template would render it; vLLM's refusals of
    a final message that cannot be continued."""
    if not body.messages:
        raise ApiError(400, "messages must not be empty", param="messages")
    if body.continue_final_message:
        if body.add_generation_prompt:
            raise ApiError(
                400,
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                param="continue_final_message",
            )
        if body.messages[-1].role != "assistant":
            raise ApiError(
                400,
                "continue_final_message needs the final message to be the assistant's",
                param="messages",
            )
    return render_chat(
        [(message.role, message.text()) for message in body.messages],
        continue_final=body.continue_final_message,
        generation_prompt=body.add_generation_prompt,
    )


def validate(
    replica: ServedReplica, body: ChatRequest | CompletionRequest, prompt_ids: list[int]
) -> Generation:
    """The request to submit for ``body``, or the ApiError vLLM would answer."""
    if body.model != replica.served_model_name:
        raise ApiError(
            404,
            f"The model `{body.model}` does not exist.",
            type_="invalid_request_error",
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
    spec = RequestSpec(
        uuid.uuid4().hex, num_prompt, output, tuple(block_hashes), token_ids=tuple(prompt_ids)
    )
    options = body.stream_options
    include_usage = options is not None and options.include_usage
    continuous = include_usage and options is not None and options.continuous_usage_stats
    return Generation(spec, requested, body.stream, include_usage, continuous)
