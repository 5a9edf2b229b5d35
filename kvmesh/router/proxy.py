"""Proxy helpers: which headers pass, how errors look, how an answer is relayed.

Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}`` with vLLM's
type names, so clients cannot tell the router from a replica. Streams are relayed chunk by
chunk as they arrive; nothing is re-encoded.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Mapping

import aiohttp
from aiohttp import web

_HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "TE", "Trailer",
        "Transfer-Encoding", "Upgrade", "Host", "Content-Length",
    )
)  # fmt: skip


def end_to_end(headers: Mapping[str, str]) -> dict[str, str]:
    """The headers a proxy passes on (RFC 9110 §7.6.1: hop-by-hop ones stay behind)."""
    return {k: v for k, v in headers.items() if k.lower() not in _HOP_BY_HOP}


ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    413: "RequestTooLargeError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}
# Connect-level failures: the request never reached a replica's handler, so another may take it.
RETRYABLE = (
    aiohttp.ClientConnectorError,
    aiohttp.ConnectionTimeoutError,
    aiohttp.ServerDisconnectedError,
    aiohttp.ClientOSError,
)


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
    resp: aiohttp.ClientResponse,
    stream: bool,
    name: str,
    on_broken: Callable[[], None],
) -> web.StreamResponse:
    """Answer ``request`` with the upstream's ``resp``: whole, or an SSE stream chunk by chunk."""
    headers = end_to_end(resp.headers)
    headers["x-kvmesh-replica"] = name
    if not (stream and resp.status == 200 and resp.content_type == "text/event-stream"):
        try:
            body = await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            on_broken()
            return error_response(502, f"replica {name} broke off its answer: {exc!r}")
        return web.Response(status=resp.status, body=body, headers=headers)
    out = web.StreamResponse(status=resp.status, headers=headers)
    await out.prepare(request)
    try:
        async for chunk in resp.content.iter_any():
            await out.write(chunk)
        await out.write_eof()
    except ConnectionResetError:
        pass  # the client left (aiohttp's write error is one); releasing resp ends the upstream stream
    except (aiohttp.ClientError, TimeoutError) as exc:
        # Headers are gone already; say it in the stream, as vLLM does for its own errors.
        on_broken()
        with contextlib.suppress(ConnectionResetError):
            await out.write(
                b"data: " + error_body(502, f"replica {name} broke off the stream: {exc!r}") + b"\n\n"
            )
            await out.write_eof()
    return out
