"""The physical limits of ``bench tiers``: fio with the disk tier's access pattern (real fio
on real files) and the raw RESP pipeline (against a real redis-server)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kvmesh.bench.common import fio, resp
from kvmesh.errors import ProcessError


def test_fio_takes_the_tiers_access_pattern() -> None:
    write = fio.fio_command("/d", "write", 1 << 20, 16 << 20, sync="fsync", files=16)
    assert {"--bs=1048576", "--size=16777216", "--nrfiles=16", "--file_service_type=sequential"} <= set(write)
    # one chunk at a time, each write made durable, no preallocation (the tier has none)
    assert {"--ioengine=psync", "--iodepth=1", "--numjobs=1", "--fsync=1", "--fallocate=none"} <= set(write)
    read = fio.fio_command("/d", "read", 1 << 20, 16 << 20, files=16)
    # buffered reads, cold: fio drops the files' pages first, as the benchmark drops the tier's
    assert "--invalidate=1" in read and "--direct=1" not in read and not any("fsync" in a for a in read)
    assert "--nrfiles" not in " ".join(fio.fio_command("/d", "write", 4096, 8192))


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio not installed (apt-get install fio)")
def test_fio_reads_a_file_per_chunk(tmp_path: Path) -> None:
    got = fio.run_fio(str(tmp_path), "read", 64 << 10, 256 << 10, files=4)
    assert got.bytes_per_s > 0 and got.seconds > 0 and got.mb_s == got.bytes_per_s / 2**20
    assert list(tmp_path.iterdir()) == []  # fio unlinks its files


@pytest.mark.redis
def test_the_raw_pipeline_sets_and_gets_the_exact_bytes(redis_url: str) -> None:
    names = [b"raw:%d" % i for i in range(4)]
    values = [bytes([i]) * (100_000 + i) for i in range(4)]
    sets, set_replies, gets, get_replies = resp.set_get(names, values)
    raw = resp.RawPipeline(redis_url, timeout_s=2.0)
    try:
        assert raw.timed(sets, set_replies) > 0 and raw.timed(gets, get_replies) > 0
        # a reply that differs from the expected one raises (a miss here: "$-1" for the value)
        _, _, miss, miss_replies = resp.set_get([b"raw:absent"], [b"x" * 10])
        with pytest.raises(ProcessError):
            raw.timed(miss, miss_replies)
    finally:
        raw.close()
    import redis

    client = redis.Redis.from_url(redis_url)
    assert client.get(b"raw:3") == values[3]
    client.close()
