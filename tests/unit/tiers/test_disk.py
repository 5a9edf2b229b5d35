"""DiskTier against real files: round trips, LRU within the byte budget, pins, restarts,
corruption, O_DIRECT, the I/O trace, a full disk and SIGKILL in the middle of writes."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

import kvmesh
from kvmesh.core import serde
from kvmesh.core.keys import ChunkKey, KeyBuilder, KVLayout
from kvmesh.errors import TierUnavailableError
from kvmesh.metrics import TierMetrics
from kvmesh.tiers.base import ChunkData, Tier, TierOptions, open_tier, recode
from kvmesh.tiers.disk import SUFFIX, TMP_SUFFIX, DiskTier
from kvmesh.tiers.diskfiles import IO_THREADS

LAYOUT = KVLayout(2, 2, 8, "float32")
CHUNK = 16
KB = KeyBuilder("m", LAYOUT, chunk_size=CHUNK)


def make_chunks(n: int, seed: int = 0, layout: KVLayout = LAYOUT) -> list[ChunkData]:
    """``n`` chunks of one prompt; KV is float32 noise (compressible by the zstd codec)."""
    kb = KB if layout is LAYOUT else KeyBuilder("m", layout, chunk_size=CHUNK)
    tokens = np.arange(seed * 1_000_000, seed * 1_000_000 + n * CHUNK, dtype=np.uint32)
    rng = np.random.default_rng(seed)
    out = []
    for i, key in enumerate(kb.keys(tokens)):
        kv = rng.standard_normal(CHUNK * layout.bytes_per_token // 4).astype(np.float32)
        out.append(ChunkData(key, layout, tokens[i * CHUNK : (i + 1) * CHUNK], bytearray(kv.tobytes())))
    return out


def opts(**kw: object) -> TierOptions:
    o = TierOptions(name="disk", metrics=TierMetrics("disk"))
    for k, v in kw.items():
        setattr(o, k, v)
    return o


def put(tier: DiskTier, chunks: list[ChunkData]) -> list[bool]:
    return tier.put([c.key for c in chunks], chunks)


def assert_same(got: ChunkData | None, want: ChunkData) -> None:
    assert got is not None, f"miss for {want.key}"
    assert got.key == want.key
    assert bytes(got.data) == bytes(want.data)
    assert np.array_equal(got.tokens, want.tokens)
    assert got.layout == want.layout


def files(root: Path, suffix: str = SUFFIX) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.name.endswith(suffix))


def file_of(root: Path, key: ChunkKey) -> Path:
    (path,) = [p for p in files(root) if p.name == key.text + SUFFIX]
    return path


def chunk_size_on_disk(codec: str = "raw") -> int:
    c = make_chunks(1)[0]
    head, body = serde.encode(c.key, c.layout, c.tokens, c.data, codec)
    return len(head) + memoryview(body).nbytes


@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_round_trip(tmp_path: Path, codec: str) -> None:
    tier = DiskTier(str(tmp_path), opts(codec=codec))
    chunks = make_chunks(4)
    assert put(tier, chunks) == [True] * 4
    got = tier.get([c.key for c in chunks])
    for g, c in zip(got, chunks, strict=True):
        assert_same(g, c)
        assert g is not None and g.codec == codec and g.stored_bytes > 0
    assert tier.contains([c.key for c in chunks]) == [True] * 4
    assert tier.get([make_chunks(1, seed=9)[0].key]) == [None]
    snap = tier.metrics.snapshot()
    assert snap["hits"] == 4 and snap["misses"] == 1 and snap["stores"] == 4
    assert snap["objects"] == 4 and snap["bytes_used"] == tier.size_bytes()
    assert tier.size_bytes() == sum(p.stat().st_size for p in files(tmp_path))
    assert snap["bytes_out"] == tier.size_bytes() == snap["bytes_in"]
    raw_bytes = 4 * (chunk_size_on_disk("raw"))
    if codec == "zstd":
        assert tier.size_bytes() < raw_bytes
    else:
        assert tier.size_bytes() == raw_bytes
    assert snap["latency"]["get"]["count"] == 2 and snap["latency"]["put"]["count"] == 1


def test_open_by_url_and_keys(tmp_path: Path) -> None:
    tier = open_tier(f"file://{tmp_path}/cache", opts())
    assert isinstance(tier, DiskTier) and isinstance(tier, Tier)
    chunks = make_chunks(3)
    put(tier, chunks)
    assert sorted(tier.keys()) == sorted(c.key.text for c in chunks)
    # 2-hex subdirectories keep the top directory small.
    assert all(len(p.parent.name) == 2 for p in files(tmp_path / "cache"))


def test_lru_eviction_order_within_budget(tmp_path: Path) -> None:
    size = chunk_size_on_disk()
    tier = DiskTier(str(tmp_path), opts(capacity_bytes=3 * size + size // 2))
    a, b, c, d, e = make_chunks(5)
    put(tier, [a, b, c])
    tier.get([a.key])  # a becomes most recently used; b is now the oldest
    assert put(tier, [d]) == [True]
    assert tier.contains([a.key, b.key, c.key, d.key]) == [True, False, True, True]
    assert put(tier, [e]) == [True]  # evicts c
    assert tier.contains([a.key, c.key, d.key, e.key]) == [True, False, True, True]
    assert tier.metrics.counters["evictions"] == 2
    assert tier.size_bytes() == 3 * size == sum(p.stat().st_size for p in files(tmp_path))
    assert tier.metrics.gauges["objects"] == 3
    assert len(files(tmp_path)) == 3


def test_chunk_larger_than_budget_is_skipped(tmp_path: Path) -> None:
    tier = DiskTier(str(tmp_path), opts(capacity_bytes=chunk_size_on_disk() - 1))
    (a,) = make_chunks(1)
    assert put(tier, [a]) == [False]
    assert tier.metrics.counters["skipped_stores"] == 1 and files(tmp_path) == []


def test_put_keeps_no_reference_to_the_callers_buffer(tmp_path: Path) -> None:
    tier = DiskTier(str(tmp_path), opts(o_direct=True))
    (a,) = make_chunks(1)
    want = bytes(a.data)
    put(tier, [a])
    assert isinstance(a.data, bytearray)
    a.data[:] = bytes(len(a.data))  # the caller reuses its buffer at once
    got = tier.get([a.key])[0]
    assert got is not None and bytes(got.data) == want


def test_put_of_present_key_refreshes_lru_without_rewrite(tmp_path: Path) -> None:
    size = chunk_size_on_disk()
    tier = DiskTier(str(tmp_path), opts(capacity_bytes=2 * size))
    a, b, c = make_chunks(3)
    put(tier, [a, b])
    inode = file_of(tmp_path, a.key).stat().st_ino
    assert put(tier, [a]) == [True]
    assert file_of(tmp_path, a.key).stat().st_ino == inode
    assert tier.metrics.counters["stores"] == 2
    put(tier, [c])
    assert tier.contains([a.key, b.key, c.key]) == [True, False, True]


def test_pinned_never_evicted(tmp_path: Path) -> None:
    size = chunk_size_on_disk()
    tier = DiskTier(str(tmp_path), opts(capacity_bytes=2 * size))
    a, b, c, d, e = make_chunks(5)
    put(tier, [a, b])
    tier.pin([a.key, c.key])  # c is absent: its pin applies when it arrives
    assert put(tier, [c]) == [True]  # evicts b, the only unpinned chunk
    assert tier.contains([a.key, b.key, c.key]) == [True, False, True]
    assert put(tier, [d]) == [False]  # everything is pinned: the store is skipped
    assert tier.metrics.counters["skipped_stores"] == 1
    # Pins are counted: two pins need two unpins.
    tier.pin([a.key])
    tier.unpin([a.key])
    assert put(tier, [d]) == [False]
    tier.unpin([a.key, a.key, b.key])  # an unpin without a pin is a no-op
    assert not tier.is_pinned(a.key) and tier.is_pinned(c.key)
    assert put(tier, [d]) == [True]
    assert tier.contains([a.key, c.key, d.key]) == [False, True, True]
    tier.unpin([c.key])
    assert put(tier, [e]) == [True]  # c, unpinned last, re-entered recency as the newest
    assert tier.contains([c.key, d.key, e.key]) == [True, False, True]


def test_delete_and_clear_respect_pins(tmp_path: Path) -> None:
    tier = DiskTier(str(tmp_path), opts())
    chunks = make_chunks(4)
    put(tier, chunks)
    tier.pin([chunks[0].key, chunks[1].key])
    assert tier.delete([chunks[0].key, chunks[2].key]) == 1
    assert tier.delete([chunks[0].key], force=True) == 1
    assert tier.clear() == 1  # chunks[3]; chunks[1] is pinned
    assert list(tier.keys()) == [chunks[1].key.text]
    assert tier.clear(force=True) == 1
    assert files(tmp_path) == [] and tier.size_bytes() == 0
    assert tier.metrics.gauges["objects"] == 0 and tier.metrics.counters["deletes"] == 4


def test_restart_keeps_every_chunk(tmp_path: Path) -> None:
    tier = DiskTier(str(tmp_path), opts(codec="zstd"))
    chunks = make_chunks(20)
    put(tier, chunks)
    used = tier.size_bytes()
    tier.close()
    with pytest.raises(TierUnavailableError):
        tier.get([chunks[0].key])
    again = DiskTier(str(tmp_path), opts(codec="raw"))
    assert again.metrics.counters["corrupt"] == 0
    assert sorted(again.keys()) == sorted(c.key.text for c in chunks)
    assert again.size_bytes() == used
    assert again.metrics.gauges["objects"] == 20
    for g, c in zip(again.get([c.key for c in chunks]), chunks, strict=True):
        assert_same(g, c)
        assert g is not None and g.codec == "zstd"


def test_restart_keeps_lru_order_and_applies_smaller_budget(tmp_path: Path) -> None:
    size = chunk_size_on_disk()
    tier = DiskTier(str(tmp_path), opts())
    chunks = make_chunks(6)
    put(tier, chunks)
    tier.get([chunks[0].key, chunks[1].key])  # the two oldest become the most recent
    tier.close()
    again = DiskTier(str(tmp_path), opts(capacity_bytes=3 * size))
    assert again.metrics.counters["evictions"] == 3
    want = {chunks[0].key.text, chunks[1].key.text, chunks[5].key.text}
    assert set(again.keys()) == want
    assert len(files(tmp_path)) == 3


CORRUPTIONS: dict[str, Callable[[Path], None]] = {}


def _corruption(fn: Callable[[Path], None]) -> Callable[[Path], None]:
    CORRUPTIONS[fn.__name__] = fn
    return fn


@_corruption
def flip_payload_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(data)


@_corruption
def truncate_payload(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 100)


@_corruption
def garbage_header(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[:64] = os.urandom(64)
    path.write_bytes(data)


@_corruption
def header_json_changed(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data.replace(b'"codec":"raw"', b'"codec":"raz"', 1))


@_corruption
def other_chunk_under_this_name(path: Path) -> None:
    other = make_chunks(1, seed=7)[0]
    path.write_bytes(serde.encode_bytes(other.key, other.layout, other.tokens, other.data))


@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
def test_corrupt_file_is_a_miss_and_deleted(tmp_path: Path, name: str) -> None:
    tier = DiskTier(str(tmp_path), opts())
    a, b = make_chunks(2)
    put(tier, [a, b])
    path = file_of(tmp_path, a.key)
    CORRUPTIONS[name](path)
    assert tier.get([a.key, b.key])[0] is None
    assert not path.exists()
    assert tier.contains([a.key, b.key]) == [False, True]
    snap = tier.metrics.snapshot()
    assert snap["corrupt"] == 1 and snap["misses"] == 1 and snap["hits"] == 1
    assert snap["objects"] == 1 and tier.size_bytes() == file_of(tmp_path, b.key).stat().st_size
    assert put(tier, [a]) == [True]  # the chunk can be stored again
    assert_same(tier.get([a.key])[0], a)


@pytest.mark.parametrize("name", ["truncate_payload", "garbage_header", "header_json_changed"])
def test_corrupt_file_is_dropped_at_start(tmp_path: Path, name: str) -> None:
    tier = DiskTier(str(tmp_path), opts())
    a, b = make_chunks(2)
    put(tier, [a, b])
    tier.close()
    path = file_of(tmp_path, a.key)
    CORRUPTIONS[name](path)
    again = DiskTier(str(tmp_path), opts())
    assert again.metrics.counters["corrupt"] == 1
    assert not path.exists()
    assert list(again.keys()) == [b.key.text]
    assert_same(again.get([b.key])[0], b)


def test_file_deleted_underneath_is_a_miss(tmp_path: Path) -> None:
    tier = DiskTier(str(tmp_path), opts())
    a, b = make_chunks(2)
    put(tier, [a, b])
    file_of(tmp_path, a.key).unlink()
    assert tier.get([a.key]) == [None]
    assert tier.contains([a.key]) == [False]
    assert tier.metrics.counters["corrupt"] == 0
    assert tier.size_bytes() == file_of(tmp_path, b.key).stat().st_size


def test_temp_leftovers_removed_at_start(tmp_path: Path) -> None:
    tier = DiskTier(str(tmp_path), opts())
    (a,) = make_chunks(1)
    put(tier, [a])
    tier.close()
    final = file_of(tmp_path, a.key)
    leftover = final.parent / (final.name + ".123.0" + TMP_SUFFIX)
    leftover.write_bytes(final.read_bytes()[:50])
    (tmp_path / "ab").mkdir(exist_ok=True)
    other = tmp_path / "ab" / ("x" + SUFFIX + ".9.9" + TMP_SUFFIX)
    other.write_bytes(b"partial")
    foreign = tmp_path / "README"
    foreign.write_text("not ours")
    again = DiskTier(str(tmp_path), opts())
    assert not leftover.exists() and not other.exists()
    assert foreign.exists()  # files that are not chunks are left alone
    assert list(again.keys()) == [a.key.text]
    assert again.metrics.counters["corrupt"] == 0


def test_o_direct_round_trip(tmp_path: Path) -> None:
    tier = DiskTier(str(tmp_path), opts(o_direct=True, codec="zstd"))
    chunks = make_chunks(5)
    assert put(tier, chunks) == [True] * 5
    assert tier.o_direct  # ext4 takes O_DIRECT: no fallback happened
    for g, c in zip(tier.get([c.key for c in chunks]), chunks, strict=True):
        assert_same(g, c)
    sizes = [p.stat().st_size for p in files(tmp_path)]
    assert all(s % 4096 == 0 for s in sizes)
    assert tier.size_bytes() == sum(sizes)
    tier.close()
    again = DiskTier(str(tmp_path), opts())  # padded files restart fine with buffered reads
    assert again.metrics.counters["corrupt"] == 0
    for g, c in zip(again.get([c.key for c in chunks]), chunks, strict=True):
        assert_same(g, c)


def test_o_direct_refused_falls_back_with_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_open = os.open

    def no_direct(path: str, flags: int, mode: int = 0o777) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, mode)

    monkeypatch.setattr(os, "open", no_direct)
    tier = DiskTier(str(tmp_path), opts(o_direct=True))
    (a,) = make_chunks(1)
    with pytest.warns(RuntimeWarning, match="O_DIRECT"):
        assert put(tier, [a]) == [True]
    assert not tier.o_direct
    assert_same(tier.get([a.key])[0], a)
    assert files(tmp_path, TMP_SUFFIX) == []


def test_io_trace(tmp_path: Path) -> None:
    trace = tmp_path / "io.jsonl"
    tier = DiskTier(str(tmp_path / "d"), opts(io_trace=str(trace)))
    chunks = make_chunks(8)
    put(tier, chunks)

    def reader() -> None:
        tier.get([c.key for c in chunks])

    threads = [threading.Thread(target=reader) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tier.delete([chunks[0].key])
    tier.close()
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    ops = [r["op"] for r in lines]
    assert ops.count("write") == 8 and ops.count("fsync") == 8 and ops.count("fsync_dir") == 8
    assert ops.count("read") == 32 and ops.count("delete") == 1
    for r in lines:
        assert set(r) >= {"op", "key", "bytes", "start", "end", "queue_depth"}
        assert r["start"] <= r["end"]
        assert 0 <= r["queue_depth"] < IO_THREADS  # reads go on the tier's I/O threads
    size = tier.size_bytes() // 7
    assert all(r["bytes"] == size for r in lines if r["op"] in ("write", "read", "delete"))
    assert {r["key"] for r in lines} == {c.key.text for c in chunks}


def _enospc(monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, data: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)


def test_disk_full_simulated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A filesystem that stays full whatever is freed (someone else's files fill it): the
    store evicts the least recently used chunk to make room, is refused again, and is skipped
    as ``full``; nothing half written is left, and what is pinned stays."""
    tier = DiskTier(str(tmp_path), opts())
    a, b, c = make_chunks(3)
    put(tier, [a, b])
    tier.pin([a.key])
    with monkeypatch.context() as m:
        _enospc(m)
        assert put(tier, [c]) == [False]
    assert tier.metrics.snapshot()["skipped_by_reason"] == {"full": 1}
    assert tier.metrics.counters["errors"] == 0
    assert tier.metrics.counters["evictions"] == 1
    assert tier.health() == "degraded"
    assert tier.contains([a.key, b.key, c.key]) == [True, False, False]  # b went for room; a is pinned
    assert files(tmp_path, TMP_SUFFIX) == []
    assert tier.size_bytes() == sum(p.stat().st_size for p in files(tmp_path))
    assert_same(tier.get([a.key])[0], a)
    assert put(tier, [c]) == [True]  # space is back: writes go on and health recovers
    assert tier.health() == "up"
    assert_same(tier.get([c.key])[0], c)


@contextlib.contextmanager
def tiny_filesystem(path: Path) -> Iterator[bool]:
    """Mount a real 2 MiB tmpfs at ``path``; yields whether that worked (it needs root)."""
    path.mkdir()
    cmd = ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(path)]
    mounted = os.geteuid() == 0 and subprocess.run(cmd, capture_output=True).returncode == 0
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], check=True)


def test_disk_full_real_filesystem(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A real 2 MiB filesystem under a budget of 1 GB: said at open; once full, each new chunk
    evicts the least recently used and lands, so the tier keeps the newest chunks (it used to
    refuse every new one and keep the oldest for ever), said once."""
    big = KVLayout(4, 8, 32, "float32")  # 128 KiB chunks: about 15 fill 2 MiB
    chunks = make_chunks(40, layout=big)
    with tiny_filesystem(tmp_path / "small") as mounted:
        if not mounted:
            pytest.skip("mounting a tmpfs needs root (test_disk_full_simulated runs everywhere)")
        with caplog.at_level("WARNING", logger="kvmesh.tiers.disk"):
            tier = DiskTier(str(tmp_path / "small"), opts(capacity_bytes=1 << 30))
            results = put(tier, chunks)
        assert results == [True] * 40
        said = [r.getMessage() for r in caplog.records]
        assert len(said) == 2 and "max_local_disk_size is 1.0 GiB" in said[0], said
        assert "evicted to make room" in said[1]
        snap = tier.metrics.snapshot()
        assert snap["skipped_stores"] == 0 and snap["errors"] == 0
        assert 20 <= snap["evictions"] <= 35
        kept = tier.contains([c.key for c in chunks])
        assert kept == sorted(kept)  # the oldest went, the newest stayed
        assert kept[-1] and not kept[0]
        assert files(tmp_path / "small", TMP_SUFFIX) == []
        assert tier.size_bytes() == sum(p.stat().st_size for p in files(tmp_path / "small"))
        assert_same(tier.get([chunks[-1].key])[0], chunks[-1])
        assert tier.health() == "up"
        tier.close()


def test_recode(tmp_path: Path) -> None:
    tier = DiskTier(str(tmp_path), opts())
    chunks = make_chunks(4)
    put(tier, chunks)
    tier.pin([chunks[0].key])
    before, after = recode(tier, [c.key for c in chunks[:3]], "zstd")
    assert before == 3 * chunk_size_on_disk() and after < before
    assert tier.size_bytes() == after + chunk_size_on_disk()
    assert tier.size_bytes() == sum(p.stat().st_size for p in files(tmp_path))
    got = tier.get([c.key for c in chunks])
    assert [g.codec for g in got if g is not None] == ["zstd", "zstd", "zstd", "raw"]
    for g, c in zip(got, chunks, strict=True):
        assert_same(g, c)
    assert tier.is_pinned(chunks[0].key)  # recoding kept the pin
    size0 = file_of(tmp_path, chunks[0].key).stat().st_size
    assert recode(tier, [c.key for c in chunks[:1]], "zstd") == (size0, size0)  # already zstd
    assert files(tmp_path, TMP_SUFFIX) == []


def test_concurrent_puts_and_gets(tmp_path: Path) -> None:
    size = chunk_size_on_disk()
    tier = DiskTier(str(tmp_path), opts(capacity_bytes=10 * size))
    chunks = make_chunks(40)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rnd = random.Random(seed)
        try:
            for _ in range(60):
                c = rnd.choice(chunks)
                if rnd.random() < 0.5:
                    put(tier, [c])
                else:
                    g = tier.get([c.key])[0]
                    if g is not None:
                        assert_same(g, c)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert tier.size_bytes() <= 10 * size
    assert tier.size_bytes() == sum(p.stat().st_size for p in files(tmp_path))
    assert sorted(tier.keys()) == sorted(p.name[: -len(SUFFIX)] for p in files(tmp_path))
    assert files(tmp_path, TMP_SUFFIX) == []


# Run by the writer subprocess and by the test itself, so both agree on keys and bytes.
KILL_SETUP = """
import numpy as np
from kvmesh.core.keys import KeyBuilder, KVLayout
layout = KVLayout(4, 8, 32, "float32")
N = 4000
tokens = np.arange(16 * N, dtype=np.uint32)
keys = KeyBuilder("kill", layout, chunk_size=16).keys(tokens)
def payload(j):
    return np.random.default_rng(j).bytes(16 * layout.bytes_per_token)
"""
# The writer skips kvmesh/__init__ (it imports the engine, and with it torch: seconds per
# start), loading only the package's modules the disk tier needs.
KILL_WRITER = (
    f"""
import sys, types
pkg = types.ModuleType("kvmesh")
pkg.__path__ = [{str(Path(kvmesh.__file__).parent)!r}]
sys.modules["kvmesh"] = pkg
"""
    + KILL_SETUP
    + """
from kvmesh.tiers.base import ChunkData, TierOptions
from kvmesh.tiers.disk import DiskTier
tier = DiskTier(sys.argv[1], TierOptions(o_direct=sys.argv[3] == "1", codec=sys.argv[4]))
print("ready", flush=True)
for j in range(int(sys.argv[2]), N):
    chunk = ChunkData(keys[j], layout, tokens[16 * j : 16 * (j + 1)], payload(j))
    if tier.put([keys[j]], [chunk]) == [True]:
        print(j, flush=True)
"""
)


def test_sigkill_mid_write_never_yields_wrong_data(tmp_path: Path) -> None:
    ns: dict[str, object] = {}
    exec(KILL_SETUP, ns)
    keys: list[ChunkKey] = ns["keys"]  # type: ignore[assignment]
    payload: Callable[[int], bytes] = ns["payload"]  # type: ignore[assignment]
    index = {k.text: j for j, k in enumerate(keys)}
    root = tmp_path / "cache"
    rnd = random.Random()
    acked: set[int] = set()
    start = 0
    for round_ in range(5):
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                KILL_WRITER,
                str(root),
                str(start),
                str(round_ % 2),
                ["raw", "zstd"][round_ % 3 == 2],
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(rnd.uniform(0.05, 0.35))
        os.kill(proc.pid, signal.SIGKILL)
        out = proc.stdout.read().split()
        proc.wait()
        assert proc.returncode == -signal.SIGKILL
        acked.update(int(x) for x in out)
        start = max(acked, default=-1) + 1

        tier = DiskTier(str(root), opts())
        assert files(root, TMP_SUFFIX) == []
        assert tier.metrics.counters["corrupt"] == 0
        present = set(tier.keys())
        assert {keys[j].text for j in acked} <= present  # acknowledged writes survive
        got = tier.get([keys[index[t]] for t in present])
        for text, g in zip(present, got, strict=True):
            assert g is not None and bytes(g.data) == payload(index[text])
        tier.close()
    assert len(acked) > 0


def test_a_large_chunk_starts_its_writeback_piece_by_piece(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk file larger than a piece has each full piece's writeback started as it is
    written (the file's fsync still makes it durable); a small chunk starts none; a refused
    start changes nothing."""
    import kvmesh.tiers.diskfiles as diskfiles

    started: list[tuple[int, int]] = []

    def start(fd: int, off: int, length: int) -> bool:
        started.append((off, length))
        return False  # as where the call is missing

    monkeypatch.setattr(diskfiles, "start_writeback", start)
    monkeypatch.setattr(diskfiles, "WRITEBACK_PIECE", 4096)
    tier = DiskTier(str(tmp_path), opts())
    (big,) = make_chunks(1, layout=KVLayout(2, 2, 64, "float32"))
    body = len(big.data)
    assert body > 3 * 4096
    assert put(tier, [big]) == [True]
    head = os.path.getsize(file_of(tmp_path, big.key)) - body
    # every full piece but one ending the body started, at its file offset; the rest is
    # left to the fsync
    want = [(head + at, 4096) for at in range(0, body - 4096, 4096)]
    assert started == want and len(want) >= 3
    started.clear()
    (small,) = make_chunks(1, seed=1)  # 512 B of KV: under one piece
    assert put(tier, [small]) == [True]
    assert started == []
    assert_same(tier.get([big.key])[0], big)
    assert_same(tier.get([small.key])[0], small)
    tier.close()
