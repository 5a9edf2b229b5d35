"""Mooncake Store tier: ``mooncakestore://MASTER_HOST:PORT/?metadata_server=...``.

Needs the ``mooncake-transfer-engine`` package (``mooncake-transfer-engine-non-cuda`` on a
machine without CUDA; verified here over TCP). Query parameters, onto which LMCache's
``extra_config`` Mooncake keys are mapped by the config: ``metadata_server`` (default
``http://MASTER_HOST:8080/metadata``, the master's own HTTP metadata server),
``local_hostname`` (default ``127.0.0.1``), ``protocol`` (``tcp``), ``device_name``,
``global_segment_size`` (bytes this client contributes to the store, default 256 MiB),
``local_buffer_size`` (default 64 MiB).

Layout: one Mooncake object per chunk, named by the chunk key, holding the serialized
chunk; every read is verified (header tag and key, bounds, payload tag), a corrupt object
removed. Objects are immutable in Mooncake: a put of a key already there counts as stored
(a key names its content). An object that does not verify (planted without the fleet key)
thus keeps the real chunk out until a reader drops it: a lost hit, never a wrong one.
Failures (the master or the peer holding an object gone) are misses and ``False``; after
``failure_threshold`` failed operations in a row the tier is down until a background
``health_check`` passes.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlsplit

from kvmesh.core import serde
from kvmesh.core.keys import ChunkKey
from kvmesh.errors import ConfigError, CorruptChunkError
from kvmesh.tiers.base import (
    ChunkData,
    Feature,
    Into,
    StoredChunk,
    TierOptions,
    count_rejected,
    counted_read,
    register_tier,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
_OBJECT_EXISTS = -702  # Mooncake's OBJECT_ALREADY_EXISTS error code


class MooncakeTier:
    features = Feature.NONE  # a shared store: no pins, no re-encoding in place

    def __init__(self, url: str, options: TierOptions, failure_threshold: int = 3) -> None:
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError:
            raise ConfigError(
                "mooncakestore:// needs the mooncake-transfer-engine package "
                "(pip install mooncake-transfer-engine-non-cuda on a machine without CUDA)"
            ) from None
        self.name = options.name or "mooncake"
        self.metrics = options.metrics
        self.codec = serde.get_codec(options.codec).name
        self.chunk_format = options.chunk_format
        self.url = url.split("?", 1)[0]
        parts = urlsplit(url)
        if not parts.hostname or not parts.port:
            raise ConfigError(f"mooncakestore URL {self.url!r}: write mooncakestore://MASTER_HOST:PORT/")
        q = dict(parse_qsl(parts.query))
        master = f"{parts.hostname}:{parts.port}"
        self.failure_threshold = max(1, failure_threshold)
        self.probe_interval_s = options.probe_interval_s
        self._store = MooncakeDistributedStore()
        rc = self._store.setup(
            q.pop("local_hostname", "127.0.0.1"),
            q.pop("metadata_server", f"http://{parts.hostname}:8080/metadata"),
            int(q.pop("global_segment_size", 256 << 20)),
            int(q.pop("local_buffer_size", 64 << 20)),
            q.pop("protocol", "tcp"),
            q.pop("device_name", ""),
            master,
        )
        if q:
            raise ConfigError(f"mooncakestore URL {self.url!r}: unknown parameter(s) {', '.join(sorted(q))}")
        self._lock = threading.Lock()
        self._failures = 0
        self._up = threading.Event()
        self._closed = threading.Event()
        if rc == 0:
            self._mark_up()
        else:
            # setup needs the master; without it there is no client to probe with
            raise ConfigError(f"mooncakestore: cannot join the store at {master} (setup returned {rc})")
        self._probe = threading.Thread(target=self._probe_loop, name=f"kvmesh-probe-{self.name}", daemon=True)
        self._probe.start()

    # ---- the Tier protocol --------------------------------------------------------------
    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        if not keys:
            return []
        found = self._call(lambda: self._store.batch_is_exist([k.text for k in keys]))
        if found is None:
            return [False] * len(keys)
        self._failed(any(r < 0 for r in found))  # -1: the store could not tell
        return [r == 1 for r in found]

    def get(self, keys: Sequence[ChunkKey], into: Into | None = None) -> list[ChunkData | None]:
        if not keys:
            return []
        blobs = self._call(lambda: self._store.get_batch([k.text for k in keys]))
        out: list[ChunkData | None] = []
        for i, k in enumerate(keys):
            blob = blobs[i] if blobs is not None and i < len(blobs) else None
            item: StoredChunk | None = None
            if blob:
                try:
                    header, raw = self.chunk_format.decode(blob, expected_key=k)
                    item = StoredChunk(header, raw, len(blob))
                except CorruptChunkError as exc:
                    if count_rejected(self.metrics, exc):
                        log.warning("kvmesh tier %s: dropping bad chunk %s: %s", self.name, k.text, exc)
                        self._call(partial(self._store.remove, k.text, True))
            out.append(counted_read(self.metrics, k, item))
        return out

    def put(self, keys: Sequence[ChunkKey], chunks: Sequence[ChunkData]) -> list[bool]:
        if len(keys) != len(chunks):
            raise ValueError(f"put got {len(keys)} keys but {len(chunks)} chunks; pass one chunk per key")
        results = []
        for k, c in zip(keys, chunks, strict=True):
            if not self._up.is_set() or self._closed.is_set():
                results.append(False)
                self.metrics.skip("tier_down")
                continue
            blob = self.chunk_format.encode_bytes(k, c.layout, c.tokens, c.data, self.codec)
            rc = self._call(partial(self._store.put, k.text, blob))
            ok = rc in (0, _OBJECT_EXISTS)
            if rc is not None and not ok:
                self._failed(True)
            if ok:
                self.metrics.inc("stores")
            else:
                self.metrics.skip("tier_error")
            if ok:
                self.metrics.inc("bytes_in", len(blob))
            results.append(ok)
        return results

    def delete(self, keys: Sequence[ChunkKey]) -> int:
        n = 0
        for k in keys:
            n += self._call(partial(self._store.remove, k.text, True)) == 0
        self.metrics.inc("deletes", n)
        return n

    def clear(self) -> int:
        # every key version (kvm1-: the xxh3 chain, never read now)
        n = self._call(lambda: self._store.remove_by_regex("^kvm[0-9]-.*", True))
        removed = max(0, int(n or 0))
        self.metrics.inc("deletes", removed)
        return removed

    def health(self) -> str:
        if self._closed.is_set() or not self._up.is_set():
            return "down"
        return "degraded" if self._failures else "up"

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._probe.join(timeout=max(2.0, self.probe_interval_s + 1.0))
        with contextlib.suppress(Exception):
            self._store.close()

    # ---- failures -----------------------------------------------------------------------
    def _call(self, op: Callable[[], T]) -> T | None:
        if self._closed.is_set() or not self._up.is_set():
            return None
        try:
            result = op()
        except Exception as exc:  # the binding raises plain RuntimeError and others
            log.debug("kvmesh tier %s: %s", self.name, exc)
            self._failed(True)
            return None
        return result

    def _failed(self, failed: bool) -> None:
        with self._lock:
            if not failed:
                self._failures = 0
                return
            self._failures += 1
            self.metrics.inc("errors")
            if self._failures >= self.failure_threshold and self._up.is_set():
                self._up.clear()
                self.metrics.set("up", 0)
                log.warning("kvmesh tier %s: %d failures in a row; marking down", self.name, self._failures)

    def _mark_up(self) -> None:
        with self._lock:
            self._failures = 0
            self._up.set()
        self.metrics.set("up", 1)

    def _probe_loop(self) -> None:
        while not self._closed.wait(self.probe_interval_s):
            if self._up.is_set():
                continue
            ok: Any = None
            with contextlib.suppress(Exception):
                ok = self._store.health_check()
            if ok == 0:
                log.warning("kvmesh tier %s: store answers again; marking up", self.name)
                self._mark_up()


@register_tier("mooncakestore")
def _open_mooncake(url: str, options: TierOptions) -> MooncakeTier:
    return MooncakeTier(url, options)
