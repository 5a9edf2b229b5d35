"""The Redis tier's client and its hash layout (see :mod:`kvmesh.tiers.redis`).

:func:`make_client` builds a redis-py client whose connections cap every socket wait
(connect, send, each read of a reply) at the current operation's time left
(:func:`kvmesh.tiers.deadline.time_left`): a black-holed server costs one budget, not a
socket timeout per reply of a pipeline, and a server that drips a reply a few bytes at a
time costs one budget too (redis-py sets a reply's timeout once, and a drip never lets one
read run into it). One reply is at most ``max_reply_bytes`` on the wire: a hostile server's
endless string or array is cut there, not held in memory until the worker is killed.
Replies are parsed by hiredis, as redis-py does; kvmesh only meters the socket under it.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar
from urllib.parse import parse_qsl, unquote, urlsplit, urlunsplit

import numpy as np
import redis
from redis._parsers import _HiredisParser
from redis.backoff import NoBackoff
from redis.connection import URL_QUERY_ARGUMENT_PARSERS, Connection, SSLConnection, UnixDomainSocketConnection
from redis.maint_notifications import MaintNotificationsConfig
from redis.retry import Retry
from redis.sentinel import Sentinel, SentinelManagedConnection, SentinelManagedSSLConnection

from kvmesh.config_lmcache import redact_url
from kvmesh.core.keys import ChunkKey
from kvmesh.core.serde import Buffer, ChunkFormat
from kvmesh.errors import ConfigError, CorruptChunkError
from kvmesh.tiers.base import Into, StoredChunk, payload_buffer, url_flag
from kvmesh.tiers.deadline import time_left

T = TypeVar("T")
HEADER = b"h"
NPARTS = b"n"
_FLOOR_S = 0.001  # socket timeouts must be positive; a spent budget still waits this long
# One reply's bytes on the wire where the chunk layout is not known (a tier opened on its own;
# the engine's tiers bound it by the largest chunk of their layout: RedisTier.max_reply_bytes).
DEFAULT_MAX_REPLY_BYTES = 1 << 30
# One socket read: a chunk's part (part_bytes, 1 MiB by default) in one recv, not sixteen of
# redis-py's 64 KiB. ``kvmesh bench tiers --quick --tiers redis`` (llama-8b layout, 3 runs
# interleaved, twice, 7 December 2026): retrieve 0.388 -> 0.348 s and 0.446 -> 0.380 s
# (ratio to a raw RESP pipeline 0.54 -> 0.59 and 0.55 -> 0.66); stores unchanged.
READ_BYTES = 1 << 20


class ReplyTooLargeError(redis.ConnectionError):
    """A reply ran past ``max_reply_bytes``: the connection is dropped, its reads are misses."""


class _MeteredSocket:
    """The socket under a connection's reply parser: each read waits at most the operation's
    time left, and the bytes read since :meth:`reply` are at most ``limit``. Everything else
    is the socket's (``fileno`` for ``poll``, ``pending`` of a TLS socket, ``settimeout``)."""

    def __init__(self, sock: socket.socket, limit: int) -> None:
        self._sock, self.limit, self.got = sock, limit, 0

    def reply(self) -> None:
        self.got = 0

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:
        left = time_left()
        if left is not None:
            if left <= 0:
                raise TimeoutError("the operation's budget ran out in the middle of a reply")
            timeout = self._sock.gettimeout()
            self._sock.settimeout(left if timeout is None else min(timeout, left))
        n = self._sock.recv_into(buffer, nbytes, flags)
        self.got += n
        if self.got > self.limit:
            raise ReplyTooLargeError(f"a reply ran past {self.limit} bytes (max_reply_bytes)")
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


class BoundedParser(_HiredisParser):
    """redis-py's hiredis parser reading through a :class:`_MeteredSocket`."""

    def on_connect(self, connection: Any, **kwargs: Any) -> None:
        super().on_connect(connection, **kwargs)  # type: ignore[no-untyped-call]
        limit = getattr(connection, "max_reply_bytes", DEFAULT_MAX_REPLY_BYTES)
        self._sock = _MeteredSocket(self._sock, limit)

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        sock = self._sock
        if isinstance(sock, _MeteredSocket):
            sock.reply()
        return super().read_response(*args, **kwargs)


class _DeadlineMixin:
    """Caps the socket's timeout at the time left before every send and every read of a
    reply, and bounds a reply's size (:class:`BoundedParser`)."""

    socket_timeout: float | None
    socket_connect_timeout: float | None
    _sock: socket.socket | None

    def __init__(self, *args: Any, max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES, **kwargs: Any) -> None:
        self.max_reply_bytes = max_reply_bytes
        kwargs["parser_class"] = BoundedParser
        super().__init__(*args, **kwargs)

    def _capped(self, limit: float | None) -> float | None:
        left = time_left()
        if left is None:
            return limit
        left = max(_FLOOR_S, left)
        return left if limit is None else min(limit, left)

    def _cap_socket(self) -> None:
        if self._sock is not None:
            self._sock.settimeout(self._capped(self.socket_timeout))

    def connect_check_health(self, *args: Any, **kwargs: Any) -> None:
        # Every way of connecting (the pool's connect(), a send on a closed connection)
        # passes here; the handshake it sends goes through the capped methods below.
        full = self.socket_connect_timeout
        self.socket_connect_timeout = self._capped(full)
        try:
            super().connect_check_health(*args, **kwargs)  # type: ignore[misc]
        finally:
            self.socket_connect_timeout = full

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        if self._sock is None:
            self.connect_check_health(check_health=False)
        self._cap_socket()
        super().send_packed_command(command, check_health)  # type: ignore[misc]

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        self._cap_socket()
        return super().read_response(*args, **kwargs)  # type: ignore[misc]


class DeadlineConnection(_DeadlineMixin, Connection):
    pass


class DeadlineSSLConnection(_DeadlineMixin, SSLConnection):
    pass


class DeadlineUnixConnection(_DeadlineMixin, UnixDomainSocketConnection):
    pass


class DeadlineSentinelConnection(_DeadlineMixin, SentinelManagedConnection):
    pass


class DeadlineSentinelSSLConnection(_DeadlineMixin, SentinelManagedSSLConnection):
    pass


_DEADLINE_CLASSES: dict[type[Any], type[Any]] = {
    Connection: DeadlineConnection,
    SSLConnection: DeadlineSSLConnection,
    UnixDomainSocketConnection: DeadlineUnixConnection,
    SentinelManagedConnection: DeadlineSentinelConnection,
    SentinelManagedSSLConnection: DeadlineSentinelSSLConnection,
}
# redis-py's TLS options a redis-sentinel:// or redis-cluster:// URL passes on to its
# connections (a rediss:// URL's query hands them to redis-py itself).
TLS_OPTIONS = (
    "ssl_ca_certs",
    "ssl_ca_path",
    "ssl_cert_reqs",
    "ssl_certfile",
    "ssl_keyfile",
    "ssl_check_hostname",
)
# LMCache's Sentinel connector takes the master's name from REDIS_SERVICE_NAME, else this.
SENTINEL_SERVICE_ENV = "REDIS_SERVICE_NAME"
SENTINEL_DEFAULT_SERVICE = "redismaster"
SENTINEL_TIMEOUT_S = 1.0  # per sentinel query (LMCache's REDIS_TIMEOUT default)
# One sentinel answer (SENTINEL MASTERS: ~40 fields per master) on the wire.
SENTINEL_REPLY_BYTES = 1 << 20
_MALFORMED = (KeyError, IndexError, TypeError, ValueError, AttributeError)


class _SentinelNode(redis.Redis):  # type: ignore[type-arg]
    """One sentinel's client: an answer redis-py's parsers cannot take (a hostile or broken
    sentinel's) is that sentinel's :class:`redis.ResponseError`, which master discovery passes
    over for the next sentinel, not a KeyError or TypeError out of a chunk read."""

    def parse_response(self, connection: Any, command_name: Any, **options: Any) -> Any:
        try:
            return super().parse_response(connection, command_name, **options)
        except _MALFORMED as exc:
            raise redis.ResponseError(f"malformed {command_name} answer ({exc!r})") from None


class _BoundedSentinel(Sentinel):
    """redis-py's :class:`~redis.sentinel.Sentinel` whose sentinel clients are bounded as the
    master's are (each read waits at most the operation's time left, an answer is at most
    :data:`SENTINEL_REPLY_BYTES`), and which takes a master's state only with an address it
    can connect to."""

    def __init__(self, nodes: list[tuple[str, int]], sentinel_kwargs: dict[str, Any]) -> None:
        super().__init__([], sentinel_kwargs=sentinel_kwargs)  # its clients are built here
        self.sentinels = [_SentinelNode(host, port, **self.sentinel_kwargs) for host, port in nodes]
        for node in self.sentinels:
            bound_pool(node.connection_pool, SENTINEL_REPLY_BYTES, f"sentinel {node}")

    def check_master_state(self, state: Any, service_name: str) -> bool:
        ip, port = state.get("ip"), state.get("port")
        if not isinstance(ip, str) or not ip or not isinstance(port, int) or not 0 < port < 65536:
            return False
        try:  # redis-py calls this outside its error handling: a missing field must not escape
            return bool(super().check_master_state(state, service_name))
        except _MALFORMED:
            return False


# What redis-py 8 sends on each new connection after HELLO/AUTH, each command read before the
# next: two CLIENT SETINFO (its name and version, for the server's CLIENT LIST) and, over
# RESP3, CLIENT MAINT_NOTIFICATIONS (cluster maintenance events, for managed clouds). Three
# round trips more before the first command of every new connection: against a Redis 200 ms
# away a load's first read took 1.0 s instead of 0.4 s, and taught the cost model a slow tier.
QUIET_HANDSHAKE: dict[str, Any] = {
    "driver_info": None,
    "maint_notifications_config": MaintNotificationsConfig(enabled=False),
}


def make_client(
    url: str, timeout_s: float, max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES
) -> redis.Redis[bytes]:
    parts = urlsplit(url)
    if parts.scheme == "valkey":  # same protocol; redis-py knows only redis/rediss/unix
        url = urlunsplit(parts._replace(scheme="redis"))
    # redis-py's own retries are off: the guard retries whole batches within one budget and
    # counts every failed attempt towards the breaker, which hidden retries would blur.
    try:
        if parts.scheme == "redis-sentinel":
            client = sentinel_client(url, timeout_s)
        else:
            client = redis.Redis.from_url(
                url,
                socket_timeout=timeout_s,
                socket_connect_timeout=timeout_s,
                retry=Retry(NoBackoff(), 0),
                **QUIET_HANDSHAKE,
            )
    except ValueError as exc:
        raise ConfigError(
            f"invalid Redis URL {redact_url(url)!r} ({exc}); write redis://[user:pass@]host:port/db, "
            "rediss://..., valkey://host:port/db, unix:///path/to.sock or "
            "redis-sentinel://[user:pass@]host:port,host:port[/db]?service_name=NAME"
        ) from None
    bound_pool(client.connection_pool, max_reply_bytes, f"Redis URL {redact_url(url)!r}")
    return client


def bound_pool(pool: Any, max_reply_bytes: int, what: str) -> None:
    """Keeps the transport ``pool``'s URL chose (TCP, TLS, unix socket) and adds the deadline
    cap and the reply bound."""
    if pool.connection_class not in _DEADLINE_CLASSES:
        raise ConfigError(f"{what}: no bounded connection for {pool.connection_class}")
    pool.connection_class = _DEADLINE_CLASSES[pool.connection_class]
    pool.connection_kwargs["max_reply_bytes"] = max_reply_bytes
    pool.connection_kwargs["socket_read_size"] = min(READ_BYTES, max_reply_bytes)


def refuse_fragment(url: str) -> None:
    """A raw ``#`` (in a password) makes the rest of the URL a fragment: its query, ``ssl=true``
    with it, would vanish and the password go out over plain TCP. Refused: quote it (%23)."""
    if urlsplit(url).fragment or url.endswith("#"):
        raise ValueError("a raw '#' cuts the URL short (its query with it); write it as %23")


def sentinel_client(url: str, timeout_s: float) -> redis.Redis[bytes]:
    """The master of ``redis-sentinel://[user:pass@]h:p,h:p[/db][?service_name=NAME]
    [&sentinel_password=P][&ssl=true][&sentinel_ssl=true][&ssl_ca_certs=PATH]`` through
    redis-py's :class:`~redis.sentinel.Sentinel`: every connection asks the sentinels for the
    current master, so a failover is followed. ``ssl``: TLS to the master; ``sentinel_ssl``:
    to the sentinels; redis-py's ``ssl_*`` options (:data:`TLS_OPTIONS`) go to both.
    User and password are the master's (as in LMCache); the master's name defaults to
    ``$REDIS_SERVICE_NAME``, then ``redismaster`` (LMCache's defaults)."""
    refuse_fragment(url)
    rest = url.split("://", 1)[1]
    query = dict(parse_qsl(urlsplit(url).query))
    rest = rest.split("?", 1)[0]
    hosts, _, db_text = rest.partition("/")
    auth: dict[str, str] = {}
    if "@" in hosts:
        cred, hosts = hosts.rsplit("@", 1)
        user, _, password = cred.partition(":")
        if user:
            auth["username"] = unquote(user)
        if password:
            auth["password"] = unquote(password)
    nodes: list[tuple[str, int]] = []
    for part in hosts.split(","):
        p = urlsplit("//" + part.strip())
        if not p.hostname or not p.port:
            raise ValueError(f"sentinel {part!r} is not host:port")
        nodes.append((p.hostname, p.port))
    service = query.pop("service_name", None) or os.environ.get(SENTINEL_SERVICE_ENV)
    service = service or SENTINEL_DEFAULT_SERVICE
    ssl, sentinel_ssl = url_flag(query, "ssl"), url_flag(query, "sentinel_ssl")
    sentinel_password = query.pop("sentinel_password", None)
    # Typed as redis-py types them in a rediss:// URL (ssl_check_hostname=false is False).
    tls = {k: URL_QUERY_ARGUMENT_PARSERS.get(k, str)(query.pop(k)) for k in TLS_OPTIONS if k in query}
    if query:
        raise ValueError(f"unknown parameter(s) {', '.join(sorted(query))}")
    if tls and not (ssl or sentinel_ssl):
        raise ValueError(f"{', '.join(sorted(tls))} needs ssl=true (the master) or sentinel_ssl=true")
    probe_s = min(timeout_s, SENTINEL_TIMEOUT_S)
    sentinel_kwargs: dict[str, Any] = {"socket_timeout": probe_s, "socket_connect_timeout": probe_s}
    if sentinel_password:
        sentinel_kwargs["password"] = sentinel_password
    if sentinel_ssl:  # the sentinels themselves over TLS (tls-port on each), with the same options
        sentinel_kwargs.update({"ssl": True, **tls})
    sentinel = _BoundedSentinel(nodes, sentinel_kwargs)
    return sentinel.master_for(
        service,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
        db=int(db_text or 0),
        **QUIET_HANDSHAKE,
        ssl=ssl,
        **(tls if ssl else {}),
        **auth,
    )


def each_hash(
    client: redis.Redis[bytes], names: Sequence[str], take: Callable[[int, dict[bytes, bytes] | Exception], T]
) -> list[T]:
    """``HGETALL`` of every name in one round trip, like a pipeline, but each reply is handed
    to ``take(i, fields)`` (``fields``: the hash, empty when absent; or an exception: the
    server's error reply, e.g. WRONGTYPE, or a ``DataError`` for a reply that is not a hash
    of strings) as soon as it is parsed, and dropped before the next is read.

    A pipeline keeps every reply until the last has arrived: a batch of sixteen 16 MiB chunks
    held 256 MiB of parts beside the slots they were copied into, and a long prompt's load
    from the shared tier as many bytes again as its KV. Here one chunk's parts are held at a
    time. Throughput: the same as the pipeline's in ``kvmesh bench tiers`` (retrieve / raw
    RESP 0.56-0.58 against 0.55-0.60, interleaved); 1.3-1.4x in a loop of reads alone, where
    the pipeline's freed 256 MiB went back to the kernel and was faulted in again by every
    batch. The parsing is redis-py's (hiredis), as before. An exception out of ``take`` or
    the socket leaves replies unread: that connection is closed, never pooled as it is."""
    pool = client.connection_pool
    conn = pool.get_connection()
    try:
        conn.send_packed_command(conn.pack_commands([("HGETALL", n) for n in names]))
        out: list[T] = []
        for i in range(len(names)):
            reply: Any
            try:
                reply = conn.read_response()
            except redis.ResponseError as exc:  # an error reply, read whole: the stream is in step
                out.append(take(i, exc))
                continue
            out.append(take(i, _hash_of(reply)))
            del reply
        return out
    except BaseException:
        conn.disconnect()
        raise
    finally:
        pool.release(conn)


def _hash_of(reply: Any) -> dict[bytes, bytes] | redis.DataError:
    """An ``HGETALL`` reply as a hash of strings (RESP3 sends a map, RESP2 a flat array of
    field, value, ...), or why it is none: only a hostile or broken server sends another
    shape, and each is that key's miss, never an exception out of the read."""
    if isinstance(reply, list) and len(reply) % 2 == 0:
        fields = reply[::2]
        if all(type(f) is bytes for f in fields):
            reply = dict(zip(fields, reply[1::2], strict=True))
    if isinstance(reply, dict) and all(type(k) is bytes and type(v) is bytes for k, v in reply.items()):
        return reply
    return redis.DataError(f"HGETALL answered {type(reply).__name__}, not a hash of strings")


def fields(head: bytes, body: Buffer, part_bytes: int) -> dict[bytes, Buffer]:
    """The hash fields of one chunk: header, part count, parts. memoryview slices: redis-py
    writes them to the socket as they are, no copy."""
    mv = memoryview(body).cast("B")
    n = (mv.nbytes + part_bytes - 1) // part_bytes
    out: dict[bytes, Buffer] = {HEADER: head, NPARTS: str(n).encode()}
    for i in range(n):
        out[str(i).encode()] = mv[i * part_bytes : (i + 1) * part_bytes]
    return out


def decode(
    key: ChunkKey, hash_fields: dict[bytes, bytes], fmt: ChunkFormat, into: Into | None = None
) -> StoredChunk:
    head = hash_fields.get(HEADER)
    if head is None:
        raise CorruptChunkError("chunk hash has no header field")
    header = fmt.decode_header(head, expected_key=key)
    if len(head) != header.header_size:
        raise CorruptChunkError(f"header field is {len(head)} bytes, its header {header.header_size}")
    try:
        n = int(hash_fields.get(NPARTS, b""))
    except ValueError:
        raise CorruptChunkError("chunk hash has no valid part count") from None
    if not 0 <= n <= len(hash_fields):
        raise CorruptChunkError(f"chunk hash claims {n} parts and has {len(hash_fields)} fields")
    parts = [hash_fields.get(str(i).encode()) for i in range(n)]
    if any(p is None for p in parts):
        raise CorruptChunkError(f"chunk is missing parts (has {sum(p is not None for p in parts)} of {n})")
    sizes = sum(len(p) for p in parts if p is not None)
    if sizes != header.payload_len:
        raise CorruptChunkError(f"chunk parts hold {sizes} bytes, header says {header.payload_len}")
    body: Buffer
    if n == 1 and parts[0] is not None and into is None:
        body = parts[0]  # no assembly copy for a value that fits one part
    else:
        # One copy of every part into the caller's buffer (or one of ours); numpy copies at
        # memcpy speed where memoryview slice assignment runs ~6x slower here.
        body = payload_buffer(into, header)
        out = np.frombuffer(body, dtype=np.uint8)
        pos = 0
        for p in parts:
            if p is not None:
                out[pos : pos + len(p)] = np.frombuffer(p, dtype=np.uint8)
                pos += len(p)
    raw = fmt.decode_payload(header, body, into)
    return StoredChunk(header, raw, len(head) + header.payload_len)


def groups(sizes: Sequence[int], limit: int) -> Iterator[tuple[int, int]]:
    """``(start, end)`` runs of consecutive items whose sizes sum to at most ``limit``
    (an item larger than ``limit`` forms a run of its own)."""
    start, total = 0, 0
    for i, size in enumerate(sizes):
        if i > start and total + size > limit:
            yield start, i
            start, total = i, 0
        total += size
    if start < len(sizes):
        yield start, len(sizes)
