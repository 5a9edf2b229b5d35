"""Proxy helpers: which headers pass, how errors look, how an answer is relayed.

Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}`` with vLLM's
type names, so clients cannot tell the router from a replica. Streams are relayed chunk by
chunk as they arrive; nothing is re-encoded.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterable, Mapping

from aiohttp import web

from kvmesh.errors import UpstreamConnectError, UpstreamError
from kvmesh.router.upstream import UpstreamResponse

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


ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    408: "RequestTimeoutError",
    413: "RequestTooLargeError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}
# Connect-level failures: the request never reached a replica's handler, so another may take it.
RETRYABLE = (UpstreamConnectError,)


def error_body(status: int, message: str, param: str | None = None) -> bytes:
    err = {"message": message, "type": ERROR_TYPES.get(status, "InternalServerError"), "param": param}
    return json.dumps({"error": {**err, "code": status}}).encode()


def error_response(status: int, message: str, param: str | None = None, **headers: str) -> web.Response:
    return web.Response(
        status=status,
        body=error_body(status, message, param),
        content_type="application/json",
        headers=headers,
    )


async def relay(
    request: web.Request,
    resp: UpstreamResponse,
    stream: bool,
    name: str,
    on_broken: Callable[[], None],
    on_first_chunk: Callable[[], None] | None = None,
) -> web.StreamResponse:
    """Answer ``request`` with the upstream's ``resp``: whole, or an SSE stream chunk by chunk.

    ``on_first_chunk`` is called when a stream's first chunk arrives: the replica has
    finished the prompt's prefill (vLLM streams nothing before the first token).
    """
    headers = end_to_end(resp.headers)
    headers["x-kvmesh-replica"] = name
    if not (stream and resp.status == 200 and resp.content_type == "text/event-stream"):
        try:
            body = await resp.read()
        except (UpstreamError, TimeoutError) as exc:
            on_broken()
            return error_response(502, f"replica {name} broke off its answer: {exc!r}")
        return web.Response(status=resp.status, body=body, headers=headers)
    out = web.StreamResponse(status=resp.status, headers=headers)
    await out.prepare(request)
    try:
        while chunk := await resp.read_chunk():
            if on_first_chunk is not None:
                on_first_chunk()
                on_first_chunk = None
            await out.write(chunk)
        await out.write_eof()
    except ConnectionResetError:
        pass  # the client left (aiohttp's write error is one); releasing resp ends the upstream stream
    except (UpstreamError, TimeoutError) as exc:
        # Headers are gone already; say it in the stream, as vLLM does for its own errors.
        on_broken()
        with contextlib.suppress(ConnectionResetError):
            await out.write(
                b"data: " + error_body(502, f"replica {name} broke off the stream: {exc!r}") + b"\n\n"
            )
            await out.write_eof()
    return out
