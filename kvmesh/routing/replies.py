"""What the router and the EPP read of a replica's answers to their own requests (health,
models, metrics, tokenize, cost reports, the admin API, index pages), bounded.

A replica pod is untrusted: a compromised or broken one can answer ``/metrics`` or
``/v1/models`` without end, and the router read each whole before looking at it. Within a
1-second health timeout one such replica grew the router from 195 MB to 700-800 MB RSS
(7 December 2026); a few would have had it killed, and with it every request of the fleet.
Each answer is now read up to a bound that fits its kind many times over, and JSON is
decoded by msgspec with the depth and value bounds of client bodies
(:func:`kvmesh.bodylimits.decode_json`). Answers to clients are bounded elsewhere
(``max_answer_bytes``).
"""

from __future__ import annotations

from typing import Any

import aiohttp

from kvmesh.bodylimits import decode_json
from kvmesh.errors import BodyError, UpstreamError

HEALTH_BYTES = 64 << 10  # /health: vLLM answers an empty body
MODELS_BYTES = 4 << 20  # /v1/models: a card per model and LoRA adapter
METRICS_BYTES = 32 << 20  # /metrics: vLLM's histograms, per model and adapter label
JSON_BYTES = 64 << 20  # a tokenize answer, an admin answer, a page of index events


class ReplyError(UpstreamError, ValueError):
    """A replica's answer larger than its bound, or not the JSON it should be."""


async def read_capped(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    """The body of ``resp``, or :class:`ReplyError` once it passes ``limit`` bytes (declared
    or read): nothing past the bound is read."""
    declared = resp.content_length
    if declared is not None and declared > limit:
        raise ReplyError(f"{resp.url.path} answered {declared} bytes, over its bound of {limit}")
    buf = bytearray()
    while piece := await resp.content.read(limit + 1 - len(buf)):
        buf += piece
        if len(buf) > limit:
            raise ReplyError(f"{resp.url.path} answered over its bound of {limit} bytes")
    return bytes(buf)


async def json_capped(resp: aiohttp.ClientResponse, limit: int = JSON_BYTES) -> Any:
    """The body of ``resp`` as JSON, bounded in size, depth and values; ``None`` for an empty
    body (as aiohttp's ``json()``: an error status may come with none)."""
    raw = await read_capped(resp, limit)
    if not raw.strip():
        return None
    try:
        return decode_json(raw, max_values=None)
    except BodyError as exc:
        raise ReplyError(
            f"{resp.url.path} answered {exc.message.replace('request body', 'a body')}"
        ) from None


async def text_capped(resp: aiohttp.ClientResponse, limit: int) -> str:
    """The body of ``resp`` as UTF-8 text (Prometheus's exposition format), bounded in size."""
    return (await read_capped(resp, limit)).decode("utf-8", errors="replace")
