"""``fio`` (Debian's package) as the disk's limit: the tool storage engineers measure with.

The one fio helper of the benchmarks: one job per call, in the directory under test, with
the access pattern of what it is the limit of — the block size, one file or a file per
chunk (``files``), the sync after each write (``fsync``/``fdatasync``) or one at the end,
buffered or O_DIRECT, one job at queue depth 1 (``psync``: one read or write at a time, as a
caller that waits for each does). Buffered reads start cold: fio drops the files' pages
before reading (``invalidate=1``), as the disk tier's benchmark drops its files' pages.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from typing import Literal

from kvmesh.errors import ProcessError

Sync = Literal["end", "fsync", "fdatasync"]


@dataclass(frozen=True)
class FioResult:
    bytes_per_s: float
    p50_ms: float
    p99_ms: float
    seconds: float  # wall time of the I/O phase (bytes / bandwidth)

    @property
    def mb_s(self) -> float:
        return self.bytes_per_s / 2**20


def available() -> bool:
    return shutil.which("fio") is not None


def fio_command(
    directory: str,
    rw: Literal["write", "read"],
    bs: int,
    size: int,
    *,
    sync: Sync = "end",
    direct: bool = False,
    files: int = 1,
) -> list[str]:
    """The fio command line of :func:`run_fio`."""
    cmd = [
        "fio",
        "--name=kvmesh-limit",
        f"--directory={directory}",
        f"--rw={rw}",
        f"--bs={bs}",
        f"--size={size}",
        "--ioengine=psync",
        "--iodepth=1",
        "--numjobs=1",
        "--invalidate=1",
        "--fallocate=none",  # the tier writes files without preallocating them
        "--output-format=json",
        "--unlink=1",
    ]
    if files > 1:  # ``size`` split into ``files`` files, one after the other
        cmd += [f"--nrfiles={files}", "--file_service_type=sequential"]
    if rw == "write":
        cmd.append({"end": "--end_fsync=1", "fsync": "--fsync=1", "fdatasync": "--fdatasync=1"}[sync])
    if direct:
        cmd.append("--direct=1")
    return cmd


def run_fio(
    directory: str,
    rw: Literal["write", "read"],
    bs: int,
    size: int,
    *,
    sync: Sync = "end",
    direct: bool = False,
    files: int = 1,
) -> FioResult:
    """One fio job of ``size`` bytes in ``bs`` blocks (see the module docstring); raises
    ProcessError if fio is missing or fails (``apt-get install -y fio``)."""
    if not available():
        raise ProcessError("fio is not installed (apt-get install -y fio)")
    cmd = fio_command(directory, rw, bs, size, sync=sync, direct=direct, files=files)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ProcessError(f"fio failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
    job = json.loads(proc.stdout)["jobs"][0][rw]
    pct = job.get("clat_ns", {}).get("percentile", {})
    bw = float(job["bw_bytes"])
    return FioResult(
        bw, pct.get("50.000000", 0) / 1e6, pct.get("99.000000", 0) / 1e6, size / bw if bw else 0.0
    )
