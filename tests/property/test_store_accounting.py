"""Every store is retrievable, counted as skipped, or evicted by policy (issue #25).

A hypothesis state machine drives a real :class:`~kvmesh.CacheEngine` in the disk-only
configuration LMCache users run (``local_cpu: false``, a real ``local_disk`` directory,
write-through and write-back alike) with random stores, waits for the writes, evictions of
the staging pool, and crashes (the engine dropped with writes in flight and a new one opened
on the same directory), and checks it against a model of what was stored:

* after ``wait_for_writes`` every chunk stored since is on disk with its exact bytes, unless a
  counter says why not: ``skipped_stores`` (with a reason) or the disk's policy ``evictions``;
* a crash may lose what was not waited for, never what was;
* nothing served is ever another chunk's KV.

Before this change six 1,024-token prompts stored back to back left three retrievable and no
counter moved (the 4-chunk staging pool dropped stores and write-back left chunks in it).
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile

import numpy as np
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvmesh.core.engine import CacheEngine
from kvmesh.core.keys import KVLayout, as_token_array

LAYOUT = KVLayout(2, 1, 8, "float32")
CHUNK = 16
CHUNK_BYTES = CHUNK * LAYOUT.bytes_per_token  # 2,048 bytes
NPROMPTS = 6


def _prompt(i: int) -> np.ndarray:
    rng = np.random.default_rng(1000 + i)
    n = CHUNK * int(rng.integers(1, 5))  # 1-4 whole chunks
    return as_token_array(rng.integers(10, 30000, n).astype(np.int64))


def _kv(i: int) -> torch.Tensor:
    n = len(PROMPTS[i])
    return torch.arange(n * LAYOUT.bytes_per_token // 4, dtype=torch.float32).view(LAYOUT.shape(n)) + 1e6 * i


PROMPTS = [_prompt(i) for i in range(NPROMPTS)]


class DiskOnlyStores(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="kvmesh-acct-")
        self.engine: CacheEngine | None = None
        self.pending: set[int] = set()  # stored, not waited for: a crash may lose them
        self.durable: set[int] = set()  # stored and waited for
        self.counted_before = 0  # skips + evictions of engines that crashed

    @initialize(mode=st.sampled_from(["through", "back"]), disk_chunks=st.sampled_from([0, 6, 64]))
    def start(self, mode: str, disk_chunks: int) -> None:
        self.mode, self.disk_chunks = mode, disk_chunks
        self._open()

    def _open(self) -> None:
        # Each file carries a small header: budget a little more than the payload per chunk.
        budget = disk_chunks_bytes(self.disk_chunks)
        self.engine = CacheEngine(
            {
                "chunk_size": CHUNK,
                "local_cpu": False,
                "local_disk": self.dir,
                "disk_subdir": "",
                "max_local_disk_size": budget / 1e9,
                "write_mode": self.mode,
            },
            layout=LAYOUT,
            model_id="acct",
        )

    def _counted(self) -> int:
        assert self.engine is not None
        st_ = self.engine.stats()
        return int(st_["engine"]["skipped_stores"] + st_["disk"]["skipped_stores"] + st_["disk"]["evictions"])

    @rule(i=st.integers(0, NPROMPTS - 1))
    def store(self, i: int) -> None:
        assert self.engine is not None
        self.engine.store(PROMPTS[i], _kv(i))
        self.durable.discard(i)
        self.pending.add(i)

    @rule()
    def wait(self) -> None:
        assert self.engine is not None
        assert self.engine.wait_for_writes(30), "wait_for_writes timed out"
        self.durable |= self.pending
        self.pending.clear()

    @rule()
    def evict_staging(self) -> None:
        assert self.engine is not None
        self.engine.clear("cpu", force=True)

    @precondition(lambda self: self.engine is not None)
    @rule()
    def crash(self) -> None:
        assert self.engine is not None
        self.counted_before += self._counted()
        self.engine.close(timeout=0.0)  # writes in flight may land or not
        self.pending.clear()
        self._open()

    @invariant()
    def durable_stores_are_kept_or_counted(self) -> None:
        if self.engine is None:
            return
        eng = self.engine
        missing = 0
        for i in sorted(self.durable):
            keys = eng.keys.keys_for_array(PROMPTS[i])
            on_disk = eng.lower["disk"].contains(keys)
            missing += on_disk.count(False)
            n, kv = eng.retrieve(PROMPTS[i])
            # Whatever comes back is this prompt's own KV, exactly.
            assert torch.equal(kv, _kv(i)[:, :, :n]), f"prompt {i}: wrong KV served"
        counted = self.counted_before + self._counted()
        assert missing <= counted, f"{missing} waited-for chunks gone, {counted} counted (skips + evictions)"
        if self.disk_chunks == 0:  # an unbounded disk: nothing may be missing at all
            assert missing == 0 or counted > 0

    def teardown(self) -> None:
        if self.engine is not None:
            with contextlib.suppress(Exception):
                self.engine.close(timeout=5.0)
        shutil.rmtree(self.dir, ignore_errors=True)


def disk_chunks_bytes(chunks: int) -> int:
    return chunks * (CHUNK_BYTES + 4096) if chunks else 0


DiskOnlyStores.TestCase.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)
TestDiskOnlyStores = DiskOnlyStores.TestCase


def test_six_prompts_back_to_back_are_all_kept() -> None:
    """The issue's case: six 1,024-token prompts, one wait, all six retrievable."""
    d = tempfile.mkdtemp(prefix="kvmesh-six-")
    try:
        layout = KVLayout(2, 2, 16, "float32")
        eng = CacheEngine(
            {"chunk_size": 256, "local_cpu": False, "local_disk": d, "max_local_disk_size": 1},
            layout=layout,
            model_id="six",
        )
        rng = np.random.default_rng(0)
        prompts = [rng.integers(10, 30000, 1024) for _ in range(6)]
        for p in prompts:
            eng.store(p, torch.randn(layout.shape(1024)))
        assert eng.wait_for_writes(30)
        eng.clear("cpu", force=True)
        assert [eng.lookup(p) for p in prompts] == [1024] * 6
        assert eng.stats()["engine"]["skipped_stores"] == 0
        eng.close()
    finally:
        shutil.rmtree(d, ignore_errors=True)
