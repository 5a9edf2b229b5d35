"""Reading LMCache configurations: every key of LMCache's ``LMCacheEngineConfig`` (v1, as of
LMCache 0.5.6), of its v0 releases and of its older v1 releases, translated into kvmesh keys.

Each key a user wrote gets one :class:`KeyReading`:

* ``taken`` — a kvmesh key (LMCache's ``chunk_size``, ``local_cpu``, ... have kvmesh's name
  and meaning), used as it is;
* ``mapped`` — an LMCache key (or alias, or ``extra_config`` entry) turned into kvmesh keys;
* ``ignored`` — an LMCache key kvmesh has no use for, left at a value that asks for nothing
  (LMCache's own default, or a switch that is off), or read with what kvmesh does instead;
* ``unsupported`` — an LMCache key set to ask for a feature kvmesh does not have: a warning
  at start saying what kvmesh does instead, an error with ``strict: true``;
* ``unknown`` — a key neither LMCache nor kvmesh knows, in a configuration read as
  LMCache's: LMCache warns and ignores it, so kvmesh does too (naming the closest known key);
  an error with ``strict: true``.

**Which configuration is LMCache's.** A layer (a file, a dict, the variables) is read as
LMCache's when it comes from ``LMCACHE_*`` variables or ``LMCACHE_CONFIG_FILE``, or when it
holds a key only LMCache has (an LMCache key that is not a kvmesh key, an alias, a v0 or
older-release key, an ``lmcache.``-prefixed key) and no key only kvmesh has. Otherwise it is
kvmesh's, and a key nobody knows stays an error (a typo must not pass). An
``lmcache.``-prefixed key nobody knows is always LMCache's (a warning). In an LMCache layer
``controller_url`` is LMCache's (the cache controller's ZMQ address), as is a
``controller_url`` anywhere that is not an http(s) URL. The key lists are LMCache's
interface, written down here; none of LMCache's code is used.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from kvmesh import config_lmcache_pd as pd
from kvmesh.config_lmcache_keys import ALIASES, NO_EQUIVALENT, RETIRED
from kvmesh.config_lmcache_remote import RemoteExtras, finish_url, with_query
from kvmesh.errors import ConfigError

__all__ = ["KeyReading", "Translation", "is_lmcache_key", "redact_url", "translate", "with_query"]

Action = Literal["taken", "mapped", "ignored", "unsupported", "unknown"]
WARNED: tuple[Action, ...] = ("unsupported", "unknown")  # logged at start; errors with strict
LMCACHE_PREFIX = "lmcache."
LMCACHE_SOURCES = ("env LMCACHE_", "LMCACHE_CONFIG_FILE")
# LMCache 0.5.6 keys with kvmesh's name and meaning (so they mark neither side).
SHARED = frozenset(
    {"chunk_size", "local_cpu", "max_local_cpu_size", "local_disk", "max_local_disk_size", "remote_url",
     "remote_serde", "save_unfull_chunk", "controller_url"}
)  # fmt: skip


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
_CONTROLLER = (
    "LMCache's controller_url is the ZMQ address of LMCache's cache controller (an alias of "
    "controller_pull_url), a different protocol; kvmesh's controller is `kvmesh router`'s HTTP API: "
    "set kvmesh's controller_url to http://ROUTER:PORT (KVMESH_CONTROLLER_URL) to register with it"
)


def _asks_nothing(value: Any, default: Any) -> bool:
    return value is None or value is False or value == default or value == [] or value == 0


def _is_true(value: Any) -> bool:
    return value is True or str(value).strip().lower() in ("true", "1", "yes", "on")


def known_keys(kvmesh_keys: Iterable[str]) -> list[str]:
    """Every key kvmesh reads: its own and LMCache's (for "did you mean")."""
    lmcache = set(NO_EQUIVALENT) | set(_MAPPERS) | set(ALIASES) | set(RETIRED) | pd.PD_KEYS
    return sorted(set(kvmesh_keys) | lmcache)


def closest(key: str, candidates: Iterable[str]) -> str | None:
    found = difflib.get_close_matches(key, list(candidates), n=1, cutoff=0.6)
    return found[0] if found else None


def is_lmcache_layer(source: str, data: Mapping[str, Any], kvmesh_keys: Iterable[str]) -> bool:
    """Whether one layer is read as LMCache's (see the module docstring)."""
    if source.startswith(LMCACHE_SOURCES) or "(LMCACHE_CONFIG_FILE)" in source:
        return True
    own = set(kvmesh_keys) - SHARED - {"strict"}
    bare = [str(k).removeprefix(LMCACHE_PREFIX) for k in data]
    if any(k in own for k in bare):
        return False
    return any(str(k).startswith(LMCACHE_PREFIX) or (is_lmcache_key(k) and k not in SHARED) for k in bare)


@dataclass
class Translation:
    """What :func:`translate` makes of the layers."""

    values: dict[str, Any]
    readings: list[KeyReading]
    pd_role: str | None = None  # vLLM kv_role LMCache's pd_role asks for
    lmcache: bool = False  # some layer was read as LMCache's


class Translator:
    """Turns one layer of user keys (a file, a dict, env variables) into kvmesh keys."""

    def __init__(self, kvmesh_keys: Iterable[str], source: str, lmcache: bool = False) -> None:
        self.kvmesh_keys = set(kvmesh_keys)
        self.source = source
        self.lmcache = lmcache
        self.readings: list[KeyReading] = []
        self.values: dict[str, Any] = {}  # from LMCache keys
        self.direct: dict[str, Any] = {}  # kvmesh keys: win over mapped ones in one layer
        self.unknown: list[str] = []
        self.extras = RemoteExtras()
        self.pd_role: str | None = None

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
        if bare == "controller_url" and value is not None and self._lmcache_controller(value):
            self.note(key, "unsupported", "", f"{key}={value!r}: {_CONTROLLER}")
            return
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
        if bare in pd.PD_KEYS:
            action, target, why, role = pd.read(bare, value)
            self.pd_role = role or self.pd_role
            self.note(key, action, target, why)  # type: ignore[arg-type]
            return
        table = NO_EQUIVALENT if bare in NO_EQUIVALENT else RETIRED if bare in RETIRED else None
        if table is not None:
            default, why = table[bare]
            if _asks_nothing(value, default):
                self.note(key, "ignored", "", f"{value!r} asks for nothing; {why}")
            else:
                self.note(key, "unsupported", "", f"{key}={value!r}: {why}")
            return
        if self.lmcache or key.startswith(LMCACHE_PREFIX):
            near = closest(bare, known_keys(self.kvmesh_keys))
            hint = f"; did you mean {near!r}?" if near else ""
            self.note(key, "unknown", "", f"not a key of LMCache 0.5.6 or kvmesh; LMCache ignores it{hint}")
            return
        self.unknown.append(key)

    def _lmcache_controller(self, value: Any) -> bool:
        return self.lmcache or not str(value).startswith(("http://", "https://"))

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
        elif bare == "max_local_cpu_size" and value == 0:
            self.direct[bare] = 0.0
            self.note(key, "taken", bare, "0 = no CPU tier (with local_cpu: false)")
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

    def _discard_partial(self, key: str, value: Any, _d: Any) -> None:
        # LMCache's kv_connector_extra_config key: the inverse of save_unfull_chunk
        self.values["save_unfull_chunk"] = not _is_true(value)
        self.note(key, "mapped", f"save_unfull_chunk={not _is_true(value)}", "LMCache connector key")

    def _extra_config(self, key: str, value: Any, _d: Any) -> None:
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
            elif sub == "request_timeout":
                self.values["remote_timeout_s"] = float(v)
                self.note(name, "mapped", "remote_timeout_s", "LMCache's Valkey request timeout")
            elif (read := self.extras.read(str(sub), v)) is not None:
                self.note(name, read[0], read[1], read[2])  # type: ignore[arg-type]
            else:
                self.note(name, "unsupported", "", "LMCache backend option kvmesh has no setting for")


_Mapper = Callable[[Translator, str, Any, Any], None]


def _to(target: str) -> _Mapper:
    """A mapper that sets ``target`` to the value as it is."""

    def handle(t: Translator, key: str, value: Any, _d: Any) -> None:
        t.values[target] = value
        t.note(key, "mapped", target)

    return handle


def _connector_only(note: str) -> _Mapper:
    def handle(t: Translator, key: str, _value: Any, _d: Any) -> None:
        t.note(key, "ignored", "", note)

    return handle


_MAPPERS: dict[str, _Mapper] = {
    "local_device": Translator._local_device,
    "max_local_cache_size": Translator._max_local_cache_size,
    "cache_policy": Translator._cache_policy,
    "extra_config": Translator._extra_config,
    "discard_partial_chunks": Translator._discard_partial,
    "lmcache_rpc_port": _connector_only("LMCache connector key: kvmesh names its RPC socket itself"),
    "skip_last_n_tokens": _connector_only("LMCache connector key: a load never covers a prompt's last token"),
    "blocking_timeout_secs": _to("remote_timeout_s"),
    "internal_api_server_enabled": _to("admin_enabled"),
    "internal_api_server_host": _to("admin_host"),
    "internal_api_server_port_start": _to("admin_port"),
    "lmcache_instance_id": _to("admin_name"),
}


def translate(layers: Iterable[tuple[str, Mapping[str, Any]]], kvmesh_keys: Iterable[str]) -> Translation:
    """kvmesh keys from ``(source, data)`` layers, later layers winning, and how each key
    was read. Within one layer a kvmesh key wins over an LMCache key mapped onto it."""
    known = sorted(kvmesh_keys)
    out = Translation({}, [])
    values = out.values
    extras = RemoteExtras()
    url_lmcache = False
    for source, data in layers:
        if not isinstance(data, Mapping):
            raise ConfigError(f"config must be a mapping of keys to values, got {type(data).__name__}")
        lmcache = is_lmcache_layer(source, data, known)
        t = Translator(known, source, lmcache)
        t.feed(data)
        if t.unknown:
            near = {k: closest(k, known_keys(known)) for k in t.unknown}
            hints = [f"{k!r} (did you mean {c!r}?)" if c else repr(k) for k, c in sorted(near.items())]
            raise ConfigError(
                f"unknown config key(s) {', '.join(hints)} ({source}); "
                f"valid keys: {', '.join(known)}; LMCache's keys are accepted too "
                "(see `kvmesh config check`)"
            )
        values.update(t.values)
        values.update(t.direct)
        if "remote_url" in t.direct or "remote_url" in t.values:
            url_lmcache = lmcache
        extras.update(t.extras)
        out.pd_role = t.pd_role or out.pd_role
        out.lmcache = out.lmcache or lmcache
        out.readings.extend(t.readings)
    url = values.get("remote_url")
    if isinstance(url, str):
        values["remote_url"], notes = finish_url(url, extras, url_lmcache)
        if notes:
            note = "; ".join(notes)
            out.readings.append(KeyReading("remote_url", "extra_config", "mapped", "remote_url", note))
    if extras.ttl is not None and "remote_ttl_s" not in values:
        values["remote_ttl_s"] = extras.ttl
    return out


def is_lmcache_key(key: str) -> bool:
    return key in NO_EQUIVALENT or key in _MAPPERS or key in ALIASES or key in RETIRED or key in pd.PD_KEYS


_SECRET_PARAMS = ("secret_access_key", "access_key_id", "password")


def redact_url(url: str) -> str:
    """``url`` without credentials (for logs and ``config check``)."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        netloc = "***@" + netloc.rsplit("@", 1)[1]
    query = [(k, "***" if k in _SECRET_PARAMS else v) for k, v in parse_qsl(parts.query)]
    return urlunsplit(parts._replace(netloc=netloc, query=urlencode(query, safe="*")))
