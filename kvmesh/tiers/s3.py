"""S3 tier: ``s3://bucket/prefix`` (any S3-compatible server).

URL forms: ``s3://bucket/prefix`` and LMCache's virtual-host form
``s3://bucket.s3.<region>.amazonaws.com/prefix``. Query parameters (LMCache's
``extra_config`` S3 keys are mapped onto these by the config): ``endpoint_url``,
``region``, ``access_key_id``, ``secret_access_key``, ``max_concurrency`` (parallel
requests, default 16), ``range_bytes`` (size of one ranged GET, default 8 MiB),
``multipart_bytes`` (objects larger than this are uploaded in parts, default 64 MiB),
``disable_tls``, ``ca_bundle`` (a PEM file of the CA that signed the endpoint's
certificate: an S3-compatible store with a private CA; boto3's ``AWS_CA_BUNDLE`` does the
same for the whole process). Otherwise botocore's usual sources apply: ``AWS_ENDPOINT_URL``,
``AWS_REGION``, ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``, ``~/.aws``.

Layout: one object per chunk, ``<prefix>/<chunk key>``, holding the serialized chunk
(header then payload). A read GETs the first ``range_bytes`` (which holds the header and,
for most chunks, the whole payload); a larger object's remaining ranges are fetched in
parallel straight into the destination buffer. Every read is verified (header tag and key,
sizes bounded before the rest is fetched, payload tag); a corrupt object is deleted and
counted, a missing one is a miss.

Failures: connection errors, timeouts and 5xx/throttling answers are retried with
jittered exponential backoff; after ``failure_threshold`` consecutive failures a breaker
marks the tier down (misses and ``False`` at once, no network) until a background
``HeadBucket`` succeeds. Nothing botocore raises leaves a method.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import re
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor, wait
from functools import partial
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlsplit

import numpy as np
from botocore.exceptions import BotoCoreError, ClientError, ConnectTimeoutError, ReadTimeoutError
from urllib3.exceptions import HTTPError as URLLib3Error
from urllib3.exceptions import ReadTimeoutError as URLLib3ReadTimeout

from kvmesh.config_lmcache import redact_url
from kvmesh.core import serde
from kvmesh.core.keys import ChunkKey
from kvmesh.core.serde import Buffer
from kvmesh.errors import ConfigError, CorruptChunkError, TierError
from kvmesh.tiers.base import (
    ChunkData,
    Feature,
    Into,
    StoredChunk,
    TierOptions,
    count_rejected,
    counted_read,
    payload_buffer,
    register_tier,
    url_flag,
)
from kvmesh.tiers.breaker import RemoteGuard
from kvmesh.tiers.deadline import deadline, time_left

log = logging.getLogger(__name__)
T = TypeVar("T")
# bucket.s3.region.amazonaws.com, bucket.s3-region..., bucket.s3express-AZ.region... (S3 Express)
_VHOST = re.compile(
    r"^(?P<bucket>[^.]+)\.s3(?:express-[a-z0-9-]+)?[.-](?:(?P<region>[a-z0-9-]+)\.)?amazonaws\.com$"
)
_MISSING = {"404", "NoSuchKey", "NotFound"}
_MIN_PART = 5 << 20  # S3's smallest multipart part (all but the last)
_CHUNK_NAME = re.compile(r"kvm[0-9]-")
_READ_PIECE = 1 << 20  # one socket read of a body, at most
_LATE_S = 0.05  # how long past the budget a call waits for its requests before it leaves them


class S3Tier:
    """A remote tier on an S3 bucket; see the module docstring."""

    features = Feature.NONE  # a shared store: no pins; objects are rewritten whole by put

    def __init__(self, url: str, options: TierOptions, failure_threshold: int = 3) -> None:
        import boto3
        from botocore.config import Config

        self.name = options.name or "s3"
        self.metrics = options.metrics
        self.codec = serde.get_codec(options.codec).name
        self.chunk_format = options.chunk_format
        self.url = redact_url(url)
        q = _parse(url)
        self.bucket, self.prefix = q.pop("bucket"), q.pop("prefix")
        self.range_bytes = max(64 << 10, self._whole(q, "range_bytes", 8 << 20))
        self.multipart_bytes = max(_MIN_PART, self._whole(q, "multipart_bytes", 64 << 20))
        workers = max(1, self._whole(q, "max_concurrency", 16))
        session = boto3.session.Session(
            aws_access_key_id=q.pop("access_key_id", None),
            aws_secret_access_key=q.pop("secret_access_key", None),
            region_name=q.pop("region", None),
        )
        try:
            no_tls = url_flag(q, "disable_tls")  # a misspelt value is refused, not read as false
        except ValueError as exc:
            raise ConfigError(f"s3 URL {self.url!r}: {exc}") from None
        endpoint = q.pop("endpoint_url", None)
        ca_bundle = q.pop("ca_bundle", None)
        if q:
            raise ConfigError(f"s3 URL {self.url!r}: unknown parameter(s) {', '.join(sorted(q))}")
        if ca_bundle is not None and (no_tls or (endpoint or "").startswith("http://")):
            raise ConfigError(f"s3 URL {self.url!r}: ca_bundle verifies TLS, but the endpoint is plain http")
        if ca_bundle is not None and not os.path.isfile(ca_bundle):
            raise ConfigError(f"s3 URL {self.url!r}: ca_bundle {ca_bundle!r} is not a file")
        verify: str | None = ca_bundle  # None: botocore's default (its bundle, AWS_CA_BUNDLE)
        # botocore's retries are off: the tier retries whole operations and counts every
        # failed attempt towards its breaker, which hidden retries would blur.
        cfg = Config(
            connect_timeout=options.timeout_s,
            read_timeout=options.timeout_s,
            retries={"max_attempts": 1, "mode": "standard"},
            max_pool_connections=workers + 2,
        )
        self._client = session.client(
            "s3", endpoint_url=endpoint, use_ssl=not no_tls, verify=verify, config=cfg
        )
        probe_cfg = cfg.merge(Config(connect_timeout=1.0, read_timeout=1.0))
        self._probe_client = session.client(
            "s3", endpoint_url=endpoint, use_ssl=not no_tls, verify=verify, config=probe_cfg
        )
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix=f"kvmesh-{self.name}")
        # The breaker and deadline every remote tier shares (kvmesh.tiers.breaker): a timeout
        # opens it at once, 5xx/throttling/connection errors after failure_threshold tries,
        # an answered 4xx never; remote_timeout_s bounds a whole operation, retries included.
        self.guard = RemoteGuard(
            self.name,
            self.url,
            self.metrics,
            ping=self._ping,
            timeout_s=options.timeout_s,
            retries=options.retries,
            failure_threshold=failure_threshold,
            probe_interval_s=options.probe_interval_s,
            timeout_errors=(ReadTimeoutError, ConnectTimeoutError, TimeoutError),
            conn_errors=(_Retryable, BotoCoreError, OSError),
            server_errors=(_Answered,),
        )
        self.guard.start()

    def _whole(self, q: dict[str, str], name: str, default: int) -> int:
        raw = q.pop(name, None)
        if raw is None:
            return default
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"s3 URL {self.url!r}: {name}={raw!r} is not a whole number") from None

    def _object(self, key: ChunkKey | str) -> str:
        text = key.text if isinstance(key, ChunkKey) else key
        return f"{self.prefix}{text}"

    # ---- the Tier protocol ------------------------------------------------------------
    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        def one(k: ChunkKey) -> bool:
            return (
                self._guard(lambda: self._client.head_object(Bucket=self.bucket, Key=self._object(k)))
                is not None
            )

        return self._map(one, keys, False)

    def get(self, keys: Sequence[ChunkKey], into: Into | None = None) -> list[ChunkData | None]:
        with deadline(self.guard.timeout_s):  # one budget for the whole read, every range in it
            items = self._map(lambda k: self._read(k, into), keys, None)
        return [counted_read(self.metrics, k, item) for k, item in zip(keys, items, strict=True)]

    def put(self, keys: Sequence[ChunkKey], chunks: Sequence[ChunkData]) -> list[bool]:
        if len(keys) != len(chunks):
            raise ValueError(f"put got {len(keys)} keys but {len(chunks)} chunks; pass one chunk per key")
        if not self.guard.up:
            self.metrics.skip("tier_down", len(keys))
            return [False] * len(keys)

        def one(pair: tuple[ChunkKey, ChunkData]) -> bool:
            k, c = pair
            head, body = self.chunk_format.encode(k, c.layout, c.tokens, c.data, self.codec)
            ok = self._write(self._object(k), head, body)
            if ok:
                self.metrics.inc("stores")
            else:
                self.metrics.skip("tier_error")
            if ok:
                self.metrics.inc("bytes_in", len(head) + memoryview(body).nbytes)
            return ok

        return self._map(one, list(zip(keys, chunks, strict=True)), False)

    def delete(self, keys: Sequence[ChunkKey]) -> int:
        n = self._delete_objects([self._object(k) for k in keys], existing_only=True)
        self.metrics.inc("deletes", n)
        return n

    def clear(self) -> int:
        """Delete every kvmesh chunk under the prefix; other objects are left alone."""
        n = self._delete_objects(list(self._list()), existing_only=False)
        self.metrics.inc("deletes", n)
        return n

    def keys(self) -> Iterator[str]:
        for name in self._list():
            yield name[len(self.prefix) :]

    def health(self) -> str:
        return self.guard.health()

    def close(self) -> None:
        if self.guard.closed:
            return
        self.guard.close()
        self._pool.shutdown(wait=True, cancel_futures=True)
        for client in (self._client, self._probe_client):
            with contextlib.suppress(Exception):
                client.close()

    # ---- reads and writes -------------------------------------------------------------
    def _map(self, fn: Callable[[Any], T], items: Sequence[Any], down: T) -> list[T]:
        if not items:
            return []
        if not self.guard.up:
            return [down] * len(items)
        return _within(self._pool, fn, items, down, self.guard)

    def _get_range(self, name: str, start: int, end: int) -> tuple[bytearray, int] | None:
        """Bytes ``[start, end]`` of object ``name`` and its total size; None if absent."""
        reply = self._guard(
            lambda: self._client.get_object(Bucket=self.bucket, Key=name, Range=f"bytes={start}-{end}")
        )
        if reply is None:
            return None
        total = int(str(reply.get("ContentRange", "")).rsplit("/", 1)[-1] or reply["ContentLength"])
        data: bytearray | None = self._guard(
            partial(_read_body, reply["Body"], int(reply["ContentLength"]), end - start + 1)
        )
        # a body cut off by a failing server is a miss, not a corrupt object to delete
        return None if data is None else (data, total)

    def _read(self, key: ChunkKey, into: Into | None) -> StoredChunk | None:
        name = self._object(key)
        first = self._get_range(name, 0, self.range_bytes - 1)
        if first is None:
            return None
        data, total = first
        fmt = self.chunk_format
        try:
            header = fmt.decode_header(data, expected_key=key)
            hsize = header.header_size
            # payload_len is bounded by the chunk's layout and tokens: only then is the rest
            # of an object of that size fetched.
            if hsize + header.payload_len != total:
                raise CorruptChunkError(f"object is {total} bytes, header says {hsize + header.payload_len}")
            body = payload_buffer(into, header)
            out = np.frombuffer(body, dtype=np.uint8)
            have = data[hsize:]
            out[: len(have)] = np.frombuffer(have, dtype=np.uint8)
            if not self._fetch_rest(name, out, len(data), hsize, total):
                return None
            raw = fmt.decode_payload(header, body, into)
        except CorruptChunkError as exc:
            if count_rejected(self.metrics, exc):
                log.warning("kvmesh tier %s: dropping bad chunk %s: %s", self.name, key.text, exc)
                self._guard(lambda: self._client.delete_object(Bucket=self.bucket, Key=name))
            return None
        return StoredChunk(header, raw, total)

    def _fetch_rest(self, name: str, out: np.ndarray, pos: int, hsize: int, total: int) -> bool:
        """Fetch bytes ``[pos, total)`` in parallel ranged GETs into ``out`` (payload-relative)."""
        ranges = [(s, min(s + self.range_bytes, total) - 1) for s in range(pos, total, self.range_bytes)]
        if not ranges:
            return True

        def fetch(r: tuple[int, int]) -> bool:
            got = self._get_range(name, r[0], r[1])
            if got is None or len(got[0]) != r[1] - r[0] + 1:
                return False
            out[r[0] - hsize : r[1] + 1 - hsize] = np.frombuffer(got[0], dtype=np.uint8)
            return True

        # Threads of their own, not the tier's pool: a pool worker waiting on work queued
        # behind it in the same pool could deadlock a busy tier. Not waited for past the
        # budget: a range still coming then is left to end by itself.
        ex = ThreadPoolExecutor(min(8, len(ranges)))
        try:
            return all(_within(ex, fetch, ranges, False, self.guard))
        finally:
            ex.shutdown(wait=False)

    def _write(self, name: str, head: bytes, body: Buffer) -> bool:
        size = len(head) + memoryview(body).nbytes
        if size <= self.multipart_bytes:
            blob = head + bytes(body)
            return (
                self._guard(lambda: self._client.put_object(Bucket=self.bucket, Key=name, Body=blob))
                is not None
            )
        return self._write_multipart(name, head, memoryview(body).cast("B"), size)

    def _write_multipart(self, name: str, head: bytes, body: memoryview, size: int) -> bool:
        up = self._guard(lambda: self._client.create_multipart_upload(Bucket=self.bucket, Key=name))
        if up is None:
            return False
        uid = up["UploadId"]
        part = max(_MIN_PART, self.range_bytes)
        cuts = list(range(0, size, part))

        def send(i: int) -> dict[str, Any] | None:
            s, e = cuts[i], min(cuts[i] + part, size)
            # only the first part holds the header; payload bytes are sliced, not copied twice
            data = (
                (head + bytes(body[: e - len(head)]))
                if s == 0
                else bytes(body[s - len(head) : e - len(head)])
            )
            r = self._guard(
                lambda: self._client.upload_part(
                    Bucket=self.bucket, Key=name, UploadId=uid, PartNumber=i + 1, Body=data
                )
            )
            return None if r is None else {"ETag": r["ETag"], "PartNumber": i + 1}

        with ThreadPoolExecutor(min(8, len(cuts))) as ex:
            parts = list(ex.map(send, range(len(cuts))))
        if any(p is None for p in parts):
            self._guard(
                lambda: self._client.abort_multipart_upload(Bucket=self.bucket, Key=name, UploadId=uid)
            )
            return False
        done = self._guard(
            lambda: self._client.complete_multipart_upload(
                Bucket=self.bucket, Key=name, UploadId=uid, MultipartUpload={"Parts": parts}
            )
        )
        return done is not None

    def _list(self) -> Iterator[str]:
        token: str | None = None
        while True:
            # every key version (kvm1-: the xxh3 chain, never read now): clear() removes both
            kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": self.prefix + "kvm"}
            if token:
                kwargs["ContinuationToken"] = token
            page: dict[str, Any] | None = self._guard(partial(self._client.list_objects_v2, **kwargs))
            if page is None:
                return
            for obj in page.get("Contents", []):
                if _CHUNK_NAME.match(str(obj["Key"]), len(self.prefix)):
                    yield str(obj["Key"])
            token = page.get("NextContinuationToken")
            if not token:
                return

    def _delete_objects(self, names: list[str], existing_only: bool) -> int:
        if existing_only:
            names = [n for n, ok in zip(names, self._map(self._exists, names, False), strict=True) if ok]
        removed = 0
        for i in range(0, len(names), 1000):
            objects = [{"Key": n} for n in names[i : i + 1000]]
            batch = {"Objects": objects, "Quiet": True}
            reply: dict[str, Any] | None = self._guard(
                partial(self._client.delete_objects, Bucket=self.bucket, Delete=batch)
            )
            if reply is not None:
                removed += len(objects) - len(reply.get("Errors", []))
        return removed

    def _exists(self, name: str) -> bool:
        return self._guard(lambda: self._client.head_object(Bucket=self.bucket, Key=name)) is not None

    # ---- through the shared guard ---------------------------------------------------------
    def _guard(self, op: Callable[[], T]) -> T | None:
        """Run ``op`` under the guard; ``None`` for a missing object or when it could not run."""
        try:
            return self.guard.run(_classified(op))
        except (TierError, _Missing):
            return None

    def _ping(self) -> bool:
        # Whatever this raises means "not up yet"; the guard keeps it to say why at start
        # (a certificate that does not verify, a bucket that is not there).
        self._probe_client.head_bucket(Bucket=self.bucket)
        return True


class _Missing(Exception):
    """The object does not exist (a miss, not a failure)."""


class _Answered(Exception):
    """The server answered with a client error (4xx): not an outage, the breaker stays shut."""


class _Retryable(Exception):
    """A 5xx or throttling answer: worth another try, and a failure towards the breaker."""


def _within(
    pool: Executor, fn: Callable[[Any], T], items: Sequence[Any], late: T, guard: RemoteGuard
) -> list[T]:
    """``fn`` over ``items`` in ``pool``, in the caller's context (its deadline goes along),
    waiting at most the time left: an item still running then is ``late`` (a timeout: the
    breaker opens) and left to end by itself. A server that drips its answer's headers
    holds a request past any socket timeout; the caller is not held with it."""
    futures = [pool.submit(contextvars.copy_context().run, fn, item) for item in items]
    left = time_left()
    done, _ = wait(futures, timeout=None if left is None else max(0.0, left) + _LATE_S)
    out = [f.result() if f in done else late for f in futures]
    if len(done) < len(futures):
        guard.timed_out(TimeoutError("requests still unanswered at the deadline"), len(futures) - len(done))
    return out


def _read_body(body: Any, length: int, asked: int) -> bytearray:
    """A ranged GET's body of ``length`` bytes (its Content-Length: no more than the ``asked``
    range, or the server is not answering the request made). Read one socket read at a time,
    each waiting at most the operation's time left: ``read()`` waited a fresh read timeout
    per socket read, so a body dripped a few bytes at a time held the read for as long as
    the drip went on, and a server that ignored the range had its whole object read."""
    if not 0 <= length <= asked:
        body.close()
        raise _Answered(f"a ranged GET of {asked} bytes answered {length}")
    raw = getattr(body, "_raw_stream", body)  # botocore's StreamingBody over urllib3's response
    # urllib3's response names its connection, http.client's connection its socket (botocore's
    # own set_socket_timeout reaches further in, and raises where that moves). Without it a
    # read waits read_timeout_s at most each, and the caller leaves at its deadline (_within).
    sock = getattr(getattr(raw, "connection", None), "sock", None)
    out = bytearray(length)
    pos = 0
    try:
        while pos < length:
            left = time_left()
            if left is not None:
                if left <= 0:
                    raise TimeoutError("the operation's budget ran out in the middle of a body")
                if sock is not None:
                    sock.settimeout(left)
            piece = raw.read1(min(_READ_PIECE, length - pos))
            if not piece:
                raise ConnectionError(f"the body ended after {pos} of {length} bytes")
            out[pos : pos + len(piece)] = piece
            pos += len(piece)
    except URLLib3ReadTimeout as exc:
        raise TimeoutError(str(exc)) from None
    except URLLib3Error as exc:
        raise ConnectionError(str(exc)) from None
    except BaseException:
        body.close()
        raise
    return out


def _classified(op: Callable[[], T]) -> Callable[[], T]:
    """``op`` with S3's error answers sorted into what the guard tells apart."""

    def run() -> T:
        try:
            return op()
        except ClientError as exc:
            err = exc.response.get("Error", {})
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            if str(err.get("Code")) in _MISSING or status == 404:
                raise _Missing() from None
            if status < 500 and err.get("Code") not in ("SlowDown", "Throttling", "RequestTimeout"):
                raise _Answered(str(exc)) from None
            raise _Retryable(str(exc)) from None

    return run


def _parse(url: str) -> dict[str, str]:
    parts = urlsplit(url)
    q = dict(parse_qsl(parts.query))
    host = parts.netloc
    m = _VHOST.match(host)
    if m:
        host = m.group("bucket")
        if m.group("region"):
            q.setdefault("region", m.group("region"))
    if not host:
        raise ConfigError(f"s3 URL {redact_url(url)!r} names no bucket; write s3://bucket/prefix")
    if "." in host and "endpoint_url" not in q and not os.environ.get("AWS_ENDPOINT_URL"):
        # LMCache's s3://bucket.endpoint-host form, given as a kvmesh key: say how it is read
        log.warning(
            "kvmesh tier s3: bucket %r (no endpoint_url): looked up on AWS; for an S3-compatible "
            "store write s3://BUCKET/prefix?endpoint_url=https://HOST (LMCache configurations "
            "are translated so)",
            host,
        )
    prefix = parts.path.strip("/")
    q["bucket"] = host
    q["prefix"] = prefix + "/" if prefix else ""
    return q


@register_tier("s3")
def _open_s3(url: str, options: TierOptions) -> S3Tier:
    return S3Tier(url, options)
