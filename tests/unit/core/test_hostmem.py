"""The CPU pool against the memory the process may use (kvmesh.core.hostmem).

The cgroup files are written under a temporary root: a real cgroup with a memory limit
needs a writable cgroup filesystem, which CI machines do not all have (fault injection of
/proc/self/cgroup and /sys/fs/cgroup); the machine's own files are read too."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from kvmesh.core.hostmem import check_pool, memory_limit
from kvmesh.errors import ConfigError

GIB = 1 << 30
TOTAL = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def fake_root(tmp_path: Path, cgroup: str, files: dict[str, str]) -> str:
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text(cgroup)
    for rel, text in files.items():
        path = tmp_path / "sys/fs/cgroup" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(tmp_path)


def test_this_machine_has_a_limit_no_larger_than_its_memory() -> None:
    limit = memory_limit()
    assert 0 < limit.bytes <= TOTAL


def test_cgroup_v2_takes_the_smallest_limit_up_to_the_root(tmp_path: Path) -> None:
    root = fake_root(
        tmp_path,
        "0::/kubepods/pod1/ctr\n",
        {
            "kubepods/memory.max": "max\n",
            "kubepods/pod1/memory.max": f"{2 * GIB}\n",  # the pod's limit, above the container
            "kubepods/pod1/ctr/memory.max": "max\n",
        },
    )
    limit = memory_limit(root)
    assert limit.bytes == min(2 * GIB, TOTAL) and "memory.max" in limit.what


def test_cgroup_v1_memory_controller(tmp_path: Path) -> None:
    root = fake_root(
        tmp_path,
        "4:memory:/docker/abc\n3:cpuset:/\n",
        {
            "memory/docker/abc/memory.limit_in_bytes": f"{GIB}\n",
            "memory/memory.limit_in_bytes": "9223372036854771712\n",
        },
    )
    assert memory_limit(root).bytes == min(GIB, TOTAL)


def test_no_cgroup_files_or_garbage_mean_the_machine(tmp_path: Path) -> None:
    root = fake_root(tmp_path, "garbage\n0::/gone\n", {})
    assert memory_limit(root).bytes == TOTAL
    assert memory_limit(str(tmp_path / "nowhere")).bytes == TOTAL


def test_a_pool_over_the_limit_is_refused_and_one_near_it_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = fake_root(tmp_path, "0::/pod\n", {"pod/memory.max": f"{4 * GIB}\n"})
    refused = r"5\.0 GiB CPU pool .* more than 4\.0 GiB, the container's memory limit"
    with pytest.raises(ConfigError, match=refused):
        check_pool(5 * GIB, root)
    with caplog.at_level(logging.WARNING, logger="kvmesh.core.hostmem"):
        check_pool(int(3.5 * GIB), root)
        check_pool(2 * GIB, root)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "88% of 4.0 GiB, the container's memory limit" in said[0], said


def test_the_engine_refuses_a_pool_larger_than_the_machine() -> None:
    import torch

    from kvmesh import CacheEngine, KVLayout

    size_gb = TOTAL / GIB * 2
    with pytest.raises(ConfigError, match="max_local_cpu_size asks for"):
        CacheEngine({"max_local_cpu_size": size_gb}, layout=KVLayout(2, 2, 8, torch.float32), model_id="m")
