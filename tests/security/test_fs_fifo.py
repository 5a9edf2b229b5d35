"""Finding 8 (issue #23): a FIFO where a chunk file should be hangs a reader.

A hostile writer of a real ``fs://`` directory puts a FIFO, and a symlink to a FIFO
elsewhere, under the file names of a victim's chunks. A plain ``open`` of a FIFO waits for
a writer that never comes, past ``remote_timeout_s`` (before the fix: still blocked after
10 s with a 5 s budget). Now chunk files open with ``O_NOFOLLOW | O_NONBLOCK`` and only
regular files are read: both are fast misses, counted as corrupt. The local disk tier opens
its files the same way (its directory is private, but a FIFO there must not hang its
start-up scan or a read either).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from kvmesh import CacheEngine
from kvmesh.metrics import TierMetrics
from kvmesh.tiers.base import TierOptions, open_tier
from kvmesh.tiers.disk import DiskTier
from kvmesh.tiers.fs import FsTier
from kvmesh.tiers.testing import random_chunks
from tests.security.chunks import CHUNK, LAYOUT, prompt

BUDGET_S = 1.0


def finishes_within(seconds: float, fn: Callable[[], None], fifos: list[str]) -> bool:
    """Whether ``fn`` returns within ``seconds``. A call still blocked then is released (a
    writer opens and closes every FIFO until it returns) so the test ends either way."""
    done = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:
            errors.append(exc)
        finally:
            done.set()

    threading.Thread(target=run, daemon=True).start()
    in_time = done.wait(seconds)
    deadline = time.monotonic() + 10
    while not done.is_set() and time.monotonic() < deadline:
        for fifo in fifos:
            with contextlib.suppress(OSError):  # ENXIO: no reader waits on this one now
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        done.wait(0.05)
    assert not errors, errors
    return in_time


def test_fifo_and_link_to_fifo_in_fs_tier_are_fast_misses(
    tmp_path: Path, make_engine: Callable[..., CacheEngine]
) -> None:
    eng = make_engine(f"fs://{tmp_path / 'shared'}", remote_timeout_s=BUDGET_S)
    a, b = prompt(CHUNK, seed=1), prompt(CHUNK, seed=2)
    tier = eng.lower["remote"]
    assert isinstance(tier, FsTier)
    path_a, path_b = (tier.path(eng.keys.keys(t)[0]) for t in (a, b))
    elsewhere = str(tmp_path / "elsewhere.fifo")
    for p in (path_a, path_b):
        os.makedirs(os.path.dirname(p), exist_ok=True)
    os.mkfifo(path_a)
    os.mkfifo(elsewhere)
    os.symlink(elsewhere, path_b)

    got: dict[str, int] = {}

    def read() -> None:
        got["a"] = eng.retrieve(a)[0]
        got["b"] = eng.retrieve(b)[0]

    t0 = time.monotonic()
    in_time = finishes_within(BUDGET_S, read, [path_a, elsewhere])
    assert in_time, f"a read blocked on a FIFO past remote_timeout_s ({time.monotonic() - t0:.1f} s)"
    assert got == {"a": 0, "b": 0}
    assert eng.stats()["remote"]["corrupt"] >= 2
    assert os.path.exists(elsewhere)  # the link went, never what it pointed at


def test_fifo_in_disk_tier_neither_hangs_startup_nor_a_read(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'disk'}"

    def tier() -> DiskTier:
        opened = open_tier(url, TierOptions(name="disk", chunk_size=32, metrics=TierMetrics("disk")))
        assert isinstance(opened, DiskTier)
        return opened

    keys, chunks = random_chunks(2, LAYOUT, 32)
    first = tier()
    assert first.put(keys, chunks) == [True, True]
    path = first.files.path(keys[0].text)
    first.close()
    os.unlink(path)
    os.mkfifo(path)  # at start-up the index is rebuilt from every file's header

    opened: list[DiskTier] = []
    assert finishes_within(BUDGET_S, lambda: opened.append(tier()), [path]), "start-up blocked on a FIFO"
    disk = opened[0]
    try:
        assert disk.contains(keys) == [False, True]
        # A FIFO swapped in under a chunk the index holds: the read is a miss, not a hang.
        other = disk.files.path(keys[1].text)
        os.unlink(other)
        os.mkfifo(other)
        got: list[object] = []
        assert finishes_within(BUDGET_S, lambda: got.extend(disk.get(keys)), [other]), "a read blocked"
        assert got == [None, None]
        assert disk.metrics.counters["corrupt"] >= 1
    finally:
        disk.close()
