"""The proxy's upstream hop: HTTP/1.1 POSTs over kept-alive connections, and nothing more.

aiohttp's client builds a request object, header multidicts, a payload object, timers and
tracing hooks for every call: about 0.3 ms of CPU per request, as much as all of the
router's routing work for a new 2,000-token prompt. The proxy needs far less: write a
request line, the end-to-end headers and the bytes it received, then read a status line,
headers and a body framed by Content-Length or chunked encoding. That is this module; the
pool's health checks and the router's other calls keep using aiohttp.

A connection is kept per replica and reused once an answer has been read to its end and
the replica did not ask to close it. An answer left unread (a client that went away
mid-stream) closes its connection: that is how vLLM learns to stop generating. A kept
connection the replica closed while idle is replaced by a new one, once, before anything
counts as a failure of the replica.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from kvmesh.errors import ReplicaDownError, UpstreamBrokenError, UpstreamConnectError, UpstreamError

_HEAD_LIMIT = 64 << 10  # status line + headers; also the stream buffer's unit
_READ_SIZE = 64 << 10
_MAX_IDLE = 256  # kept connections per replica
_MAX_INTERIM = 8  # 1xx answers before the real one (100 Continue, 103 Early Hints)


@dataclass(frozen=True, slots=True)
class _Target:
    url: str
    host: str
    port: int
    ssl: ssl.SSLContext | None
    prefix: str  # the base URL's path, put before each request path
    host_header: str


class _Conn:
    __slots__ = ("heard", "idle_since", "reader", "why", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.idle_since = 0.0
        self.heard = 0.0  # when the request went, or the last byte of its answer came
        self.why: str | None = None  # why it was cut (Hold.cut)

    def close(self) -> None:
        self.writer.close()


class Hold:
    """One proxied request's hold on its connection, so that it can be cut from outside:
    :meth:`cut` closes it, and whatever waits on it (the answer's head, a stream's next chunk)
    raises :class:`ReplicaDownError` with the reason. For a replica that hangs with its
    connections open (the router's health checks took it out)."""

    __slots__ = ("conn", "why")

    def __init__(self) -> None:
        self.conn: _Conn | None = None
        self.why: str | None = None

    def cut(self, why: str, quiet_s: float) -> bool:
        """Cut the connection unless its replica spoke within ``quiet_s`` (a stream still
        flowing: a replica taken out by late health checks may only be busy, or the router
        itself may be). Whether it was cut."""
        conn = self.conn
        if conn is not None and time.monotonic() - conn.heard < quiet_s:
            return False
        self.why = self.why or why
        if conn is not None:
            conn.why = self.why
            conn.close()
        return True


class UpstreamResponse:
    """Status and headers of an answer; its body is read with :meth:`read` or :meth:`read_chunk`.

    Call :meth:`release` when done: it keeps the connection for the next request if the body
    was read to its end, and closes it otherwise.
    """

    __slots__ = ("_chunked", "_conn", "_done", "_keep", "_key", "_left", "_pool", "headers", "status")

    def __init__(
        self,
        pool: Upstream,
        key: str,
        conn: _Conn,
        status: int,
        headers: list[tuple[str, str]],
        length: int | None,
        chunked: bool,
        keep_alive: bool,
    ) -> None:
        self.status = status
        self.headers = headers  # (name, value) in the replica's order and spelling
        self._pool = pool
        self._key = key  # the replica's base URL: where the connection goes back to
        self._conn: _Conn | None = conn
        self._chunked = chunked
        self._left = length  # body bytes still to read; None: until the connection closes
        self._keep = keep_alive
        self._done = not chunked and length == 0

    @property
    def content_type(self) -> str:
        """The media type, lower case, without parameters (``""`` when there is none)."""
        for name, value in self.headers:
            if name.lower() == "content-type":
                return value.partition(";")[0].strip().lower()
        return ""

    async def read(self) -> bytes:
        """The whole body; the read timeout bounds the whole of it here, not each piece.

        Raises :class:`UpstreamError` for a body larger than the pool's ``max_answer_bytes``
        (before reading it when its Content-Length says so).
        """
        if self._done or self._conn is None:
            return b""
        limit = self._pool.max_answer_bytes
        if self._left is not None and self._left > limit:
            self._keep = False
            raise UpstreamError(f"the answer's {self._left} bytes are more than max_answer_bytes ({limit})")
        parts = []
        size = 0
        async with asyncio.timeout(self._pool.read_timeout_s):
            while chunk := await self._next():
                size += len(chunk)
                if size > limit:
                    self._keep = False
                    raise UpstreamError(f"the answer is larger than max_answer_bytes ({limit})")
                parts.append(chunk)
        return b"".join(parts)

    async def read_chunk(self) -> bytes:
        """The next piece of the body as it arrives (one chunk of a chunked answer); b"" at the end.

        Raises :class:`UpstreamError` if the answer breaks off, ``TimeoutError`` if the
        replica is silent for longer than the read timeout.
        """
        if self._done or self._conn is None:
            return b""
        async with asyncio.timeout(self._pool.read_timeout_s):
            return await self._next()

    async def _next(self) -> bytes:
        conn = self._conn
        if self._done or conn is None:
            return b""
        reader = conn.reader
        try:
            if self._chunked:
                size = int((await reader.readuntil(b"\r\n")).partition(b";")[0], 16)
                if size > (limit := self._pool.max_answer_bytes):
                    self._keep = False
                    raise UpstreamError(f"a chunk of {size} bytes is larger than max_answer_bytes ({limit})")
                if size == 0:
                    while await reader.readuntil(b"\r\n") != b"\r\n":
                        pass  # trailer fields: not passed on
                    self._done = True
                    return b""
                data = await reader.readexactly(size + 2)
                conn.heard = time.monotonic()
                if data[-2:] != b"\r\n":
                    raise ValueError("a chunk does not end with CRLF")
                return data[:-2]
            if self._left is None:
                data = await reader.read(_READ_SIZE)
                conn.heard = time.monotonic()
                self._done = not data
                return data
            data = await reader.read(min(self._left, _READ_SIZE))
            conn.heard = time.monotonic()
        except (asyncio.IncompleteReadError, OSError) as exc:
            self._keep = False
            if conn.why is not None:
                raise ReplicaDownError(conn.why) from None
            raise UpstreamBrokenError(f"the answer broke off: {exc!r}") from exc
        except (asyncio.LimitOverrunError, ValueError) as exc:
            self._keep = False
            raise UpstreamError(f"the answer's framing is malformed: {exc!r}") from exc
        if not data:
            self._keep = False
            if conn.why is not None:
                raise ReplicaDownError(conn.why)
            raise UpstreamBrokenError(
                f"the connection closed {self._left} bytes before the end of the answer"
            )
        self._left -= len(data)
        self._done = self._left == 0
        return data

    def release(self) -> None:
        """Keep the connection for another request if this answer was read to its end, else close it."""
        conn, self._conn = self._conn, None
        if conn is not None:
            if self._done and self._keep:
                self._pool._put(self._key, conn)
            else:
                conn.close()


class Upstream:
    """Kept-alive HTTP/1.1 connections to the replicas, for the proxied POSTs."""

    def __init__(
        self,
        connect_timeout_s: float,
        read_timeout_s: float | None,
        keepalive_s: float = 60.0,
        max_answer_bytes: int = 256 << 20,
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.max_answer_bytes = max_answer_bytes  # a whole answer's body, or one chunk of a stream
        self.keepalive_s = keepalive_s
        self._targets: dict[str, _Target] = {}
        self._idle: dict[str, list[_Conn]] = {}

    async def post(
        self,
        base_url: str,
        path: str,
        body: bytes,
        headers: Iterable[tuple[str, str]],
        hold: Hold | None = None,
    ) -> UpstreamResponse:
        """POST ``body`` to ``base_url + path`` with ``headers`` (Host and Content-Length are added).

        Returns once the status and headers have arrived. Raises
        :class:`UpstreamConnectError` when the replica could not be reached (or closed the
        connection before answering), ``TimeoutError`` when it did not answer within the read
        timeout, :class:`ReplicaDownError` when ``hold`` was cut, :class:`UpstreamError` for
        anything else.
        """
        target = self._targets.get(base_url) or self._target(base_url)
        lines = [f"POST {target.prefix}{path} HTTP/1.1\r\nHost: {target.host_header}\r\n"]
        for name, value in headers:
            if "\r" in value or "\n" in value or "\r" in name or "\n" in name or ":" in name:
                raise UpstreamError(f"header {name!r} cannot be sent")
            lines.append(f"{name}: {value}\r\n")
        lines.append(f"Content-Length: {len(body)}\r\n\r\n")
        request = "".join(lines).encode("utf-8", "surrogateescape") + body
        conn = self._take(base_url)
        while True:
            reused = conn is not None
            if conn is None:
                conn = await self._connect(target)
            if hold is not None:
                if hold.why is not None:  # cut while it connected
                    conn.close()
                    raise ReplicaDownError(hold.why)
                hold.conn = conn
            conn.writer.write(request)
            conn.heard = time.monotonic()
            try:
                return await self._response(base_url, conn)
            except _Unanswered as exc:
                conn.close()
                if conn.why is not None:
                    raise ReplicaDownError(conn.why) from None
                if reused:  # most likely closed by the replica while idle: once more, afresh
                    conn = None
                    continue
                raise UpstreamConnectError(f"{base_url} closed the connection without answering") from exc
            except UpstreamError:
                conn.close()
                if conn.why is not None:
                    raise ReplicaDownError(conn.why) from None
                raise
            except BaseException:
                conn.close()
                raise

    async def close(self) -> None:
        """Close the kept connections (answers in flight close theirs when released)."""
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()

    # -- internals ------------------------------------------------------------------------

    def _target(self, base_url: str) -> _Target:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UpstreamError(f"not an http(s) URL: {base_url!r}")
        secure = parts.scheme == "https"
        port = parts.port or (443 if secure else 80)
        context = ssl.create_default_context() if secure else None
        host_header = parts.netloc.rpartition("@")[2]
        target = _Target(base_url, parts.hostname, port, context, parts.path.rstrip("/"), host_header)
        self._targets[base_url] = target
        return target

    def _take(self, key: str) -> _Conn | None:
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if conn.reader.at_eof() or conn.writer.is_closing() or now - conn.idle_since > self.keepalive_s:
                conn.close()
                continue
            return conn
        return None

    def _put(self, key: str, conn: _Conn) -> None:
        idle = self._idle.setdefault(key, [])
        if len(idle) >= _MAX_IDLE or conn.writer.is_closing():
            conn.close()
            return
        conn.idle_since = time.monotonic()
        idle.append(conn)

    async def _connect(self, target: _Target) -> _Conn:
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                reader, writer = await asyncio.open_connection(
                    target.host, target.port, ssl=target.ssl, limit=_HEAD_LIMIT
                )
        except (OSError, TimeoutError) as exc:
            raise UpstreamConnectError(f"cannot connect to {target.url}: {exc!r}") from exc
        return _Conn(reader, writer)

    async def _response(self, key: str, conn: _Conn) -> UpstreamResponse:
        reader = conn.reader
        first = True
        for _ in range(_MAX_INTERIM + 1):
            try:
                async with asyncio.timeout(self.read_timeout_s):
                    head = await reader.readuntil(b"\r\n\r\n")
            except TimeoutError:
                raise  # an OSError too, but not a broken connection: the replica is slow
            except asyncio.IncompleteReadError as exc:
                if first and not exc.partial:
                    raise _Unanswered from exc
                raise UpstreamBrokenError(f"the answer's head broke off: {exc!r}") from exc
            except (ConnectionResetError, BrokenPipeError) as exc:
                if first:
                    raise _Unanswered from exc
                raise UpstreamBrokenError(f"the connection broke: {exc!r}") from exc
            except (asyncio.LimitOverrunError, ValueError) as exc:
                raise UpstreamError(f"the answer's head is larger than {_HEAD_LIMIT} bytes") from exc
            except OSError as exc:
                raise UpstreamBrokenError(f"the connection broke: {exc!r}") from exc
            first = False
            conn.heard = time.monotonic()
            status, version, headers = _parse_head(head)
            if 100 <= status < 200 and status != 101:
                continue  # an interim answer (100 Continue, 103 Early Hints): the real one follows
            return _framed(self, key, conn, status, version, headers)
        raise UpstreamError(f"more than {_MAX_INTERIM} interim (1xx) answers")


class _Unanswered(Exception):
    """The connection ended before the first byte of an answer."""


def _parse_head(head: bytes) -> tuple[int, bytes, list[tuple[str, str]]]:
    lines = head[:-4].split(b"\r\n")
    version, _, rest = lines[0].partition(b" ")
    code = rest[:3]
    if not version.startswith(b"HTTP/1.") or len(code) != 3 or not code.isdigit():
        raise UpstreamError(f"not an HTTP/1.x status line: {lines[0][:100]!r}")
    headers: list[tuple[str, str]] = []
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not name or name != name.strip():
            raise UpstreamError(f"malformed header line: {line[:100]!r}")
        headers.append(
            (name.decode("ascii", "surrogateescape"), value.strip().decode("utf-8", "surrogateescape"))
        )
    return int(code), version, headers


def _framed(
    pool: Upstream, key: str, conn: _Conn, status: int, version: bytes, headers: list[tuple[str, str]]
) -> UpstreamResponse:
    """How the body is delimited (RFC 9112 §6.3) and whether the connection may be kept."""
    length: int | None = None
    chunked = False
    keep = version == b"HTTP/1.1"
    for name, value in headers:
        low = name.lower()
        if low == "transfer-encoding":
            chunked = value.rpartition(",")[2].strip().lower() == "chunked"
            if not chunked:
                keep = False  # another coding last: the body runs to the end of the connection
        elif low == "content-length":
            try:
                length = int(value)
            except ValueError:
                raise UpstreamError(f"bad Content-Length {value!r}") from None
            if length < 0:
                raise UpstreamError(f"bad Content-Length {value!r}")
        elif low == "connection":
            tokens = {t.strip().lower() for t in value.split(",")}
            keep = "close" not in tokens and (keep or "keep-alive" in tokens)
    if status in (204, 304) or status < 200:
        length, chunked = 0, False
    elif chunked:
        length = None
    elif length is None:
        keep = False
    return UpstreamResponse(pool, key, conn, status, headers, length, chunked, keep)
