"""Proxy helpers: which headers pass, how errors look, how an answer is relayed.

Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}`` with vLLM's
type names, so clients cannot tell the router from a replica. Streams are relayed chunk by
chunk as they arrive; nothing is re-encoded. Nothing goes to the client before an answer's
opening has arrived (a whole answer's body, a stream's first chunk), so an answer that breaks
off before it (the replica died) is sent to another replica, not to the client.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable, Mapping

from aiohttp import web

from kvmesh.errors import UpstreamConnectError, UpstreamError
from kvmesh.router.upstream import UpstreamResponse
from kvmesh.routing.dispatcher import error_body

log = logging.getLogger(__name__)
REPLICA_HEADER = "x-kvmesh-replica"  # the serving replica, only with RouterConfig.replica_header

_HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "TE", "Trailer",
        "Transfer-Encoding", "Upgrade", "Host", "Content-Length",
    )
)  # fmt: skip


def end_to_end(headers: Mapping[str, str] | Iterable[tuple[str, str]]) -> dict[str, str]:
    """The headers a proxy passes on (RFC 9110 §7.6.1: hop-by-hop ones stay behind)."""
    pairs = headers.items() if isinstance(headers, Mapping) else headers
    return {k: v for k, v in pairs if k.lower() not in _HOP_BY_HOP}


# Connect-level failures: the request never reached a replica's handler, so another may take it.
RETRYABLE = (UpstreamConnectError,)


def error_response(status: int, message: str, param: str | None = None, **headers: str) -> web.Response:
    return web.Response(
        status=status,
        body=error_body(status, message, param),
        content_type="application/json",
        headers=headers,
    )


def is_stream(resp: UpstreamResponse, stream: bool) -> bool:
    """Whether ``resp`` is relayed as an SSE stream (``stream``: the client asked for one)."""
    return stream and resp.status == 200 and resp.content_type == "text/event-stream"


async def opening(resp: UpstreamResponse, stream: bool) -> bytes:
    """What must have arrived before anything of ``resp`` goes to the client: a whole
    answer's body, or an SSE stream's first chunk (b"" for a stream that ends at once).

    Raises :class:`UpstreamBrokenError` when the answer breaks off before that: the client
    has seen nothing of it, so another replica may take the request;
    :class:`UpstreamError` when it is malformed or over the upstream's ``max_answer_bytes``;
    ``TimeoutError`` when the replica is silent for longer than the read timeout.
    """
    return await (resp.read_chunk() if is_stream(resp, stream) else resp.read())


async def relay(
    request: web.Request,
    resp: UpstreamResponse,
    first: bytes,
    stream: bool,
    name: str,
    on_broken: Callable[[], None],
    on_first_chunk: Callable[[], None] | None = None,
    shown: str | None = None,
    write_timeout_s: float = 30.0,
) -> web.StreamResponse:
    """Answer ``request`` with the upstream's ``resp``, whose :func:`opening` was ``first``:
    whole, or an SSE stream chunk by chunk.

    ``on_first_chunk`` is called with a stream's first chunk: the replica has finished the
    prompt's prefill (vLLM streams nothing before the first token). ``shown``: the replica
    name for the ``x-kvmesh-replica`` header (None: no header; it would tell any client
    which replica caches which prefix). A client that takes none of a stream's bytes for
    ``write_timeout_s`` is dropped, and the upstream stream with it.
    """
    headers = end_to_end(resp.headers)
    if shown is not None:
        headers[REPLICA_HEADER] = shown
    if not is_stream(resp, stream):
        return web.Response(status=resp.status, body=first, headers=headers)
    out = web.StreamResponse(status=resp.status, headers=headers)
    await out.prepare(request)
    try:
        chunk = first
        while chunk:
            if on_first_chunk is not None:
                on_first_chunk()
                on_first_chunk = None
            await _write(out, chunk, write_timeout_s)
            chunk = await resp.read_chunk()
        await out.write_eof()
    except ConnectionResetError:
        pass  # the client left (aiohttp's write error is one); releasing resp ends the upstream stream
    except _ClientStalled:
        # It holds a replica's generation and our buffers while reading nothing: drop it.
        # Releasing resp (the caller's finally) ends the upstream stream.
        if request.transport is not None:
            request.transport.abort()
        log.info("a client took no stream bytes for %.0f s: dropped it (replica %s)", write_timeout_s, name)
    except (UpstreamError, TimeoutError) as exc:
        # Headers are gone already; say it in the stream, as vLLM does for its own errors.
        on_broken()
        with contextlib.suppress(ConnectionResetError):
            await out.write(
                b"data: " + error_body(502, f"replica {name} broke off the stream: {exc!r}") + b"\n\n"
            )
            await out.write_eof()
    return out


class _ClientStalled(Exception):
    """The client did not take a write within its deadline."""


async def _write(out: web.StreamResponse, chunk: bytes, timeout_s: float) -> None:
    try:
        async with asyncio.timeout(timeout_s):
            await out.write(chunk)  # waits while the client's socket buffer is full
    except TimeoutError:
        raise _ClientStalled from None
