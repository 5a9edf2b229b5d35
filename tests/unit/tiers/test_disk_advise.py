"""``DiskTier.advise`` (``Feature.ADVISE``): the files of the advised keys are read into the
page cache before the reads that follow, and the engine advises exactly the chunks its cpu
tier lacks, at the lookup that promises a load; a get reads its files at once. Residency is
read back with the kernel's own ``mincore(2)`` on real files."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvmesh.config import CacheConfig
from kvmesh.core.engine import CacheEngine
from kvmesh.core.keys import ChunkKey, KVLayout
from kvmesh.tiers.base import Feature, as_advisable
from kvmesh.tiers.disk import DiskTier
from kvmesh.tiers.diskfiles import IO_THREADS

from .test_disk import make_chunks, opts, put

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
PAGE = mmap.PAGESIZE


def resident_fraction(path: str) -> float:
    """Fraction of ``path``'s pages in the page cache (``mincore`` over a read-only map)."""
    size = os.path.getsize(path)
    pages = (size + PAGE - 1) // PAGE
    vec = (ctypes.c_ubyte * pages)()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as m:
        # The map's start: a read-only map exports no writable buffer for ctypes, numpy reads it.
        view = np.frombuffer(m, dtype=np.uint8, count=1)
        addr = int(view.__array_interface__["data"][0])
        rc = _libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec)
        del view
    if rc != 0:
        pytest.skip(f"mincore failed: {os.strerror(ctypes.get_errno())}")
    return sum(b & 1 for b in vec) / pages


def evict(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def wait_resident(path: str, timeout: float = 5.0) -> float:
    deadline = time.monotonic() + timeout
    frac = resident_fraction(path)
    while frac < 1.0 and time.monotonic() < deadline:
        time.sleep(0.01)
        frac = resident_fraction(path)
    return frac


def test_advise_brings_the_files_into_the_page_cache(tmp_path: Path) -> None:
    tier = DiskTier(str(tmp_path), opts())
    assert Feature.ADVISE in tier.features and as_advisable(tier) is tier
    chunks = make_chunks(4)
    assert all(put(tier, chunks))
    paths = [tier.files.path(c.key.text) for c in chunks]
    for p in paths:
        evict(p)
    if resident_fraction(paths[0]) > 0.5:
        pytest.skip("this filesystem keeps the pages resident after POSIX_FADV_DONTNEED")
    tier.advise([c.key for c in chunks[:2]])
    assert wait_resident(paths[0]) == 1.0 and wait_resident(paths[1]) == 1.0
    # Not advised: left where they were (no one read them).
    assert resident_fraction(paths[3]) < 0.5
    # The reads that follow return the same chunks.
    for got, want in zip(tier.get([c.key for c in chunks]), chunks, strict=True):
        assert got is not None and bytes(got.data) == bytes(want.data)
    tier.close()


def test_advise_is_best_effort(tmp_path: Path) -> None:
    tier = DiskTier(str(tmp_path), opts())
    chunks = make_chunks(2)
    assert all(put(tier, chunks[:1]))
    os.unlink(tier.files.path(chunks[0].key.text))  # gone underneath
    tier.advise([c.key for c in chunks])  # a vanished file and an absent key: no error
    assert tier.get([chunks[0].key]) == [None]
    tier.close()
    tier.advise([chunks[1].key])  # closed: ignored, never raises


def _io_threads(skip: list[threading.Thread]) -> list[threading.Thread]:
    io = [t for t in threading.enumerate() if t.name.startswith("kvmesh-disk-io")]
    return [t for t in io if all(t is not o for o in skip)]


def test_the_io_threads_run_from_the_open_on_the_openers_cores(tmp_path: Path) -> None:
    """Opened, the tier's I/O threads are already running, bound where the thread that
    opened it was (the vLLM worker opens it on its background cores): the first advise, made
    inside the lookup that promises a load, starts none (their starts took ~6 ms of it)."""
    before = threading.enumerate()
    mine = os.sched_getaffinity(0)
    one = {max(mine)}
    os.sched_setaffinity(0, one)  # this thread only
    try:
        tier = DiskTier(str(tmp_path), opts())
    finally:
        os.sched_setaffinity(0, mine)
    io = _io_threads(before)
    assert len(io) == IO_THREADS
    assert all(os.sched_getaffinity(t.native_id or 0) == one for t in io)
    chunks = make_chunks(IO_THREADS + 2)
    assert all(put(tier, chunks))
    tier.advise([c.key for c in chunks])
    got = tier.get([c.key for c in chunks])
    assert all(g is not None for g in got)
    assert len(_io_threads(before + io)) == 0  # no new ones
    tier.close()


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def __call__(self, keys: Sequence[ChunkKey]) -> None:
        self.calls.append([k.text for k in keys])


def test_a_pinned_lookup_advises_the_chunks_below_the_cpu_tier_and_the_load_does_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hint goes out when a load is promised (the connector's pinned lookup), so the
    disk reads while vLLM schedules the step; the load itself reads its files at once and
    has nothing to hint. A lookup that promises nothing (no pin) starts no I/O."""
    layout = KVLayout(2, 2, 8, "float32")
    cfg = CacheConfig.from_dict({"chunk_size": 16, "local_disk": str(tmp_path), "max_local_cpu_size": 0.01})
    engine = CacheEngine(cfg, layout=layout, model_id="m")
    try:
        tokens = np.arange(64, dtype=np.uint32)
        kv = torch.randn(layout.shape(64))
        assert engine.store(tokens, kv) == 64
        assert engine.wait_for_writes(10)
        keys = engine.keys.keys_for_array(tokens)
        assert engine.cpu.delete(keys[2:], force=True) == 2  # chunks 2 and 3 now on disk only
        rec = _Recorder()
        disk = engine.lower["disk"]
        assert isinstance(disk, DiskTier)
        monkeypatch.setattr(disk, "advise", rec)
        assert engine.lookup_held(tokens)[0] == 64
        assert rec.calls == []  # not pinned: no load follows
        assert engine.lookup_held(tokens, pin=True)[0] == 64
        assert rec.calls == [[k.text for k in keys[2:]]]
        rec.calls.clear()
        n, got = engine.retrieve(tokens)
        assert n == 64 and torch.equal(got, kv)
        assert rec.calls == []
        engine.unpin_keys(keys)
        assert engine.lookup_held(tokens, pin=True)[0] == 64  # all in cpu now (promoted on read)
        assert rec.calls == []
        engine.unpin_keys(keys)
    finally:
        engine.close()


def test_a_get_reads_its_files_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fault injection: every file read waits until all four are under way. Read one after
    another, the first would wait alone and the barrier break (a wrong result, not a hang)."""
    tier = DiskTier(str(tmp_path), opts())
    chunks = make_chunks(4)
    assert all(put(tier, chunks))
    barrier = threading.Barrier(len(chunks), timeout=10)
    read = tier.files.read

    def together(*args: Any, **kwargs: Any) -> Any:
        barrier.wait()
        return read(*args, **kwargs)

    monkeypatch.setattr(tier.files, "read", together)
    got = tier.get([c.key for c in chunks])
    assert [bytes(g.data) if g else None for g in got] == [bytes(c.data) for c in chunks]
    assert tier.metrics.snapshot()["hits"] == 4
    tier.close()
