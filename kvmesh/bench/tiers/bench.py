"""``kvmesh bench tiers``: store/retrieve throughput of each tier against its physical limit.

Each repeat runs kvmesh and the limit side by side on the same bytes, so the ratio is
robust to this machine's noise; the figures are medians over repeats.

* cpu   — ``CacheEngine.store`` / ``retrieve(out=...)`` vs. a copy into preallocated memory.
* disk  — the disk tier's put (serialize, write, fsync, rename) / get (read, verify) vs.
          ``fio`` (the tool storage engineers use) with the tier's access pattern: a file
          per chunk of the chunk's size, one write + fsync per file, buffered reads one
          chunk at a time (queue depth 1, as ``get`` reads), each file's pages dropped
          before it is read on both sides (cold, as after eviction from the page cache);
          and vs. a naive loop writing + fsyncing / reading the same bytes as files.
* redis — the Redis tier's put / get vs. a raw RESP pipeline over a socket (not redis-py,
          the client the tier uses; :mod:`kvmesh.bench.common.resp`): SET / GET of values of
          the tier's part size, every part of the batch in one pipeline (the tier's depth),
          one connection.
* auth  — disk and Redis again with a fleet key: keyed MAC and AEAD against no key
          (:mod:`kvmesh.bench.tiers.auth`; ``--no-auth`` skips it).

Every store and retrieve result is checked inside the timed loop (a chunk not stored or
not found raises :class:`BenchMiss`: a silent miss must never read as speed), and which side
goes first alternates every round for every tier.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import numpy as np
import torch

from kvmesh.bench.common import fio, resp
from kvmesh.bench.runner import paired_ratios, print_table, provenance, ratio_summary, write_json, write_plot
from kvmesh.config import CacheConfig
from kvmesh.core.engine import CacheEngine
from kvmesh.core.keys import ChunkKey, KeyBuilder, KVLayout
from kvmesh.core.memory import torch_dtype
from kvmesh.harness.connector import shipped_chunk_size
from kvmesh.harness.services import RedisServer
from kvmesh.tiers.base import ChunkData, Tier, TierOptions, open_tier
from kvmesh.tiers.disk import DiskTier

LAYOUTS = {
    "llama-8b": KVLayout(32, 8, 128, "bfloat16"),  # 16 MiB per 128-token chunk
    "tiny": KVLayout(4, 2, 64, "float32"),  # 0.5 MiB per 128-token chunk
}
CHUNK = shipped_chunk_size()  # kvmesh's default chunk size (config.py)
PART = 1 << 20  # the Redis tier's default remote_part_size
A = TypeVar("A")
B = TypeVar("B")


@dataclass
class Pair:
    tier: str
    op: str
    nbytes: int
    ours: list[float] = field(default_factory=list)  # seconds per repeat
    limit: list[float] = field(default_factory=list)

    def add(self, ours_s: float, limit_s: float) -> None:
        self.ours.append(ours_s)
        self.limit.append(limit_s)

    def row(self) -> dict[str, Any]:
        """Medians, the paired ratios (repeat ``k``: limit time / kvmesh time) and every
        repeat's seconds on both sides."""
        gbps = statistics.median(self.nbytes / t / 1e9 for t in self.ours)
        limit = statistics.median(self.nbytes / t / 1e9 for t in self.limit)
        ratios = ratio_summary(paired_ratios(self.limit, self.ours))
        return {
            "tier": self.tier,
            "op": self.op,
            "gbps": round(gbps, 3),
            "limit_gbps": round(limit, 3),
            "ratio": ratios["median"],
            "ratio_p90": ratios["p90"],
            "ratios": ratios["ratios"],
            "bytes": self.nbytes,
            "repeats": len(self.ours),
            "kvmesh_s": [round(t, 6) for t in self.ours],
            "limit_s": [round(t, 6) for t in self.limit],
        }


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class BenchMiss(AssertionError):
    """A store or retrieve inside a timed loop did not do its work."""


def _all_stored(tier: str, got: object, want: int) -> None:
    if got != want:
        raise BenchMiss(f"{tier}: stored {got!r}, expected {want}: the timing would measure a skip")


def _pair_order(r: int, a: Callable[[], A], b: Callable[[], B]) -> tuple[A, B]:
    """Run both, ``a`` first on even rounds and ``b`` first on odd ones; their times in (a, b)."""
    if r % 2 == 0:
        ta = a()
        return ta, b()
    tb = b()
    return a(), tb


class Workload:
    """``n`` chunks of random KV with fresh tokens on every call to :meth:`tokens`."""

    def __init__(self, layout: KVLayout, n_chunks: int) -> None:
        self.layout = layout
        self.n = n_chunks
        self.kv = torch.randn(layout.shape(n_chunks * CHUNK)).to(torch_dtype(layout.dtype))
        self.chunk_bytes = CHUNK * layout.bytes_per_token
        self.nbytes = self.chunk_bytes * n_chunks
        self.contig = [self.kv[:, :, i * CHUNK : (i + 1) * CHUNK].contiguous() for i in range(n_chunks)]
        self.raw = [c.view(torch.uint8).reshape(-1).numpy().data for c in self.contig]
        self._round = 0
        self.keys = KeyBuilder("bench", layout, CHUNK)

    def tokens(self) -> np.ndarray:
        self._round += 1
        rng = np.random.default_rng(self._round)
        return rng.integers(0, 32000, self.n * CHUNK, dtype=np.uint32)

    def chunks(self, toks: np.ndarray) -> tuple[list[Any], list[ChunkData]]:
        keys = self.keys.keys_for_array(toks)
        return keys, [
            ChunkData(k, self.layout, toks[i * CHUNK : (i + 1) * CHUNK], self.raw[i])
            for i, k in enumerate(keys)
        ]


class Slots:
    """Preallocated, already touched destination memory handed to ``Tier.get(into=...)``,
    as the engine hands out its pool slots (the limit reads into preallocated memory too)."""

    def __init__(self, w: Workload) -> None:
        self.buf = np.zeros(w.nbytes, dtype=np.uint8)
        self.size = w.chunk_bytes
        self.next = 0

    def into(self, nbytes: int) -> memoryview:
        start = (self.next % (len(self.buf) // self.size)) * self.size
        self.next += 1
        return self.buf[start : start + nbytes].data


def bench_cpu(w: Workload, repeats: int) -> list[Pair]:
    store, get = Pair("cpu", "store", w.nbytes), Pair("cpu", "retrieve", w.nbytes)
    cfg = CacheConfig(chunk_size=CHUNK, max_local_cpu_size=(w.nbytes + 2 * w.chunk_bytes) / 1024**3)
    engine = CacheEngine(cfg, layout=w.layout, model_id="bench")
    dst = torch.empty_like(w.kv)
    dst.zero_()  # touch the pages once: the limit is a copy into allocated memory
    want = w.n * CHUNK

    def stored(toks: np.ndarray) -> None:
        _all_stored("cpu", engine.store(toks, w.kv), want)

    def retrieved(toks: np.ndarray) -> None:
        n, _ = engine.retrieve(toks, out=dst)
        if n != want:
            raise BenchMiss(f"cpu: retrieved {n} of {want} tokens")

    try:
        for r in range(repeats + 1):  # round 0 is the warm-up (first touch of the pool)
            toks = w.tokens()
            t_store, t_lim1 = _pair_order(
                r, partial(_timed, partial(stored, toks)), partial(_timed, lambda: dst.copy_(w.kv))
            )
            t_get, t_lim2 = _pair_order(
                r, partial(_timed, partial(retrieved, toks)), partial(_timed, lambda: dst.copy_(w.kv))
            )
            engine.clear("cpu")
            if r:  # round 0 is the warm-up
                store.add(t_store, t_lim1)
                get.add(t_get, t_lim2)
    finally:
        engine.close()
    return [store, get]


def _put_one(tier: Tier, keys: list[ChunkKey], chunks: list[ChunkData], i: int) -> None:
    if tier.put([keys[i]], [chunks[i]]) != [True]:
        raise BenchMiss(f"{tier.name}: chunk {i} was not stored")


def _get_one(tier: Tier, keys: list[ChunkKey], dest: Slots, i: int) -> None:
    got = tier.get([keys[i]], into=dest.into)[0]
    if got is None or got.key != keys[i]:
        raise BenchMiss(f"{tier.name}: chunk {i} was not found")


def _drop_file(path: str) -> None:
    """``POSIX_FADV_DONTNEED`` on one file: its (clean) pages leave the page cache."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def bench_disk(w: Workload, repeats: int, directory: str) -> list[Pair]:
    """Against fio with the tier's access pattern (the headline limit: a file per chunk, one
    chunk at a time, cold buffered reads) and a naive file loop (the same bytes as files)."""
    store, get = Pair("disk", "store", w.nbytes), Pair("disk", "retrieve", w.nbytes)
    naive_store = Pair("disk", "store (vs naive loop)", w.nbytes)
    naive_get = Pair("disk", "retrieve (vs naive loop)", w.nbytes)
    fio_dir = os.path.join(directory, "fio")
    os.makedirs(fio_dir, exist_ok=True)

    def fio_write() -> float:
        return fio.run_fio(fio_dir, "write", w.chunk_bytes, w.nbytes, sync="fsync", files=w.n).seconds

    def fio_read() -> float:  # fio drops its files' pages before reading (invalidate=1)
        return fio.run_fio(fio_dir, "read", w.chunk_bytes, w.nbytes, files=w.n).seconds

    dest = Slots(w)
    tier_dir = os.path.join(directory, "tier")
    raw_dir = os.path.join(directory, "raw")
    os.makedirs(raw_dir, exist_ok=True)
    tier = open_tier("file://" + tier_dir, TierOptions(name="disk", chunk_size=CHUNK))
    if not isinstance(tier, DiskTier):
        raise TypeError(f"file:// opened a {type(tier).__name__}, not the disk tier")
    buf = bytearray(w.chunk_bytes)

    # The disk's write speed drifts within seconds here (0.2-1.3 GB/s with fsync), so the
    # two sides are interleaved chunk by chunk, alternating who goes first, and each side's
    # time is summed. The raw side writes new files, as the tier does (rewriting a file in
    # place costs ext4 extra work that is no part of the limit).
    state = {"round": 0}

    def raw_name(i: int) -> str:
        return os.path.join(raw_dir, f"{state['round']}-{i}.bin")

    def raw_write(i: int) -> None:
        with open(raw_name(i), "wb") as f:
            f.write(w.raw[i])
            f.flush()
            os.fsync(f.fileno())

    def raw_read(i: int) -> None:
        with open(raw_name(i), "rb", buffering=0) as f:
            f.readinto(buf)

    def interleaved(ours: Callable[[int], object], raw: Callable[[int], object]) -> tuple[float, float]:
        t_ours = t_raw = 0.0
        for i in range(w.n):
            if i % 2 == 0:
                t_ours += _timed(partial(ours, i))
                t_raw += _timed(partial(raw, i))
            else:
                t_raw += _timed(partial(raw, i))
                t_ours += _timed(partial(ours, i))
        return t_ours, t_raw

    try:
        for r in range(repeats + 1):
            keys, chunks = w.chunks(w.tokens())
            state["round"] = r
            os.sync()
            (t_store, t_lim1), t_fio1 = _pair_order(
                r, partial(interleaved, partial(_put_one, tier, keys, chunks), raw_write), fio_write
            )
            for i, k in enumerate(keys):  # cold reads on every side, each file's own pages
                tier.drop_page_cache(k.text)
                _drop_file(raw_name(i))
            (t_get, t_lim2), t_fio2 = _pair_order(
                r, partial(interleaved, partial(_get_one, tier, keys, dest), raw_read), fio_read
            )
            tier.delete(keys)
            for i in range(w.n):
                os.unlink(raw_name(i))
            os.sync()
            if r:  # round 0 is the warm-up
                store.add(t_store, t_fio1)
                get.add(t_get, t_fio2)
                naive_store.add(t_store, t_lim1)
                naive_get.add(t_get, t_lim2)
    finally:
        tier.close()
    return [store, get, naive_store, naive_get]


def bench_redis(w: Workload, repeats: int, url: str) -> list[Pair]:
    """Against a raw RESP pipeline (:mod:`kvmesh.bench.common.resp`) with the tier's value
    size (its part size) and pipeline depth (every part of the batch at once)."""
    store, get = Pair("redis", "store", w.nbytes), Pair("redis", "retrieve", w.nbytes)
    dest = Slots(w)
    tier = open_tier(url, TierOptions(name="remote", chunk_size=CHUNK, part_bytes=PART))
    raw = resp.RawPipeline(url)
    part = min(PART, w.chunk_bytes)
    names = [b"bench-raw:%d:%d" % (i, j) for i in range(w.n) for j in range(0, w.chunk_bytes, part)]
    values = [bytes(data[j : j + part]) for data in w.raw for j in range(0, w.chunk_bytes, part)]
    sets, set_replies, gets, get_replies = resp.set_get(names, values)

    try:
        for r in range(repeats + 1):
            keys, chunks = w.chunks(w.tokens())

            def put(keys: list[ChunkKey] = keys, chunks: list[ChunkData] = chunks) -> None:
                _all_stored("redis", sum(tier.put(keys, chunks)), len(keys))

            def got(keys: list[ChunkKey] = keys) -> None:
                found = sum(c is not None for c in tier.get(keys, into=dest.into))
                if found != len(keys):
                    raise BenchMiss(f"redis: found {found} of {len(keys)} chunks")

            t_store, t_lim1 = _pair_order(r, partial(_timed, put), partial(raw.timed, sets, set_replies))
            t_get, t_lim2 = _pair_order(r, partial(_timed, got), partial(raw.timed, gets, get_replies))
            tier.delete(keys)
            raw.timed(resp.encode(b"DEL", *names), b":%d\r\n" % len(names))
            if r:  # round 0 is the warm-up
                store.add(t_store, t_lim1)
                get.add(t_get, t_lim2)
    finally:
        tier.close()
        raw.close()
    return [store, get]


@contextlib.contextmanager
def _redis_url(url: str | None) -> Iterator[str | None]:
    if url:
        yield url
    elif RedisServer.available():
        with RedisServer() as server:
            yield server.url
    else:
        yield None


def run(
    layout: str = "llama-8b",
    quick: bool = False,
    json_path: str | None = None,
    plot_path: str | None = None,
    directory: str | None = None,
    redis_url: str | None = None,
    tiers: tuple[str, ...] = ("cpu", "disk", "redis"),
    smoke: bool = False,
    auth: bool = True,
) -> dict[str, Any]:
    # imported here: auth.py builds on this module's Workload and Slots
    from kvmesh.bench.tiers.auth import bench_disk_auth, bench_redis_auth

    prov = provenance("tiers")  # the code this run measures: read now, the tree may move on
    lay = LAYOUTS[layout]
    # The bytes of the earlier 256-token runs: twice the chunks at the shipped 128 tokens.
    n_chunks = (8 if quick else 16) if layout == "llama-8b" else (128 if quick else 512)
    repeats = 3 if quick else 6
    if smoke:  # every code path once (a test): its numbers mean nothing
        n_chunks, repeats = 2, 1
    w = Workload(lay, n_chunks)
    print(
        f"kvmesh bench tiers: layout {layout} ({w.chunk_bytes / 2**20:.1f} MiB/chunk), "
        f"{n_chunks} chunks x {repeats} repeats"
    )
    pairs: list[Pair] = []
    auth_rows: list[dict[str, Any]] = []
    notes: dict[str, Any] = {
        "layout": layout,
        "chunk_tokens": CHUNK,
        "chunk_bytes": w.chunk_bytes,
        "disk_limit": "fio: "
        + " ".join(fio.fio_command("DIR", "read", w.chunk_bytes, w.nbytes, files=n_chunks)),
        "page_cache": "each file's pages dropped before it is read, on both sides (cold reads)",
    }
    if "cpu" in tiers:
        pairs += bench_cpu(w, repeats)
    if "disk" in tiers and not fio.available():
        notes["disk"] = "skipped: fio is not installed (apt-get install -y fio)"
    elif "disk" in tiers:
        base = directory or os.path.join(os.getcwd(), ".cache")
        os.makedirs(base, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix="bench-disk-", dir=base)
        try:
            pairs += bench_disk(w, repeats, tmp)
            if auth:
                auth_rows += bench_disk_auth(w, repeats, tmp, CHUNK)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    if "redis" in tiers:
        with _redis_url(redis_url) as url:
            if url is None:
                notes["redis"] = "skipped: redis-server is not installed"
            else:
                pairs += bench_redis(w, repeats, url)
                notes["redis_limit"] = (
                    f"raw RESP pipeline, 1 connection: SET / GET of the tier's parts (<= {PART} B) at once"
                )
                if auth:
                    auth_rows += bench_redis_auth(w, repeats, url, CHUNK, PART)
    results = [p.row() for p in pairs]
    out = {"results": results, "auth": auth_rows, "config": notes}
    print_table(results, ["tier", "op", "gbps", "limit_gbps", "ratio"])
    if auth_rows:
        print("\nfleet key cost (ratio = unauthenticated time / this time, paired per round):")
        print_table(auth_rows, ["tier", "op", "auth", "gbps", "ratio", "target", "meets"])
    if json_path:
        write_json(json_path, out, prov)
    if plot_path:
        write_plot(
            plot_path,
            labels=[f"{r['tier']}\n{r['op']}" for r in results],
            series={
                "kvmesh": [r["gbps"] for r in results],
                "physical limit": [r["limit_gbps"] for r in results],
            },
            ylabel="GB/s",
            title=f"kvmesh tiers vs physical limits ({layout}, {CHUNK}-token chunks)",
            annotations=[f"{r['ratio']:.2f}x" for r in results],
        )
    return out
