"""One disk directory, one owner: the directory lock (against a real second process), the
default per-rank / per-replica sub-directories, the directory fsync after each rename, and
pin accounting that an unpin cannot unbalance."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from kvmesh import CacheEngine
from kvmesh.core.keys import KeyBuilder, KVLayout
from kvmesh.errors import DirectoryLockedError
from kvmesh.tiers.base import ChunkData, TierOptions, open_tier
from kvmesh.tiers.disk import DiskTier

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_size=8, dtype="float16")
CS = 16


def chunks(n: int, seed: int = 0) -> list[ChunkData]:
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, 50_000, size=n * CS, dtype=np.uint32)
    kb = KeyBuilder("m", LAYOUT, CS)
    out = []
    for i, key in enumerate(kb.keys_for_array(toks)):
        data = bytearray(rng.integers(0, 256, size=CS * LAYOUT.bytes_per_token, dtype=np.uint8).tobytes())
        out.append(ChunkData(key, LAYOUT, toks[i * CS : (i + 1) * CS].copy(), data))
    return out


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    """A real second process that owns a disk tier on ``tmp_path/d`` until its stdin closes,
    and one that opened ``tmp_path/auto`` the way an engine does (``subdir="auto"``)."""
    code = textwrap.dedent(
        f"""
        import sys
        from kvmesh.tiers.base import TierOptions, open_tier
        from kvmesh.tiers.disk import DiskTier
        a = DiskTier({str(tmp_path / "d")!r})
        b = open_tier("file://{tmp_path / "auto"}", TierOptions(subdir="auto"))
        print(b.path, flush=True)
        sys.stdin.read()
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    assert line, "the holder process failed to open its disk tiers"
    try:
        yield proc, Path(line)
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(10)


def test_second_owner_gets_an_error_naming_the_holder_pid(
    tmp_path: Path, holder: tuple[subprocess.Popen[str], Path]
) -> None:
    proc, _ = holder
    with pytest.raises(DirectoryLockedError) as err:
        DiskTier(str(tmp_path / "d"))
    assert err.value.holder_pid == proc.pid
    assert f"process {proc.pid}" in str(err.value) and str(tmp_path / "d") in str(err.value)


def test_lock_goes_with_its_process(tmp_path: Path, holder: tuple[subprocess.Popen[str], Path]) -> None:
    proc, _ = holder
    assert proc.stdin is not None
    proc.stdin.close()
    proc.wait(10)
    DiskTier(str(tmp_path / "d")).close()  # a dead holder leaves no stale lock


def test_second_process_gets_its_own_slot(tmp_path: Path, holder: tuple[subprocess.Popen[str], Path]) -> None:
    _, theirs = holder
    assert theirs == tmp_path / "auto" / "rank0" / "slot0"
    mine = open_tier(f"file://{tmp_path / 'auto'}", TierOptions(subdir="auto"))
    try:
        assert isinstance(mine, DiskTier) and Path(mine.path) == tmp_path / "auto" / "rank0" / "slot1"
    finally:
        mine.close()


def test_same_process_second_tier_is_refused_too(tmp_path: Path) -> None:
    first = DiskTier(str(tmp_path))
    with pytest.raises(DirectoryLockedError, match=f"process {os.getpid()}"):
        DiskTier(str(tmp_path))
    first.close()
    DiskTier(str(tmp_path)).close()


def engine(local_disk: Path, shard: int = 0) -> CacheEngine:
    cfg = {
        "chunk_size": CS,
        "max_local_cpu_size": 0.001,
        "local_disk": str(local_disk),
        "max_local_disk_size": 0,
    }
    return CacheEngine(cfg, layout=LAYOUT, model_id="m", shard=shard)


def test_engines_on_one_local_disk_get_own_directories_and_reuse_them(tmp_path: Path) -> None:
    a, b, rank1 = engine(tmp_path), engine(tmp_path), engine(tmp_path, shard=1)
    dirs = [Path(e.lower["disk"].path) for e in (a, b, rank1)]  # type: ignore[attr-defined]
    assert dirs == [tmp_path / "rank0" / "slot0", tmp_path / "rank0" / "slot1", tmp_path / "rank1" / "slot0"]
    toks = np.arange(2 * CS, dtype=np.uint32)
    kv = torch.randn(LAYOUT.shape(2 * CS)).to(torch.float16)
    assert a.store(toks, kv) == 2 * CS and a.wait_for_writes(10)
    a.close()
    # A restarted replica takes the free slot back, with the chunks left there.
    again = engine(tmp_path)
    assert Path(again.lower["disk"].path) == dirs[0]  # type: ignore[attr-defined]
    assert again.locate(toks) == [(0, CS, "disk"), (CS, 2 * CS, "disk")]
    n, got = again.retrieve(toks)
    assert n == 2 * CS and torch.equal(got, kv)
    for e in (again, b, rank1):
        e.close()


def test_explicit_subdir_name_and_none(tmp_path: Path) -> None:
    named = open_tier(f"file://{tmp_path}", TierOptions(subdir="replica-a", shard=3))
    plain = open_tier(f"file://{tmp_path / 'plain'}", TierOptions(subdir=""))
    assert Path(named.path) == tmp_path / "replica-a" / "rank3"  # type: ignore[attr-defined]
    assert Path(plain.path) == tmp_path / "plain"  # type: ignore[attr-defined]
    named.close()
    plain.close()


def test_directory_fsynced_after_each_rename(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Spies on os.rename / os.fsync (the real calls still run) to see their order."""
    events: list[tuple[str, str]] = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        events.append(("fsync_dir" if os.path.isdir(path) else "fsync", path))
        real_fsync(fd)

    def rename(src: str, dst: str) -> None:
        real_rename(src, dst)
        events.append(("rename", dst))

    tier = DiskTier(str(tmp_path))
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    a, b = chunks(2)
    assert tier.put([a.key, b.key], [a, b]) == [True, True]
    renames = [i for i, (op, _) in enumerate(events) if op == "rename"]
    assert len(renames) == 2
    for i in renames:
        final = events[i][1]
        assert ("fsync_dir", os.path.dirname(final)) in events[i + 1 :], events
    tier.close()


def test_unpin_cannot_drop_someone_elses_pin(tmp_path: Path) -> None:
    """Engine A pins a chunk before it reaches disk; B pins it once it is there; A's unpin
    must leave B's pin in place (the chunk is not evicted)."""
    one = len(chunks(1)[0].data) * 3 // 2  # budget: one chunk, header included, not two
    tier = DiskTier(str(tmp_path), TierOptions(capacity_bytes=one))
    c, d = chunks(2)
    tier.pin([c.key])  # A: c is absent
    assert tier.put([c.key], [c]) == [True]
    tier.pin([c.key])  # B
    tier.unpin([c.key])  # A
    assert tier.put([d.key], [d]) == [False]  # c stays: B still holds it
    assert tier.contains([c.key, d.key]) == [True, False]
    tier.unpin([c.key])  # B
    assert tier.put([d.key], [d]) == [True]
    assert tier.contains([c.key, d.key]) == [False, True]
    tier.close()
