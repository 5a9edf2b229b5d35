"""Redis Cluster tier: ``redis-cluster://[user:pass@]host:port,host:port,...[?ssl=true]``
(LMCache's scheme; ``valkey://`` with LMCache's ``extra_config.valkey_mode: cluster`` maps
onto it). ``ssl=true`` speaks TLS to every node (a cluster started with ``tls-cluster yes``,
or a managed one with encryption in transit); redis-py's ``ssl_*`` options
(``ssl_ca_certs=/path/ca.pem``, ``ssl_cert_reqs``, ``ssl_certfile``, ``ssl_keyfile``) go to
every node as they go to a ``rediss://`` URL.

Chunks spread over the cluster's shards by key: every chunk is one Redis hash (see
:mod:`kvmesh.tiers.redis`), so its header and all its parts live in one slot, on one
shard, with no hash tag needed, and a batch read is one pipeline per shard, run in
parallel. Each primary is served by its own :class:`~kvmesh.tiers.redis.RedisTier` (its
own retries, breaker and probe), so a shard that is down is a miss for its keys only; the
others keep answering. For that the servers must run with
``cluster-require-full-coverage no`` (else every node refuses commands while one slot is
uncovered) — or have replicas, whose promotion the slot map picks up.

The slot map (``CLUSTER SLOTS``, from any node that answers) is refreshed in the
background every ``10 * probe_interval_s`` and when a shard's requests fail, so failovers
and resharding reach the tier within seconds; until then keys of moved slots are misses.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, TypeVar
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit

import redis
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from kvmesh.config_lmcache import redact_url
from kvmesh.core.keys import ChunkKey
from kvmesh.core.saylimit import SayLimit, held_back
from kvmesh.core.serde import Buffer
from kvmesh.errors import ConfigError
from kvmesh.metrics import TierMetrics
from kvmesh.tiers.base import ChunkData, Feature, Into, StoredChunk, TierOptions, register_tier, url_flag
from kvmesh.tiers.deadline import deadline
from kvmesh.tiers.redis import RedisTier
from kvmesh.tiers.redis_wire import TLS_OPTIONS, make_client, refuse_fragment

log = logging.getLogger(__name__)
T = TypeVar("T")
Addr = tuple[str, int]
SLOTS_TIMEOUT_S = 1.0  # one node's CLUSTER SLOTS answer, whole
SLOTS_REPLY_BYTES = 4 << 20  # ~100 bytes a slot range: thousands of shards with their replicas


def _slot_map(reply: Any, host: str) -> list[Addr | None] | None:
    """``CLUSTER SLOTS`` (``[[start, end, [host, port, ...], replicas...], ...]``) as each
    slot's primary, or ``None`` for anything else (a hostile or broken node). An empty host
    is the answering node's (Redis's convention)."""
    if not isinstance(reply, list):
        return None
    slots: list[Addr | None] = [None] * REDIS_CLUSTER_HASH_SLOTS
    for entry in reply:
        if not isinstance(entry, list) or len(entry) < 3:
            return None
        start, end, primary = entry[0], entry[1], entry[2]
        if type(start) is not int or type(end) is not int or not 0 <= start <= end < REDIS_CLUSTER_HASH_SLOTS:
            return None
        if not isinstance(primary, list) or len(primary) < 2 or type(primary[1]) is not int:
            return None
        name, port = primary[0], primary[1]
        if not isinstance(name, bytes | str) or not 0 < port < 65536:
            return None
        text = name.decode(errors="replace") if isinstance(name, bytes) else name
        slots[start : end + 1] = [(text or host, port)] * (end - start + 1)
    return slots


class _ShardMetrics(TierMetrics):
    """A shard's counters add up into the cluster tier's; its ``up`` gauge stays its own."""

    def __init__(self, parent: TierMetrics, addr: Addr) -> None:
        super().__init__(f"{parent.tier}@{addr[0]}:{addr[1]}")
        self.parent = parent

    def inc(self, name: str, value: int = 1) -> None:
        super().inc(name, value)
        self.parent.inc(name, value)


class RedisClusterTier:
    """A remote tier over the primaries of a Redis (or Valkey) Cluster."""

    features = Feature.RECODE  # shared by every replica: no pins (as RedisTier)

    def __init__(self, url: str, options: TierOptions) -> None:
        self.name = options.name or "redis-cluster"
        self.metrics = options.metrics
        self.url = redact_url(url)
        self.options = options
        self.chunk_format = options.chunk_format  # every shard's RedisTier gets it too
        self._auth, self.seeds, self._tls = _parse(url)
        self._lock = threading.Lock()
        self._shards: dict[Addr, RedisTier] = {}
        self._slots: list[Addr | None] = [None] * REDIS_CLUSTER_HASH_SLOTS
        self._closed = threading.Event()
        self._stale = threading.Event()
        self._pool = ThreadPoolExecutor(8, thread_name_prefix=f"kvmesh-{self.name}")
        self._say = SayLimit()
        if not self._refresh():
            log.warning(
                "kvmesh tier %s: no node of %s answers CLUSTER SLOTS; starting down", self.name, self.url
            )
        self._refresher = threading.Thread(
            target=self._refresh_loop, name=f"kvmesh-slots-{self.name}", daemon=True
        )
        self._refresher.start()

    # ---- the slot map -------------------------------------------------------------------
    def _refresh(self) -> bool:
        """Reload the slot map from the first node that answers with a valid one; open tiers
        for new primaries. A node is hostile until shown otherwise: its answer is bounded
        (one second, :data:`SLOTS_REPLY_BYTES`) and checked before a slot is assigned (a
        range past the slot count once made a list of 10^9 entries)."""
        with self._lock:
            known = list(self._shards)
        for host, port in dict.fromkeys([*known, *self.seeds]):
            client = make_client(self._node_url((host, port)), SLOTS_TIMEOUT_S, SLOTS_REPLY_BYTES)
            try:
                with deadline(SLOTS_TIMEOUT_S):
                    reply: Any = client.execute_command("CLUSTER", "SLOTS")
            except (redis.RedisError, OSError):
                continue
            finally:
                with contextlib.suppress(redis.RedisError, OSError):
                    client.close()
            slots = _slot_map(reply, host)
            if slots is None:
                self._said_malformed(host, port)
                continue
            self._install(slots)
            return True
        return False

    def _said_malformed(self, host: str, port: int) -> None:
        held = self._say.due(f"{host}:{port}")
        if held is not None:
            log.warning(
                "kvmesh tier %s: %s:%d answered CLUSTER SLOTS with something that is not a slot map; "
                "asking the next node%s",
                self.name,
                host,
                port,
                held_back(held),
            )

    def _install(self, slots: list[Addr | None]) -> None:
        wanted = {a for a in slots if a is not None}
        with self._lock:
            new = [a for a in wanted if a not in self._shards]
        opened = {a: self._open_shard(a) for a in new}  # outside the lock: opening pings
        with self._lock:
            self._shards.update(opened)
            self._slots = slots
            self.metrics.set("shards", len(wanted))
        self._stale.clear()

    def _node_url(self, addr: Addr) -> str:
        """``redis://`` (``rediss://`` with ``ssl=true``, and its ``ssl_*`` options) for one
        node, with the cluster's credentials (quoted: a password may hold ``@``, ``:`` or ``/``)."""
        user, password = self._auth.get("username"), self._auth.get("password")
        auth = f"{quote(user or '', safe='')}:{quote(password, safe='')}@" if password else ""
        host = f"[{addr[0]}]" if ":" in addr[0] else addr[0]  # an IPv6 node
        if self._tls is None:
            return f"redis://{auth}{host}:{addr[1]}/0"
        query = f"?{urlencode(self._tls)}" if self._tls else ""
        return f"rediss://{auth}{host}:{addr[1]}/0{query}"

    def _open_shard(self, addr: Addr) -> RedisTier:
        opts = replace(
            self.options, name=f"{self.name}@{addr[0]}:{addr[1]}", metrics=_ShardMetrics(self.metrics, addr)
        )
        return RedisTier(self._node_url(addr), opts)

    def _refresh_loop(self) -> None:
        interval = max(0.2, 10 * self.options.probe_interval_s)
        while not self._closed.is_set():
            self._stale.wait(interval)
            if self._closed.is_set():
                return
            try:
                self._refresh()
                self._update_up()
            except Exception:  # the loop outlives any one refresh: failovers must still arrive
                log.exception("kvmesh tier %s: the slot map refresh failed", self.name)

    def _update_up(self) -> None:
        self.metrics.set("up", 1 if self.health() != "down" else 0)

    # ---- routing ------------------------------------------------------------------------
    def _route(self, keys: Sequence[ChunkKey]) -> dict[Addr | None, list[int]]:
        groups: dict[Addr | None, list[int]] = {}
        slots = self._slots
        for i, k in enumerate(keys):
            groups.setdefault(slots[key_slot(k.text.encode())], []).append(i)
        return groups

    def _fan(
        self, keys: Sequence[ChunkKey], op: Callable[[RedisTier, list[int]], list[T]], miss: T
    ) -> list[T]:
        out: list[T] = [miss] * len(keys)
        groups = self._route(keys)
        with self._lock:
            shards = {a: self._shards.get(a) if a else None for a in groups}

        def run(addr: Addr | None) -> None:
            tier = shards[addr]
            idx = groups[addr]
            if tier is None:  # slot not covered (yet): a miss
                self._stale.set()
                return
            results = op(tier, idx)
            if tier.health() != "up":
                self._stale.set()  # a failing shard may mean a failover: reload the map soon
            for i, r in zip(idx, results, strict=True):
                out[i] = r

        list(self._pool.map(run, list(groups)))
        return out

    # ---- the Tier protocol --------------------------------------------------------------
    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        return self._fan(keys, lambda t, idx: t.contains([keys[i] for i in idx]), False)

    def get(self, keys: Sequence[ChunkKey], into: Into | None = None) -> list[ChunkData | None]:
        uncovered = sum(len(v) for a, v in self._route(keys).items() if a is None)
        self.metrics.inc("misses", uncovered)
        return self._fan(keys, lambda t, idx: t.get([keys[i] for i in idx], into), None)

    def put(self, keys: Sequence[ChunkKey], chunks: Sequence[ChunkData]) -> list[bool]:
        if len(keys) != len(chunks):
            raise ValueError(f"put got {len(keys)} keys but {len(chunks)} chunks; pass one chunk per key")
        return self._fan(keys, lambda t, idx: t.put([keys[i] for i in idx], [chunks[i] for i in idx]), False)

    def delete(self, keys: Sequence[ChunkKey]) -> int:
        return sum(self._fan(keys, lambda t, idx: _delete_by_slot(t, [keys[i] for i in idx]), 0))

    def clear(self) -> int:
        """Delete every kvmesh chunk on every reachable shard; other keys are left alone."""
        removed = 0
        for t in self._tiers():
            keys = []
            for text in t.keys():  # noqa: SIM118 - a tier's chunk keys, not a dict
                with contextlib.suppress(ValueError):
                    keys.append(ChunkKey.parse(text, self.options.chunk_size))
            removed += sum(_delete_by_slot(t, keys))
        return removed

    def keys(self) -> Iterator[str]:
        for t in self._tiers():
            yield from t.keys()

    # ---- RecodableTier: each key goes to its shard ----------------------------------------
    def read_stored(self, keys: Sequence[ChunkKey]) -> list[StoredChunk | None]:
        return self._fan(keys, lambda t, idx: t.read_stored([keys[i] for i in idx]), None)

    def rewrite(self, key: ChunkKey, head: bytes, body: Buffer, version: int | None) -> int | None:
        result = self._fan([key], lambda t, idx: [t.rewrite(key, head, body, version)], None)
        return result[0]

    def _tiers(self) -> list[RedisTier]:
        with self._lock:
            return list(self._shards.values())

    def health(self) -> str:
        tiers = self._tiers()
        if self._closed.is_set() or not tiers:
            return "down"
        states = {t.health() for t in tiers}
        if states == {"up"} and None not in self._slots:
            return "up"
        return "down" if states == {"down"} else "degraded"

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._stale.set()
        self._refresher.join(timeout=5)
        self._pool.shutdown(wait=True)
        for t in self._tiers():
            t.close()


def _delete_by_slot(tier: RedisTier, keys: Sequence[ChunkKey]) -> list[int]:
    """``tier.delete`` one slot at a time (a multi-key UNLINK across slots is a CROSSSLOT
    error in a cluster). Returns one count per key: the keys deleted, spread for ``_fan``."""
    by_slot: dict[int, list[ChunkKey]] = {}
    for k in keys:
        by_slot.setdefault(key_slot(k.text.encode()), []).append(k)
    total = sum(tier.delete(group) for group in by_slot.values())
    return [total] + [0] * (len(keys) - 1) if keys else []


def _tls(url: str) -> dict[str, str] | None:
    """The query of ``redis-cluster://...?ssl=true&ssl_ca_certs=...``: None for plain TCP,
    else the ``ssl_*`` options every node's ``rediss://`` URL carries. Anything else is
    refused (a query once vanished here, and with it the TLS the user asked for)."""
    try:
        refuse_fragment(url)
        query = dict(parse_qsl(urlsplit(url).query, keep_blank_values=True))
        ssl = url_flag(query, "ssl")
    except ValueError as exc:
        raise ConfigError(f"redis-cluster URL {redact_url(url)!r}: {exc}") from None
    unknown = sorted(set(query) - set(TLS_OPTIONS))
    if unknown:
        raise ConfigError(
            f"redis-cluster URL {redact_url(url)!r}: unknown parameter(s) {', '.join(unknown)}; "
            f"it takes ssl=true and {', '.join(TLS_OPTIONS)}"
        )
    if not ssl:
        if query:
            raise ConfigError(
                f"redis-cluster URL {redact_url(url)!r}: {', '.join(sorted(query))} needs ssl=true"
            )
        return None
    return query


def _parse(url: str) -> tuple[dict[str, str], list[Addr], dict[str, str] | None]:
    """Auth, seed nodes and TLS options (:func:`_tls`) of ``redis-cluster://[user:pass@]h:p,h:p[?ssl=true]``."""
    tls = _tls(url)
    rest = url.split("://", 1)[1].split("/", 1)[0].split("?", 1)[0]
    auth: dict[str, str] = {}
    if "@" in rest:
        cred, rest = rest.rsplit("@", 1)
        user, _, password = (unquote(c) for c in cred.partition(":"))
        if password:
            auth["password"] = password
            if user:
                auth["username"] = user
        elif user:
            auth["password"] = user  # redis-cluster://secret@h:p: a password alone
    seeds: list[Addr] = []
    for part in rest.split(","):
        p = urlsplit("//" + part.strip())
        if not p.hostname or not p.port:
            raise ConfigError(
                f"redis-cluster URL {redact_url(url)!r}: node {part!r} is not host:port; "
                "write redis-cluster://host:port,host:port,..."
            )
        seeds.append((p.hostname, p.port))
    return auth, seeds, tls


@register_tier("redis-cluster")
def _open_cluster(url: str, options: TierOptions) -> RedisClusterTier:
    return RedisClusterTier(url, options)
