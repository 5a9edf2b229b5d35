"""LMCache's remote-backend settings, carried onto kvmesh's ``remote_url``.

LMCache keeps a backend's credentials and options in ``extra_config`` (and, for S3, in the
URL's host); kvmesh keeps them in the URL its tier opens. :class:`RemoteExtras` collects the
``extra_config`` entries of one configuration and :func:`finish_url` writes them into the
URL, with what LMCache means by each:

* Redis / Valkey (``redis://``, ``rediss://``, ``valkey://``, ``unix://``,
  ``redis-sentinel://``, ``redis-cluster://``, LMCache's ``resp://``): ``username`` /
  ``password`` (RESP), ``redis_username`` / ``redis_password`` / ``redis_database`` /
  ``use_tls`` / ``redis_mode`` (Redis), ``valkey_username`` / ``valkey_password`` /
  ``valkey_database`` / ``tls_enable`` / ``valkey_mode`` / ``valkey_enable_ttl`` +
  ``valkey_ttl_sec`` (Valkey) become the URL's credentials, database, ``rediss`` scheme,
  ``redis-cluster://`` and ``remote_ttl_s``. Credentials already in the URL win.
* S3: LMCache's ``s3://HOST`` is the virtual-hosted endpoint its client sends requests to
  (``bucket.s3.region.amazonaws.com``, ``bucket.t3.storage.dev``, ``test-127.cwlota.com``):
  for a host outside amazonaws.com, the first label is the bucket and the rest the endpoint
  (``http://`` with ``disable_tls``). ``s3_region`` / ``region``, ``s3_endpoint_url``,
  ``aws_*`` keys, ``s3_file_prefix``, ``s3_num_io_threads`` / ``s3_max_io_concurrency`` /
  ``s3_max_inflight_reqs`` go into the URL's query, which :mod:`kvmesh.tiers.s3` reads.
* Mooncake: its ``extra_config`` keys go into the ``mooncakestore://`` URL's query.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

from kvmesh.errors import ConfigError

REDIS_SCHEMES = ("redis", "rediss", "valkey", "unix", "redis-sentinel", "redis-cluster", "resp")

# extra_config key -> s3 URL query parameter (read by kvmesh.tiers.s3)
S3_QUERY = {
    "s3_region": "region",
    "region": "region",  # an older LMCache S3 adapter's name
    "s3_endpoint": "endpoint_url",
    "s3_endpoint_url": "endpoint_url",
    "aws_access_key_id": "access_key_id",
    "aws_secret_access_key": "secret_access_key",
    "disable_tls": "disable_tls",
}
_S3_CONCURRENCY = ("s3_num_io_threads", "s3_max_io_concurrency", "s3_max_inflight_reqs")
MOONCAKE_QUERY = {
    "local_hostname": "local_hostname",
    "metadata_server": "metadata_server",
    "protocol": "protocol",
    "device_name": "device_name",
    "global_segment_size": "global_segment_size",
    "local_buffer_size": "local_buffer_size",
}
_REDIS_FIELDS = {
    "username": "username",
    "redis_username": "username",
    "valkey_username": "username",
    "password": "password",
    "redis_password": "password",
    "valkey_password": "password",
    "redis_database": "db",
    "valkey_database": "db",
    "use_tls": "tls",
    "tls_enable": "tls",
}
EXTRA_IGNORED = {
    "master_server_address": "the master is the host:port of the mooncakestore:// URL",
    "transfer_timeout": "the mooncake tier uses the store's own timeouts",
    "disk_io_threads": "kvmesh's disk tier sizes its own I/O threads",
    "s3_prefer_http2": "the s3 tier speaks HTTP/1.1 through botocore",
    "s3_enable_s3express": "S3 Express buckets are addressed by name (bucket--az--x-s3) like any other",
    "s3_part_size": "the s3 tier sizes its own multipart parts (multipart_bytes)",
    "save_chunk_meta": "kvmesh always stores each chunk's header (key, tokens, checksum)",
    "valkey_num_workers": "the redis tier pipelines batches on one connection pool",
    "valkey_sync_num_workers": "the redis tier pipelines batches on one connection pool",
    "resp_num_threads": "the redis tier pipelines batches on one connection pool",
    "max_connections": "the redis tier pipelines batches on one connection pool",
    "connection_timeout": "remote_timeout_s bounds the whole operation, connecting included",
}
_TTL_DEFAULT_S = 86400  # LMCache's Valkey TTL when valkey_enable_ttl has no valkey_ttl_sec


def _is_true(value: Any) -> bool:
    return value is True or str(value).strip().lower() in ("true", "1", "yes", "on")


@dataclass
class RemoteExtras:
    """The remote-backend entries of one configuration's ``extra_config`` (all layers)."""

    s3: dict[str, str] = field(default_factory=dict)
    mooncake: dict[str, str] = field(default_factory=dict)
    redis: dict[str, Any] = field(default_factory=dict)
    cluster: bool = False
    ttl_on: bool = False
    ttl_s: float | None = None

    def update(self, other: RemoteExtras) -> None:
        self.s3.update(other.s3)
        self.mooncake.update(other.mooncake)
        self.redis.update(other.redis)
        self.cluster = self.cluster or other.cluster
        self.ttl_on = self.ttl_on or other.ttl_on
        self.ttl_s = other.ttl_s if other.ttl_s is not None else self.ttl_s

    def read(self, sub: str, value: Any) -> tuple[str, str, str] | None:
        """``(action, target, note)`` for an ``extra_config`` key this module knows, else None."""
        if sub in _REDIS_FIELDS:
            name = _REDIS_FIELDS[sub]
            if name == "db":
                try:
                    self.redis["db"] = int(value)
                except (TypeError, ValueError):
                    raise ConfigError(f"extra_config.{sub}: a database number, got {value!r}") from None
            else:
                self.redis[name] = _is_true(value) if name == "tls" else str(value)
            target = {"tls": "remote_url rediss://", "db": "remote_url /db"}.get(name, f"remote_url {name}")
            return "mapped", target, "applied to a Redis / Valkey remote_url"
        if sub in ("valkey_mode", "redis_mode"):
            if str(value) == "cluster":
                self.cluster = True
                return "mapped", "remote_url redis-cluster://", f"{value!r}: cluster mode"
            return "ignored", "", "standalone is the default"
        if sub == "valkey_enable_ttl":
            self.ttl_on = _is_true(value)
            return "mapped", "remote_ttl_s", f"LMCache's TTL ({_TTL_DEFAULT_S} s unless valkey_ttl_sec)"
        if sub == "valkey_ttl_sec":
            try:
                self.ttl_s = float(value)
            except (TypeError, ValueError):
                raise ConfigError(f"extra_config.{sub}: a number of seconds, got {value!r}") from None
            return "mapped", "remote_ttl_s", "with valkey_enable_ttl"
        if sub in S3_QUERY:
            self.s3[S3_QUERY[sub]] = str(value)
            return "mapped", f"remote_url ?{S3_QUERY[sub]}=", "read by the s3 tier"
        if sub in _S3_CONCURRENCY:
            # LMCache's effective concurrency is the smallest of these
            now = int(value)
            old = self.s3.get("max_concurrency")
            self.s3["max_concurrency"] = str(now if old is None else min(now, int(old)))
            return "mapped", "remote_url ?max_concurrency=", "parallel requests of the s3 tier"
        if sub == "s3_file_prefix":
            self.s3["_prefix"] = str(value).strip("/")
            return "mapped", "remote_url /prefix", "objects under this prefix"
        if sub in MOONCAKE_QUERY:
            self.mooncake[MOONCAKE_QUERY[sub]] = str(value)
            return "mapped", f"remote_url ?{MOONCAKE_QUERY[sub]}=", "read by the mooncake tier"
        if sub in EXTRA_IGNORED:
            return "ignored", "", EXTRA_IGNORED[sub]
        return None

    @property
    def ttl(self) -> float | None:
        if not self.ttl_on:
            return None
        return self.ttl_s if self.ttl_s is not None else float(_TTL_DEFAULT_S)


def finish_url(url: str, extras: RemoteExtras, lmcache_url: bool) -> tuple[str, list[str]]:
    """``url`` with ``extras`` written in; ``lmcache_url``: the URL came from a configuration
    read as LMCache's (its ``s3://HOST`` is an endpoint). Returns the URL and notes."""
    notes: list[str] = []
    scheme = urlsplit(url).scheme
    if scheme == "resp":
        url = "redis" + url[len("resp") :]
        notes.append("LMCache's resp:// is a Redis server at host:port: kvmesh's redis tier")
        scheme = "redis"
    if scheme in REDIS_SCHEMES:
        url = _redis_url(url, scheme, extras, notes)
    elif scheme == "s3":
        url = _s3_url(url, extras, lmcache_url, notes)
    elif scheme == "mooncakestore" and extras.mooncake:
        url = with_query(url, extras.mooncake)
    elif scheme == "fs" and urlsplit(url).port is not None and urlsplit(url).path.startswith("/"):
        parts = urlsplit(url)
        notes.append(
            f"LMCache's fs://{parts.netloc}{parts.path} is the directory {parts.path} "
            "(LMCache's FSConnector parses host:port and uses only the path)"
        )
        url = f"fs://{parts.path}" + (f"?{parts.query}" if parts.query else "")
    return url, notes


def _redis_url(url: str, scheme: str, extras: RemoteExtras, notes: list[str]) -> str:
    r = extras.redis
    tls = bool(r.get("tls")) or scheme == "rediss"
    if extras.cluster and scheme in ("valkey", "redis", "rediss"):
        url = "redis-cluster://" + url.split("://", 1)[1]
        scheme = "redis-cluster"
    if tls and scheme in ("redis-cluster", "redis-sentinel"):
        # kept: a cluster URL once lost it, and with it the encryption asked for
        url = with_query(url, {"ssl": "true"})
        notes.append(f"TLS ({scheme}): ?ssl=true")
    parts = urlsplit(url)
    if r.get("tls") and scheme in ("redis", "valkey"):
        parts = parts._replace(scheme="rediss")
        notes.append("TLS (use_tls / tls_enable): rediss://")
    if (r.get("username") or r.get("password")) and "@" not in parts.netloc:
        user = quote(r.get("username", ""), safe="")
        cred = f"{user}:{quote(r['password'], safe='')}" if r.get("password") else user
        parts = parts._replace(netloc=f"{cred}@{parts.netloc}")
        notes.append("credentials from extra_config")
    if "db" in r:
        if scheme == "redis-cluster":
            notes.append("database number ignored: a Redis cluster has database 0 only")
        elif scheme == "unix":
            query = dict(parse_qsl(parts.query))
            query.setdefault("db", str(r["db"]))
            parts = parts._replace(query=urlencode(query))
        elif parts.path in ("", "/"):
            parts = parts._replace(path=f"/{r['db']}")
            notes.append(f"database {r['db']}")
    return urlunsplit(parts)


def _s3_url(url: str, extras: RemoteExtras, lmcache_url: bool, notes: list[str]) -> str:
    query = {k: v for k, v in extras.s3.items() if not k.startswith("_")}
    parts = urlsplit(url)
    host = parts.netloc
    existing = dict(parse_qsl(parts.query))
    if lmcache_url and "." in host and "amazonaws.com" not in host and "endpoint_url" not in existing:
        bucket, _, endpoint = host.partition(".")
        no_tls = _is_true(query.get("disable_tls", existing.get("disable_tls", "false")))
        query["endpoint_url"] = f"{'http' if no_tls else 'https'}://{endpoint}"
        parts = parts._replace(netloc=bucket)
        notes.append(f"LMCache's s3://{host} is bucket {bucket!r} at endpoint {query['endpoint_url']}")
    prefix = extras.s3.get("_prefix")
    if prefix and parts.path.strip("/") == "":
        parts = parts._replace(path=f"/{prefix}")
    return with_query(urlunsplit(parts), query)


def with_query(url: str, query: dict[str, str]) -> str:
    """``url`` with ``query`` merged into its query string (keys already there win)."""
    parts = urlsplit(url)
    merged = dict(query)
    merged.update(dict(parse_qsl(parts.query)))
    return urlunsplit(parts._replace(query=urlencode(merged)))
