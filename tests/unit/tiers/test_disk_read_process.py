"""The disk tier's reads in a child process (``disk_read_process``, kvmesh.tiers.diskproc),
against real files and a real child: the same chunks, misses and verdicts as the reads in
the tier's own process, with and without a fleet key; a child that dies or hangs costs a
fallback to those reads, never a wrong or lost chunk. Its nonsense replies (out of bounds,
another key's header, a tampered one): tests/security/test_disk_reader_replies.py."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.core import serde
from kvmesh.core.fleetkey import FleetKey
from kvmesh.metrics import TierMetrics
from kvmesh.tiers.base import ChunkData, TierOptions
from kvmesh.tiers.disk import DiskTier
from kvmesh.tiers.diskproc import ReaderProcess
from tests.unit.tiers.test_disk import LAYOUT, assert_same, make_chunks


def fmt(mode: str) -> serde.ChunkFormat:
    if mode == "plain":
        return serde.ChunkFormat(None, False, LAYOUT)
    key = FleetKey([os.urandom(32)])
    return serde.ChunkFormat(key, mode == "aead", LAYOUT)


def open_disk(path: Path, chunk_format: serde.ChunkFormat, read_process: bool) -> DiskTier:
    o = TierOptions(
        name="disk", metrics=TierMetrics("disk"), chunk_format=chunk_format, read_process=read_process
    )
    return DiskTier(str(path), o)


def open_child_tier(path: Path) -> DiskTier:
    """A checksummed disk tier at ``path`` whose reader process is up."""
    tier = open_disk(path, fmt("plain"), read_process=True)
    assert tier._reader is not None and tier._reader.wait_ready(), "the reader process did not start"
    return tier


@pytest.fixture
def child_tier(tmp_path: Path) -> Iterator[DiskTier]:
    tier = open_child_tier(tmp_path / "d")
    yield tier
    tier.close()


def stored(tier: DiskTier, n: int, seed: int) -> tuple[list[ChunkData], ReaderProcess]:
    """``n`` chunks put in ``tier``, and its reader process."""
    chunks = make_chunks(n, seed=seed)
    assert all(tier.put([c.key for c in chunks], chunks))
    assert tier._reader is not None
    return chunks, tier._reader


def corrupt(tier: DiskTier, chunk: ChunkData) -> None:
    path = tier.files.path(chunk.key.text)
    data = bytearray(Path(path).read_bytes())
    data[-3] ^= 0x40  # a payload byte
    Path(path).write_bytes(bytes(data))


@pytest.mark.parametrize("mode", ["plain", "mac", "aead"])
def test_the_child_reads_exactly_what_was_stored(tmp_path: Path, mode: str) -> None:
    tier = open_disk(tmp_path / "d", fmt(mode), read_process=True)
    try:
        assert tier._reader is not None and tier._reader.wait_ready()
        chunks = make_chunks(6, seed=3)
        assert all(tier.put([c.key for c in chunks], chunks))
        got = tier.get([c.key for c in chunks])
        for g, c in zip(got, chunks, strict=True):
            assert_same(g, c)
        assert tier._reader.served == 6  # every one of them read by the child
        assert tier.metrics.counters["hits"] == 6
        # Into pool-like buffers: the payload lands in the caller's memory.
        slots: list[bytearray] = []

        def into(n: int) -> memoryview:
            slots.append(bytearray(n))
            return memoryview(slots[-1])

        got = tier.get([c.key for c in chunks], into=into)
        for g, c in zip(got, chunks, strict=True):
            assert g is not None and bytes(g.data) == bytes(c.data)
            data = np.frombuffer(g.data, np.uint8)
            assert any(np.shares_memory(data, np.frombuffer(s, np.uint8)) for s in slots)
    finally:
        tier.close()


def test_a_corrupt_file_is_a_counted_miss_and_leaves_the_index(child_tier: DiskTier) -> None:
    chunks = make_chunks(4, seed=5)
    child_tier.put([c.key for c in chunks], chunks)
    corrupt(child_tier, chunks[1])
    got = child_tier.get([c.key for c in chunks])
    assert got[1] is None
    for i in (0, 2, 3):
        assert_same(got[i], chunks[i])
    assert child_tier.metrics.counters["corrupt"] == 1
    assert child_tier.contains([chunks[1].key]) == [False]
    assert not os.path.exists(child_tier.files.path(chunks[1].key.text))
    os.unlink(child_tier.files.path(chunks[2].key.text))  # gone behind the tier's back
    got = child_tier.get([c.key for c in chunks])
    assert [g is not None for g in got] == [True, False, False, True]
    assert child_tier.contains([chunks[2].key]) == [False]


def test_a_keyed_reader_refuses_unkeyed_chunks_through_the_child(tmp_path: Path) -> None:
    chunks = make_chunks(3, seed=7)
    plain = open_disk(tmp_path / "plain", fmt("plain"), read_process=False)
    plain.put([c.key for c in chunks], chunks)
    keyed = open_disk(tmp_path / "keyed", fmt("mac"), read_process=True)
    try:
        assert keyed._reader is not None and keyed._reader.wait_ready()
        keyed.put([c.key for c in chunks], chunks)
        for c in chunks:  # unkeyed files put in place of the keyed ones, behind the tier's back
            Path(keyed.files.path(c.key.text)).write_bytes(Path(plain.files.path(c.key.text)).read_bytes())
        assert keyed.get([c.key for c in chunks]) == [None, None, None]
        assert keyed._reader.served == 0 and keyed._reader.alive
        assert keyed.metrics.counters["unauthenticated"] == 3
        assert keyed.contains([c.key for c in chunks]) == [False, False, False]  # not the fleet's: gone
    finally:
        keyed.close()
        plain.close()


def test_a_killed_child_falls_back_to_reads_here(child_tier: DiskTier) -> None:
    chunks, reader = stored(child_tier, 5, seed=9)
    os.kill(reader._proc.pid, signal.SIGKILL)
    reader._proc.wait(timeout=10)
    got = child_tier.get([c.key for c in chunks])
    for g, c in zip(got, chunks, strict=True):
        assert_same(g, c)
    assert not reader.alive
    assert child_tier.metrics.counters["read_process_failures"] == 1
    assert child_tier.metrics.counters["hits"] == 5
    got = child_tier.get([c.key for c in chunks])  # and stays so, without a second failure
    assert all(g is not None for g in got)
    assert child_tier.metrics.counters["read_process_failures"] == 1


def test_a_hung_child_costs_its_timeout_then_reads_here(child_tier: DiskTier) -> None:
    chunks, reader = stored(child_tier, 3, seed=11)
    reader.read_timeout_s = 0.3
    os.kill(reader._proc.pid, signal.SIGSTOP)
    try:
        got = child_tier.get([c.key for c in chunks])
    finally:
        if reader._proc.poll() is None:
            os.kill(reader._proc.pid, signal.SIGCONT)
    for g, c in zip(got, chunks, strict=True):
        assert_same(g, c)
    assert not reader.alive and reader._proc.poll() is not None  # ended, not left stopped


def test_a_batch_larger_than_the_staging_buffer_goes_in_rounds(tmp_path: Path) -> None:
    tier = open_disk(tmp_path / "d", fmt("plain"), read_process=False)
    try:
        chunks = make_chunks(7, seed=13)
        tier.put([c.key for c in chunks], chunks)
        nbytes = len(chunks[0].data)
        tier._reader = ReaderProcess(tier.path, tier.chunk_format, staging_bytes=2 * nbytes + 1)
        assert tier._reader.wait_ready()
        got = tier.get([c.key for c in chunks])
        for g, c in zip(got, chunks, strict=True):
            assert_same(g, c)
        assert tier._reader.served == 7
    finally:
        tier.close()


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    present=st.lists(st.booleans(), min_size=2, max_size=8),
    bad=st.sets(st.integers(0, 7), max_size=3),
    seed=st.integers(0, 4_000),
)
def test_the_child_and_the_process_agree_on_every_outcome(
    tmp_path_factory: pytest.TempPathFactory, present: list[bool], bad: set[int], seed: int
) -> None:
    """The same files read by a tier with the child and by one without: the same chunks,
    the same misses, the same counters."""
    root = tmp_path_factory.mktemp("agree")
    chunks = make_chunks(len(present), seed=seed)
    stored = [c for c, p in zip(chunks, present, strict=True) if p]
    outcomes = []
    for read_process in (True, False):
        tier = open_disk(root / str(read_process), fmt("plain"), read_process=read_process)
        try:
            if stored:
                tier.put([c.key for c in stored], stored)
            for i in bad:
                if i < len(present) and present[i]:
                    corrupt(tier, chunks[i])
            if tier._reader is not None:
                assert tier._reader.wait_ready()
            got = tier.get([c.key for c in chunks])
            outcomes.append(
                (
                    [None if g is None else bytes(g.data) for g in got],
                    {k: tier.metrics.counters[k] for k in ("hits", "misses", "corrupt")},
                )
            )
            if tier._reader is not None:
                assert tier._reader.served == sum(g is not None for g in got)
        finally:
            tier.close()
    assert outcomes[0] == outcomes[1]
    want = [
        bytes(c.data) if p and i not in bad else None
        for i, (c, p) in enumerate(zip(chunks, present, strict=True))
    ]
    assert outcomes[0][0] == want
