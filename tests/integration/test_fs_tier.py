"""FsTier on real files, including several OS processes sharing one directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kvmesh.core import serde
from kvmesh.core.keys import ChunkKey, KeyBuilder, KVLayout
from kvmesh.metrics import TierMetrics
from kvmesh.tiers.base import ChunkData, TierOptions, open_tier, recode
from kvmesh.tiers.fs import FsTier
from kvmesh.tiers.testing import random_chunks

LAYOUT = KVLayout(2, 2, 8, "float32")
KB = KeyBuilder("m", LAYOUT, chunk_size=16)
REPO = Path(__file__).resolve().parents[2]


def payload(key: ChunkKey, layout: KVLayout) -> bytes:
    """Deterministic per key; values that fit float16, so the zstd plane codec compresses."""
    rng = np.random.default_rng(int(key.prefix_hash[:16], 16))
    n = key.num_tokens * layout.bytes_per_token // 4
    return rng.standard_normal(n, dtype=np.float32).astype(np.float16).astype(np.float32).tobytes()


def make_chunks(n: int, start: int = 0) -> tuple[list[ChunkKey], list[ChunkData]]:
    tokens = np.arange(start, start + n * KB.chunk_size, dtype=np.uint32)
    keys = KB.keys(tokens)
    chunks = [
        ChunkData(k, LAYOUT, tokens[i * KB.chunk_size : (i + 1) * KB.chunk_size], payload(k, LAYOUT))
        for i, k in enumerate(keys)
    ]
    return keys, chunks


def assert_same(got: ChunkData | None, want: ChunkData) -> None:
    assert got is not None
    assert got.key == want.key
    assert bytes(got.data) == bytes(want.data)
    assert np.array_equal(got.tokens, want.tokens)


@pytest.fixture
def open_fs(tmp_path: Path) -> Callable[..., FsTier]:
    def factory(root: Path | None = None, **opts: object) -> FsTier:
        tier = open_tier(
            f"fs://{root or tmp_path / 'shared'}", TierOptions(metrics=TierMetrics("fs"), **opts)
        )
        assert isinstance(tier, FsTier)
        return tier

    return factory


@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_round_trip(open_fs, codec) -> None:
    tier = open_fs(codec=codec)
    keys, chunks = make_chunks(4)
    assert tier.contains(keys) == [False] * 4
    assert tier.put(keys[:3], chunks[:3]) == [True] * 3
    assert tier.contains(keys) == [True, True, True, False]
    got = tier.get(keys)
    assert got[3] is None
    for g, c in zip(got[:3], chunks[:3], strict=True):
        assert_same(g, c)
        assert g is not None and g.codec == codec and g.stored_bytes == os.path.getsize(tier.path(c.key))
    assert sorted(tier.keys()) == sorted(k.text for k in keys[:3])
    assert tier.health() == "up"
    snap = tier.metrics.snapshot()
    assert (snap["hits"], snap["misses"], snap["stores"], snap["corrupt"]) == (3, 1, 3, 0)


def test_other_instance_sees_writes_without_an_index(open_fs) -> None:
    a, b = open_fs(), open_fs()
    keys, chunks = make_chunks(2)
    assert b.contains(keys) == [False, False]
    assert all(a.put(keys, chunks))
    assert b.contains(keys) == [True, True]
    assert_same(b.get(keys)[0], chunks[0])
    assert a.delete(keys[:1]) == 1
    assert b.contains(keys) == [False, True]
    assert b.get(keys)[0] is None


def test_flipped_byte_is_a_counted_miss(open_fs) -> None:
    tier = open_fs()
    keys, chunks = make_chunks(2)
    assert all(tier.put(keys, chunks))
    path = tier.path(keys[0])
    blob = bytearray(Path(path).read_bytes())
    blob[-10] ^= 0x40
    Path(path).write_bytes(bytes(blob))
    got = tier.get(keys)
    assert got[0] is None
    assert_same(got[1], chunks[1])
    assert tier.metrics.snapshot()["corrupt"] == 1
    assert not os.path.exists(path)


@pytest.mark.parametrize("cut", [5, 40, -1])
def test_truncated_file_never_produces_data(open_fs, cut) -> None:
    tier = open_fs()
    keys, chunks = make_chunks(1)
    head, body = serde.encode(keys[0], LAYOUT, chunks[0].tokens, chunks[0].data)
    os.makedirs(os.path.dirname(tier.path(keys[0])), exist_ok=True)
    Path(tier.path(keys[0])).write_bytes((head + bytes(body))[:cut])
    assert tier.contains(keys) == [True]
    assert tier.get(keys) == [None]
    assert tier.metrics.snapshot()["corrupt"] == 1
    assert tier.contains(keys) == [False]


def test_chunk_under_the_wrong_name_is_a_miss(open_fs) -> None:
    tier = open_fs()
    keys, chunks = make_chunks(2)
    assert all(tier.put(keys[:1], chunks[:1]))
    os.makedirs(os.path.dirname(tier.path(keys[1])), exist_ok=True)
    os.replace(tier.path(keys[0]), tier.path(keys[1]))
    assert tier.get(keys) == [None, None]
    assert tier.metrics.snapshot()["corrupt"] == 1


def test_leftover_temp_files_are_ignored(open_fs) -> None:
    tier = open_fs()
    keys, chunks = make_chunks(2)
    assert all(tier.put(keys, chunks))
    d = os.path.dirname(tier.path(keys[0]))
    # What a writer killed before its rename leaves behind: one old, one fresh.
    stale = os.path.join(d, f".{keys[0].text}.999.deadbeef.tmp")
    fresh = os.path.join(d, f".{keys[1].text}.998.cafe.tmp")
    for p in (stale, fresh):
        Path(p).write_bytes(b"KVMC partial")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    foreign = os.path.join(tier.root, "README")
    Path(foreign).write_text("not ours")
    assert sorted(tier.keys()) == sorted(k.text for k in keys)
    for g, c in zip(tier.get(keys), chunks, strict=True):
        assert_same(g, c)
    assert tier.clear() == 2
    assert list(tier.keys()) == []
    assert not os.path.exists(stale)  # a dead writer's leftover
    assert os.path.exists(fresh)  # may still be renamed by a live writer
    assert os.path.exists(foreign)
    assert tier.metrics.snapshot()["corrupt"] == 0


def test_recode(open_fs) -> None:
    tier = open_fs()
    keys, chunks = make_chunks(3)
    assert all(tier.put(keys[:2], chunks[:2]))
    before, after = recode(tier, keys, "zstd")
    assert 0 < after < before
    for g, c in zip(tier.get(keys[:2]), chunks[:2], strict=True):
        assert_same(g, c)
        assert g is not None and g.codec == "zstd"
    assert recode(tier, keys, "zstd") == (after, after)


def test_missing_directory_is_down_not_an_error(tmp_path: Path, open_fs) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    tier = open_fs(root=blocker / "sub")  # cannot be created: a file is in the way
    keys, chunks = make_chunks(1)
    assert tier.health() == "down"
    assert tier.contains(keys) == [False]
    assert tier.get(keys) == [None]
    assert tier.put(keys, chunks) == [False]
    assert tier.metrics.snapshot()["skipped_by_reason"] == {"io_error": 1}  # counted, with why
    assert list(tier.keys()) == [] and tier.clear() == 0


# A writer or reader process. Writers rewrite every key over and over, alternating codecs,
# so files are replaced under the reader's feet; the reader checks every hit bit for bit.
_WORKER = r"""
import json, sys, time, os, types
# Only the tier modules are under test: skip the package root's imports (the engine, torch),
# which would cost seconds per process.
_pkg = types.ModuleType("kvmesh")
_pkg.__path__ = [os.path.join(os.getcwd(), "kvmesh")]
sys.modules["kvmesh"] = _pkg
import numpy as np
from kvmesh.core.keys import KeyBuilder, KVLayout
from kvmesh.metrics import TierMetrics
from kvmesh.tiers.base import ChunkData, TierOptions, open_tier

role, root, n, go, stop = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
layout = KVLayout(2, 2, 8, "float32")
kb = KeyBuilder("m", layout, chunk_size=16)
tokens = np.arange(0, n * 16, dtype=np.uint32)
keys = kb.keys(tokens)

def payload(key):
    rng = np.random.default_rng(int(key.prefix_hash[:16], 16))
    x = rng.standard_normal(key.num_tokens * layout.bytes_per_token // 4, dtype=np.float32)
    return x.astype(np.float16).astype(np.float32).tobytes()

want = {k.text: payload(k) for k in keys}
tiers = {c: open_tier("fs://" + root, TierOptions(codec=c, metrics=TierMetrics(c))) for c in ("raw", "zstd")}
print("ready", flush=True)
while not os.path.exists(go):
    time.sleep(0.01)
stats = {"rounds": 0, "hits": 0, "misses": 0, "bad": 0}
while not os.path.exists(stop):
    if role == "writer":
        tier = tiers["raw" if stats["rounds"] % 2 else "zstd"]
        chunks = [ChunkData(k, layout, tokens[i * 16:(i + 1) * 16], want[k.text]) for i, k in enumerate(keys)]
        assert all(tier.put(keys, chunks))
    else:
        for k, got in zip(keys, tiers["raw"].get(keys)):
            if got is None:
                stats["misses"] += 1
            elif bytes(got.data) != want[k.text] or list(got.tokens) != list(range(
                    kb.chunk_size * keys.index(k), kb.chunk_size * (keys.index(k) + 1))):
                stats["bad"] += 1
            else:
                stats["hits"] += 1
    stats["rounds"] += 1
stats["corrupt"] = sum(t.metrics.snapshot()["corrupt"] for t in tiers.values())
stats["errors"] = sum(t.metrics.snapshot()["errors"] for t in tiers.values())
print(json.dumps(stats), flush=True)
"""


def test_processes_share_a_directory(tmp_path: Path) -> None:
    root = tmp_path / "shared"
    go, stop = tmp_path / "go", tmp_path / "stop"
    env = dict(os.environ, PYTHONPATH=str(REPO))

    def spawn(role: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-c", _WORKER, role, str(root), "8", str(go), str(stop)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env=env,
        )

    procs = [spawn("writer"), spawn("writer"), spawn("reader")]
    try:
        for p in procs:  # wait until every process has imported and opened its tier
            assert p.stdout is not None
            line = p.stdout.readline()
            assert line.strip() == "ready", p.stderr.read() if p.stderr else line
        go.touch()
        time.sleep(1.5)
        stop.touch()
        results = []
        for p in procs:
            out, err = p.communicate(timeout=60)
            assert p.returncode == 0, err
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    writer_a, writer_b, reader = results
    assert writer_a["rounds"] > 2 and writer_b["rounds"] > 2
    assert reader["bad"] == 0  # never a wrong byte
    assert reader["hits"] > 0
    assert reader["corrupt"] == 0 and reader["errors"] == 0  # replaced files are never seen half-written
    assert writer_a["errors"] == 0 and writer_b["errors"] == 0
    # Afterwards: every chunk is there, nothing but chunk files is left behind.
    tier = FsTier(str(root), TierOptions(metrics=TierMetrics("fs")))
    keys = KB.keys(np.arange(0, 8 * 16, dtype=np.uint32))
    assert tier.contains(keys) == [True] * 8
    leftovers = [n for d in root.iterdir() for n in os.listdir(d) if not n.endswith(".kvc")]
    assert leftovers == []


def test_lmcache_legacy_fs_url_uses_its_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """LMCache's ``fs://host:port/path`` writes under /path (LMCache's FSConnector uses only
    the path), never under a directory named ``host:port`` in the working directory."""
    from kvmesh.config import CacheConfig

    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    root = tmp_path / "lmcache-fs"
    cfg = CacheConfig.from_dict({"remote_url": f"fs://localhost:0{root}"})
    assert cfg.remote_url is not None
    tier = open_tier(cfg.remote_url, TierOptions(metrics=TierMetrics("fs")))
    keys, chunks = random_chunks(2, KVLayout(2, 2, 16, "float32"), 16)
    assert tier.put(keys, chunks) == [True, True]
    assert sorted(p.name for p in root.rglob("*.kvc")) == sorted(k.text + ".kvc" for k in keys)
    assert list(work.iterdir()) == []
    # opened directly (a kvmesh key), the same URL means the same directory
    direct = open_tier(f"fs://localhost:0{root}", TierOptions(metrics=TierMetrics("fs")))
    assert [g is not None for g in direct.get(keys)] == [True, True]
