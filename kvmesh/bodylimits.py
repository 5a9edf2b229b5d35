"""Bounded JSON bodies for every surface that takes one: the router's OpenAI proxy, its
controller, the engine admin API and the EPP.

Bodies are decoded by msgspec, never by hand. A body nested deeper than ``MAX_DEPTH`` levels
is refused with a 400 that names the body: the decoder's own recursion guard catches the
absurd depths (it raises ``RecursionError`` near the interpreter's limit, which was a 500
before), and a walk of the decoded value catches the rest. Real OpenAI bodies stay far
below 64 levels: a chat message's content part is 4, a tool's JSON-schema parameters a
dozen or two.

The walk also counts the values (``max_values``): a body that decodes to millions of small
objects costs its decoder, and whoever receives the decoded value, time in proportion.

**Prompt bounds** (:func:`check_prompt`, the OpenAI completions and chat shapes). A prompt
longer than the model's ``max_model_len`` can only fail on the replica, so it is refused
before anything tokenizes or hashes it: token-id prompts by their count, texts by a bound
on characters per token (a text of more than ``max_model_len * chars_per_token`` characters
cannot fit), the exact token count being checked after tokenizing.

**Large bodies off the event loop**: :mod:`kvmesh.bodyworker` runs these checks in a worker
process for bodies of ``OFFLOAD_BYTES`` and more.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from kvmesh.errors import BodyError

MAX_DEPTH = 64
# Values in one decoded body, unless a surface says otherwise: a 256k-token prompt fits.
MAX_VALUES = 1 << 18
# With no tokenizer to ask: the longest token of common vocabularies is well under this.
DEFAULT_CHARS_PER_TOKEN = 256

_DECODER = msgspec.json.Decoder()
_CONTAINERS = (dict, list)


def _too_deep(max_depth: int) -> BodyError:
    return BodyError("body", f"request body is JSON nested deeper than {max_depth} levels", status=400)


def decode_json(
    raw: bytes, max_depth: int = MAX_DEPTH, max_values: int | None = MAX_VALUES, invalid_status: int = 400
) -> Any:
    """The decoded JSON ``raw``; :class:`BodyError` (field ``body``) if it is not JSON
    (``invalid_status``), is nested deeper than ``max_depth`` or holds more than
    ``max_values`` values (400)."""
    value = _decode(raw, max_depth, invalid_status)
    check_shape(value, max_depth, max_values)
    return value


def _decode(raw: bytes, max_depth: int, invalid_status: int = 400) -> Any:
    try:
        return _DECODER.decode(raw)
    except RecursionError:
        raise _too_deep(max_depth) from None
    except msgspec.DecodeError as exc:
        raise BodyError("body", f"request body is not valid JSON: {exc}", status=invalid_status) from None


def check_shape(value: Any, max_depth: int = MAX_DEPTH, max_values: int | None = MAX_VALUES) -> None:
    """Raise :class:`BodyError` (400) if ``value`` nests deeper than ``max_depth`` containers
    or holds more than ``max_values`` values. A level at a time, without recursion; a list
    with no container in it costs one C-level pass (``map(type, ...)``)."""
    level = [value] if type(value) in _CONTAINERS else []
    depth = count = 0
    while level:
        depth += 1
        if depth > max_depth:
            raise _too_deep(max_depth)
        below: list[Any] = []
        for container in level:
            items = container.values() if type(container) is dict else container
            count += len(items)
            if max_values is not None and count > max_values:
                raise BodyError("body", f"request body holds more than {max_values} JSON values", status=400)
            kinds = set(map(type, items))
            if dict in kinds or list in kinds:
                below.extend(x for x in items if type(x) in _CONTAINERS)
        level = below


# -- OpenAI prompts ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PromptLimits:
    """What a prompt may hold: ``max_tokens`` (the model's ``max_model_len``; None: not
    known, nothing is checked) and the most characters one token can stand for."""

    max_tokens: int | None = None
    chars_per_token: int = DEFAULT_CHARS_PER_TOKEN
    max_depth: int = MAX_DEPTH
    max_values: int = MAX_VALUES

    @property
    def max_chars(self) -> int | None:
        return None if self.max_tokens is None else self.max_tokens * self.chars_per_token

    def too_long(self, field: str, what: str) -> BodyError:
        return BodyError(
            field,
            f"{what} is longer than the model's maximum context length ({self.max_tokens} tokens)",
            status=400,
        )


def check_prompt(body: Mapping[str, Any], chat: bool, limits: PromptLimits) -> None:
    """Refuse (:class:`BodyError`, 400) a completions ``prompt`` or chat ``messages`` that
    cannot fit ``limits.max_tokens``, without tokenizing it (see the module docstring)."""
    if limits.max_tokens is None:
        return
    if chat:
        messages = body.get("messages")
        if isinstance(messages, list) and _text_chars(messages) > (limits.max_chars or 0):
            raise limits.too_long("messages", "the messages' text")
        return
    prompt = body.get("prompt")
    prompts = prompt if isinstance(prompt, list) and prompt and type(prompt[0]) in (str, list) else [prompt]
    for p in prompts:
        if isinstance(p, list) and len(p) > limits.max_tokens:
            raise limits.too_long("prompt", f"a prompt of {len(p)} token ids")
        if isinstance(p, str) and len(p) > (limits.max_chars or 0):
            raise limits.too_long("prompt", f"a prompt of {len(p)} characters")


def check_token_count(n: int, limits: PromptLimits, field: str) -> None:
    """After tokenizing: refuse a prompt of more than ``max_tokens`` tokens."""
    if limits.max_tokens is not None and n > limits.max_tokens:
        raise limits.too_long(field, f"a prompt of {n} tokens")


def _text_chars(messages: list[Any]) -> int:
    """Characters of the text in chat messages (string contents and text parts)."""
    total = 0
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            for part in content:
                text = part.get("text") if isinstance(part, dict) else None
                if isinstance(text, str):
                    total += len(text)
    return total


def decode_request(raw: bytes, chat: bool, limits: PromptLimits) -> dict[str, Any]:
    """An OpenAI request body, decoded and checked; :class:`BodyError` (400) says why not."""
    body = _decode(raw, limits.max_depth)
    if not isinstance(body, dict):
        raise BodyError("body", "request body must be a JSON object", status=400)
    check_prompt(body, chat, limits)  # first: its refusal names the field
    check_shape(body, limits.max_depth, limits.max_values)
    return body
