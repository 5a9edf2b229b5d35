"""The proxy's own HTTP/1.1 client, against a scripted loopback server (real sockets)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from kvmesh.errors import UpstreamBrokenError, UpstreamConnectError, UpstreamError
from kvmesh.harness.ports import free_port
from kvmesh.router.upstream import Upstream

# A handler reads one request's head and body from the connection and writes an answer;
# returning False ends the connection.
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, bytes, bytes], Awaitable[bool]]


class Server:
    """Accepts connections, hands each request to ``handler``; counts connections and requests."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[tuple[bytes, bytes]] = []  # (head, body)
        self.closed = asyncio.Event()  # set whenever a client closes a connection
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> Server:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    self.closed.set()
                    return
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.startswith(b"Content-Length")
                )
                body = await reader.readexactly(length)
                self.requests.append((head, body))
                try:
                    if not await self.handler(reader, writer, head, body):
                        return
                except ConnectionError:  # the client hung up while the handler was writing
                    self.closed.set()
                    return
        finally:
            writer.close()


def ok(body: bytes, extra: bytes = b"") -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
        + extra
        + (b"Content-Length: %d\r\n\r\n" % len(body) + body)
    )


async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes, body: bytes) -> bool:
    writer.write(ok(b'{"echo": ' + body + b"}"))
    return True


def run(coro: Awaitable[None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 20))  # type: ignore[arg-type]


def test_request_bytes_and_kept_alive_connection() -> None:
    async def main() -> None:
        async with Server(echo) as srv:
            up = Upstream(2.0, 5.0)
            for i in range(3):
                resp = await up.post(srv.url + "/base/", "/v1/completions", b"[%d]" % i, [("X-A", "b")])
                assert (resp.status, resp.content_type) == (200, "application/json")
                assert ("Content-Type", "application/json") in resp.headers
                assert await resp.read() == b'{"echo": [%d]}' % i
                resp.release()
            assert srv.connections == 1  # one connection, kept and reused
            host = srv.url.removeprefix("http://")
            assert srv.requests[0] == (
                f"POST /base/v1/completions HTTP/1.1\r\nHost: {host}\r\nX-A: b\r\n"
                "Content-Length: 3\r\n\r\n".encode(),
                b"[0]",
            )
            with pytest.raises(UpstreamError, match="cannot be sent"):
                await up.post(srv.url, "/x", b"", [("X-A", "b\r\nX-Injected: 1")])
            await up.close()

    run(main())


def test_chunked_answers_arrive_chunk_by_chunk() -> None:
    async def chunked(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes, body: bytes
    ) -> bool:
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # an interim answer is skipped
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        for part in (b"data: 1\n\n", b"data: 2\n\n"):
            await writer.drain()
            await asyncio.sleep(0.01)
            writer.write(b"%x;ext=1\r\n%s\r\n" % (len(part), part))
        writer.write(b"0\r\nTrailer: x\r\n\r\n")
        return True

    async def main() -> None:
        async with Server(chunked) as srv:
            up = Upstream(2.0, 5.0)
            for _ in range(2):
                resp = await up.post(srv.url, "/s", b"{}", [])
                assert resp.content_type == "text/event-stream"
                chunks = []
                while chunk := await resp.read_chunk():
                    chunks.append(chunk)
                assert chunks == [b"data: 1\n\n", b"data: 2\n\n"]
                resp.release()
            assert srv.connections == 1

    run(main())


def test_answers_that_end_their_connection_are_not_kept() -> None:
    async def until_close(r: asyncio.StreamReader, w: asyncio.StreamWriter, head: bytes, body: bytes) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\n\r\nall of it")  # no length: the body runs to the end
        return False

    async def close_header(
        r: asyncio.StreamReader, w: asyncio.StreamWriter, head: bytes, body: bytes
    ) -> bool:
        w.write(ok(b"{}", b"Connection: close\r\n"))
        return False

    async def main() -> None:
        for handler, want in ((until_close, b"all of it"), (close_header, b"{}")):
            async with Server(handler) as srv:
                up = Upstream(2.0, 5.0)
                for _ in range(2):
                    resp = await up.post(srv.url, "/", b"", [])
                    assert await resp.read() == want
                    resp.release()
                assert srv.connections == 2

    run(main())


def test_a_kept_connection_the_replica_closed_is_replaced_silently() -> None:
    # keyed by the writer itself (holding it), not id(w): a closed connection's writer can be
    # collected and a new one given the same id, which made this test hang up on a fresh connection
    served: dict[asyncio.StreamWriter, int] = {}

    async def first_only(r: asyncio.StreamReader, w: asyncio.StreamWriter, head: bytes, body: bytes) -> bool:
        served[w] = served.get(w, 0) + 1
        if served[w] > 1:
            return False  # an idle timeout racing the next request: hang up without answering
        w.write(ok(b"{}"))
        return True

    async def close_after(r: asyncio.StreamReader, w: asyncio.StreamWriter, head: bytes, body: bytes) -> bool:
        w.write(ok(b"{}"))  # says keep-alive (HTTP/1.1), then closes anyway
        return False

    async def main() -> None:
        for handler in (first_only, close_after):
            async with Server(handler) as srv:
                up = Upstream(2.0, 5.0)
                for _ in range(3):
                    resp = await up.post(srv.url, "/", b"", [])
                    assert await resp.read() == b"{}"
                    resp.release()
                    await asyncio.sleep(0.02)
                assert srv.connections == 3

    run(main())


def test_no_answer_is_a_connect_error() -> None:
    async def hang_up(r: asyncio.StreamReader, w: asyncio.StreamWriter, head: bytes, body: bytes) -> bool:
        return False

    async def main() -> None:
        async with Server(hang_up) as srv:
            with pytest.raises(UpstreamConnectError, match="without answering"):
                await Upstream(2.0, 5.0).post(srv.url, "/", b"", [])
        port = free_port()  # nothing listens there
        with pytest.raises(UpstreamConnectError, match="cannot connect"):
            await Upstream(2.0, 5.0).post(f"http://127.0.0.1:{port}", "/", b"", [])

    run(main())


def test_timeouts_and_broken_answers() -> None:
    async def slow_head(r: asyncio.StreamReader, w: asyncio.StreamWriter, head: bytes, body: bytes) -> bool:
        await asyncio.sleep(1.0)
        return False

    async def broken(r: asyncio.StreamReader, w: asyncio.StreamWriter, head: bytes, body: bytes) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await w.drain()
        await asyncio.sleep(0.3)
        return False  # the stream ends without its last chunk

    async def garbage(r: asyncio.StreamReader, w: asyncio.StreamWriter, head: bytes, body: bytes) -> bool:
        w.write(b"SMTP ready\r\n\r\n")
        return False

    async def head_cut(r: asyncio.StreamReader, w: asyncio.StreamWriter, head: bytes, body: bytes) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\nContent-Ty")
        await w.drain()
        return False  # the replica died mid-way through its head

    async def bad_chunk(r: asyncio.StreamReader, w: asyncio.StreamWriter, head: bytes, body: bytes) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhelloXX0\r\n\r\n")
        await w.drain()
        await asyncio.sleep(0.3)
        return False

    async def main() -> None:
        async with Server(slow_head) as srv:
            with pytest.raises(TimeoutError):
                await Upstream(2.0, 0.2).post(srv.url, "/", b"", [])
        async with Server(broken) as srv:
            resp = await Upstream(2.0, 0.1).post(srv.url, "/", b"", [])
            assert await resp.read_chunk() == b"hello"
            with pytest.raises(TimeoutError):  # silent for longer than the read timeout
                await resp.read_chunk()
            resp.release()
            resp = await Upstream(2.0, 5.0).post(srv.url, "/", b"", [])
            with pytest.raises(UpstreamBrokenError, match="broke off"):
                await resp.read()
            resp.release()
        async with Server(head_cut) as srv:  # broken: another replica may take the request
            with pytest.raises(UpstreamBrokenError, match="head broke off"):
                await Upstream(2.0, 5.0).post(srv.url, "/", b"", [])
        # Malformed answers are errors, but not broken connections.
        async with Server(garbage) as srv:
            with pytest.raises(UpstreamError, match="status line") as info:
                await Upstream(2.0, 5.0).post(srv.url, "/", b"", [])
            assert not isinstance(info.value, UpstreamBrokenError)
        async with Server(bad_chunk) as srv:
            resp = await Upstream(2.0, 5.0).post(srv.url, "/", b"", [])
            with pytest.raises(UpstreamError, match="malformed") as info:
                await resp.read()
            assert not isinstance(info.value, UpstreamBrokenError)
            resp.release()

    run(main())


def test_an_unread_answer_closes_its_connection() -> None:
    """How a client leaving mid-stream reaches vLLM: the router hangs up on it."""

    async def stream(r: asyncio.StreamReader, w: asyncio.StreamWriter, head: bytes, body: bytes) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(200):
            w.write(b"3\r\nabc\r\n")
            await w.drain()
            await asyncio.sleep(0.01)
            if r.at_eof():
                raise ConnectionResetError
        return False

    async def main() -> None:
        async with Server(stream) as srv:
            up = Upstream(2.0, 5.0)
            resp = await up.post(srv.url, "/", b"", [])
            assert await resp.read_chunk() == b"abc"
            resp.release()
            await asyncio.wait_for(srv.closed.wait(), 5)
            assert up._idle.get(srv.url, []) == []

    run(main())


def test_answers_are_bounded() -> None:
    """A replica's answer is read into memory whole (or a stream chunk by chunk), so each is
    bounded by ``max_answer_bytes``; so are interim answers. Each is an error that does not
    read on: a Content-Length or a chunk size over the bound is refused before its bytes."""
    limit = 1000

    async def declared(r: asyncio.StreamReader, w: asyncio.StreamWriter, head: bytes, body: bytes) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100000000000\r\n\r\n" + b"x" * 10)
        return False

    async def chunks(r: asyncio.StreamReader, w: asyncio.StreamWriter, head: bytes, body: bytes) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(3):  # 3 x 400 bytes: each chunk fits, the whole answer does not
            w.write(b"190\r\n" + b"y" * 400 + b"\r\n")
        w.write(b"0\r\n\r\n")
        return True

    async def big_chunk(r: asyncio.StreamReader, w: asyncio.StreamWriter, head: bytes, body: bytes) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffff\r\nzz")
        await w.drain()
        await asyncio.sleep(0.3)
        return False

    async def interim(r: asyncio.StreamReader, w: asyncio.StreamWriter, head: bytes, body: bytes) -> bool:
        for _ in range(50):
            w.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        w.write(ok(b"{}"))
        return True

    async def refused(handler: Handler, match: str, whole: bool) -> None:
        async with Server(handler) as srv:
            resp = await Upstream(2.0, 5.0, max_answer_bytes=limit).post(srv.url, "/", b"", [])
            with pytest.raises(UpstreamError, match=match):
                await (resp.read() if whole else resp.read_chunk())
            resp.release()

    async def main() -> None:
        await refused(declared, "100000000000 bytes are more than max_answer_bytes", whole=True)
        await refused(big_chunk, "a chunk of 281474976710655 bytes", whole=False)
        async with Server(chunks) as srv:
            up = Upstream(2.0, 5.0, max_answer_bytes=limit)
            resp = await up.post(srv.url, "/", b"", [])
            with pytest.raises(UpstreamError, match="larger than max_answer_bytes") as info:
                await resp.read()
            assert not isinstance(info.value, UpstreamBrokenError)
            resp.release()
            assert up._idle.get(srv.url, []) == []  # not read to its end: not kept
            resp = await Upstream(2.0, 5.0, max_answer_bytes=500).post(srv.url, "/", b"", [])
            assert await resp.read_chunk() == b"y" * 400  # a stream's chunk by chunk: each fits
            resp.release()
        async with Server(interim) as srv:
            with pytest.raises(UpstreamError, match="interim"):
                await Upstream(2.0, 5.0).post(srv.url, "/", b"", [])

    run(main())
