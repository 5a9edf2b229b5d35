"""Reading LMCache configurations: every key of LMCache's ``LMCacheEngineConfig`` (v1, as of
LMCache 0.5.6) and of its v0 releases, translated into kvmesh keys.

Each key a user wrote gets one :class:`KeyReading`:

* ``taken`` — a kvmesh key (LMCache's ``chunk_size``, ``local_cpu``, ... have kvmesh's name
  and meaning), used as it is;
* ``mapped`` — an LMCache key (or alias, or ``extra_config`` entry) turned into kvmesh keys;
* ``ignored`` — an LMCache key kvmesh has no use for, left at a value that asks for nothing
  (LMCache's own default, or a switch that is off);
* ``unsupported`` — an LMCache key set to ask for a feature kvmesh does not have: a warning
  at start saying what kvmesh does instead, an error with ``strict: true``.

A key neither kvmesh nor LMCache knows stays an error (a typo must not pass). The key list
is LMCache's interface, written down here; none of LMCache's code is used.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from kvmesh.config_lmcache_keys import ALIASES, NO_EQUIVALENT
from kvmesh.errors import ConfigError

Action = Literal["taken", "mapped", "ignored", "unsupported"]
LMCACHE_PREFIX = "lmcache."


@dataclass(frozen=True)
class KeyReading:
    """How one key of the user's configuration was read."""

    key: str  # as written: "local_device", "lmcache.chunk_size", "extra_config.use_odirect"
    source: str  # "file lmcache.yaml", "env LMCACHE_CHUNK_SIZE", "dict", ...
    action: Action
    target: str  # kvmesh key(s) it set, "" when none
    note: str = ""

    def line(self) -> str:
        to = f" -> {self.target}" if self.target else ""
        note = f"  ({self.note})" if self.note else ""
        return f"{self.action:<11} {self.key}{to}{note}   [{self.source}]"


_CACHE_POLICIES = {"lru": "lru", "fifo": "fifo"}
# remote_serde names: LMCache v1 (naive, cachegen, kivi), v0 (torch, safetensor).
SERDE_NAMES = {"naive": "raw", "torch": "raw", "kv": "raw", "safetensor": "safetensors"}

# extra_config keys kvmesh understands: name -> (kvmesh target, converter of the value).
# S3 settings go into remote_url's query string, which the s3 tier reads.
_S3_QUERY = {
    "s3_region": "region",
    "s3_endpoint": "endpoint_url",
    "s3_endpoint_url": "endpoint_url",
    "aws_access_key_id": "access_key_id",
    "aws_secret_access_key": "secret_access_key",
    "s3_num_io_threads": "max_concurrency",
    "disable_tls": "disable_tls",
}
# Mooncake settings, for mooncakestore:// URLs (read by the mooncake tier).
_MOONCAKE_QUERY = {
    "local_hostname": "local_hostname",
    "metadata_server": "metadata_server",
    "protocol": "protocol",
    "device_name": "device_name",
    "global_segment_size": "global_segment_size",
    "local_buffer_size": "local_buffer_size",
}
_EXTRA_IGNORED = {
    "master_server_address": "the master is the host:port of the mooncakestore:// URL",
    "transfer_timeout": "the mooncake tier uses the store's own timeouts",
    "disk_io_threads": "kvmesh's disk tier sizes its own I/O threads",
    "s3_prefer_http2": "the s3 tier speaks HTTP/1.1 through botocore",
    "s3_enable_s3express": "S3 Express One Zone buckets are not handled specially",
    "save_chunk_meta": "kvmesh always stores each chunk's header (key, tokens, checksum)",
}


def _asks_nothing(value: Any, default: Any) -> bool:
    return value is None or value is False or value == default or value == [] or value == 0


def _is_true(value: Any) -> bool:
    return value is True or str(value).strip().lower() in ("true", "1", "yes", "on")


class Translator:
    """Turns one layer of user keys (a file, a dict, env variables) into kvmesh keys."""

    def __init__(self, kvmesh_keys: Iterable[str], source: str) -> None:
        self.kvmesh_keys = set(kvmesh_keys)
        self.source = source
        self.readings: list[KeyReading] = []
        self.values: dict[str, Any] = {}  # from LMCache keys
        self.direct: dict[str, Any] = {}  # kvmesh keys: win over mapped ones in one layer
        self.unknown: list[str] = []
        self.query: dict[str, str] = {}  # s3 settings for remote_url's query
        self.cluster = False  # extra_config.valkey_mode = cluster
        self.mooncake: dict[str, str] = {}  # mooncake settings for remote_url's query

    def note(self, key: str, action: Action, target: str = "", note: str = "") -> None:
        self.readings.append(KeyReading(key, self.source, action, target, note))

    def feed(self, data: Mapping[str, Any]) -> None:
        v0_device = data.get("local_device", data.get(LMCACHE_PREFIX + "local_device"))
        for raw_key, value in data.items():
            key = str(raw_key)
            bare = key[len(LMCACHE_PREFIX) :] if key.startswith(LMCACHE_PREFIX) else key
            if bare.startswith("mp."):
                self.note(key, "ignored", "", "LMCache multiprocess-connector setting")
                continue
            self._one(key, bare, value, v0_device)

    def _one(self, key: str, bare: str, value: Any, v0_device: Any) -> None:
        if bare in self.kvmesh_keys:
            self._kvmesh_key(key, bare, value)
            return
        handler = _MAPPERS.get(bare)
        if handler is not None:
            handler(self, key, value, v0_device)
            return
        if bare in ALIASES:
            self.note(key, "mapped", "", f"LMCache alias of {ALIASES[bare]}")
            bare = ALIASES[bare]
        if bare in NO_EQUIVALENT:
            default, why = NO_EQUIVALENT[bare]
            if _asks_nothing(value, default):
                self.note(key, "ignored", "", f"{value!r} asks for nothing; {why}")
            else:
                self.note(key, "unsupported", "", f"{key}={value!r}: {why}")
            return
        self.unknown.append(key)

    def _kvmesh_key(self, key: str, bare: str, value: Any) -> None:
        if bare in ("remote_serde", "disk_serde") and isinstance(value, str) and value in SERDE_NAMES:
            self.direct[bare] = SERDE_NAMES[value]
            self.note(key, "mapped", bare, f"LMCache's {value!r} is kvmesh's {SERDE_NAMES[value]!r}")
        elif bare == "remote_serde" and value is None:
            self.note(key, "mapped", bare, "null = kvmesh's default codec 'raw'")
        elif bare in ("remote_url", "local_disk") and value is None:
            self.direct[bare] = None
            self.note(key, "taken", bare, "off")
        elif bare == "local_disk" and isinstance(value, str) and "," in value:
            first = value.split(",")[0].strip()
            self.direct[bare] = first
            self.note(key, "unsupported", bare, f"kvmesh's disk tier takes one directory; using {first!r}")
        else:
            self.direct[bare] = value
            self.note(key, "taken", bare)

    # --- the mapped LMCache keys ---------------------------------------------------------
    def _local_device(self, key: str, value: Any, _d: Any) -> None:
        # v0: "cpu" / "cuda" = a local in-memory cache, "file:///dir/" = a local disk cache,
        # null = no local cache (remote only).
        if value is None:
            self.values["local_cpu"] = False
            self.note(key, "mapped", "local_cpu=false", "v0: no local cache")
        elif value in ("cpu", "cuda"):
            self.values["local_cpu"] = True
            note = "v0" if value == "cpu" else "v0 'cuda': kvmesh keeps its local cache in CPU DRAM"
            self.note(key, "mapped", "local_cpu=true", note)
        elif isinstance(value, str) and (value.startswith("file://") or value.startswith("/")):
            self.values["local_disk"] = value
            self.note(key, "mapped", "local_disk", "v0 disk device")
        else:
            raise ConfigError(
                f"config key {key!r}: invalid local device {value!r}; valid: 'cpu', 'cuda', "
                "'file:///directory/' or null"
            )

    def _max_local_cache_size(self, key: str, value: Any, device: Any) -> None:
        is_disk = isinstance(device, str) and device not in ("cpu", "cuda")
        target = "max_local_disk_size" if is_disk else "max_local_cpu_size"
        self.values[target] = value
        self.note(key, "mapped", target, "v0 size in GB of the local device")

    def _cache_policy(self, key: str, value: Any, _d: Any) -> None:
        name = _CACHE_POLICIES.get(str(value).lower())
        if name is None:
            self.values["eviction_policy"] = "lru"
            self.note(key, "unsupported", "eviction_policy=lru", f"{value!r}: kvmesh has lru and fifo")
        else:
            self.values["eviction_policy"] = name
            self.note(key, "mapped", f"eviction_policy={name}")

    def _extra_config(self, key: str, value: Any, _d: Any) -> None:
        import json

        if isinstance(value, str):
            try:
                value = json.loads(value) if value.strip() else None
            except json.JSONDecodeError as exc:
                raise ConfigError(
                    f"config key {key!r}: not valid JSON ({exc}); write a JSON object"
                ) from None
        if value is None:
            self.note(key, "ignored", "", "empty")
            return
        if not isinstance(value, Mapping):
            raise ConfigError(f"config key {key!r}: must be a mapping (or JSON object), got {value!r}")
        for sub, v in value.items():
            name = f"{key}.{sub}"
            if sub == "use_odirect":
                self.values["disk_o_direct"] = _is_true(v)
                self.note(name, "mapped", "disk_o_direct")
            elif sub in _MOONCAKE_QUERY:
                self.mooncake[_MOONCAKE_QUERY[sub]] = str(v)
                self.note(name, "mapped", f"remote_url ?{_MOONCAKE_QUERY[sub]}=", "read by the mooncake tier")
            elif sub in _S3_QUERY:
                self.query[_S3_QUERY[sub]] = str(v)
                self.note(name, "mapped", f"remote_url ?{_S3_QUERY[sub]}=", "read by the s3 tier")
            elif sub == "valkey_mode":
                if str(v) == "cluster":
                    self.cluster = True
                    self.note(name, "mapped", "remote_url redis-cluster://", "valkey in cluster mode")
                else:
                    self.note(name, "ignored", "", "standalone is the default")
            elif sub in _EXTRA_IGNORED:
                self.note(name, "ignored", "", _EXTRA_IGNORED[sub])
            else:
                self.note(name, "unsupported", "", "LMCache backend option kvmesh has no setting for")


_Mapper = Callable[[Translator, str, Any, Any], None]


def _to(target: str) -> _Mapper:
    """A mapper that sets ``target`` to the value as it is."""

    def handle(t: Translator, key: str, value: Any, _d: Any) -> None:
        t.values[target] = value
        t.note(key, "mapped", target)

    return handle


_MAPPERS: dict[str, _Mapper] = {
    "local_device": Translator._local_device,
    "max_local_cache_size": Translator._max_local_cache_size,
    "cache_policy": Translator._cache_policy,
    "extra_config": Translator._extra_config,
    "blocking_timeout_secs": _to("remote_timeout_s"),
    "internal_api_server_enabled": _to("admin_enabled"),
    "internal_api_server_host": _to("admin_host"),
    "internal_api_server_port_start": _to("admin_port"),
}


def translate(
    layers: Iterable[tuple[str, Mapping[str, Any]]], kvmesh_keys: Iterable[str]
) -> tuple[dict[str, Any], list[KeyReading]]:
    """kvmesh keys from ``(source, data)`` layers, later layers winning, and how each key
    was read. Within one layer a kvmesh key wins over an LMCache key mapped onto it."""
    known = sorted(kvmesh_keys)
    values: dict[str, Any] = {}
    readings: list[KeyReading] = []
    query: dict[str, str] = {}
    mooncake: dict[str, str] = {}
    cluster = False
    for source, data in layers:
        if not isinstance(data, Mapping):
            raise ConfigError(f"config must be a mapping of keys to values, got {type(data).__name__}")
        t = Translator(known, source)
        t.feed(data)
        if t.unknown:
            raise ConfigError(
                f"unknown config key(s) {', '.join(map(repr, sorted(t.unknown)))} ({source}); "
                f"valid keys: {', '.join(known)}; LMCache's keys are accepted too "
                "(see `kvmesh config check`)"
            )
        values.update(t.values)
        values.update(t.direct)
        query.update(t.query)
        mooncake.update(t.mooncake)
        cluster = cluster or t.cluster
        readings.extend(t.readings)
    url = values.get("remote_url")
    if isinstance(url, str):
        scheme = urlsplit(url).scheme
        if cluster and scheme in ("valkey", "redis"):
            url = "redis-cluster://" + url.split("://", 1)[1]
        if query and scheme == "s3":
            url = with_query(url, query)
        if mooncake and scheme == "mooncakestore":
            url = with_query(url, mooncake)
        values["remote_url"] = url
    return values, readings


def is_lmcache_key(key: str) -> bool:
    return key in NO_EQUIVALENT or key in _MAPPERS or key in ALIASES


def with_query(url: str, query: Mapping[str, str]) -> str:
    """``url`` with ``query`` merged into its query string (keys already there win)."""
    parts = urlsplit(url)
    merged = dict(query)
    merged.update(dict(parse_qsl(parts.query)))
    return urlunsplit(parts._replace(query=urlencode(merged)))


_SECRET_PARAMS = ("secret_access_key", "access_key_id", "password")


def redact_url(url: str) -> str:
    """``url`` without credentials (for logs and ``config check``)."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        netloc = "***@" + netloc.rsplit("@", 1)[1]
    query = [(k, "***" if k in _SECRET_PARAMS else v) for k, v in parse_qsl(parts.query)]
    return urlunsplit(parts._replace(netloc=netloc, query=urlencode(query, safe="*")))
