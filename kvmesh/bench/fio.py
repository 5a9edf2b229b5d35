"""``fio`` (Debian's package) as the disk's limit: the tool storage engineers measure with.

One job per call, in the directory under test, on the sizes the benchmark moves: a
sequential write with an fsync after every block (what a tier that makes each chunk
durable pays) or with one fsync at the end (the streaming limit), and O_DIRECT sequential
reads (a cold read that no page cache serves).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from typing import Literal

from kvmesh.errors import ProcessError


@dataclass(frozen=True)
class FioResult:
    bytes_per_s: float
    p50_ms: float
    p99_ms: float
    seconds: float  # wall time of the I/O phase (bytes / bandwidth)


def available() -> bool:
    return shutil.which("fio") is not None


def run_fio(
    directory: str,
    rw: Literal["write", "read"],
    bs: int,
    size: int,
    *,
    fsync_each: bool = False,
    direct: bool = False,
) -> FioResult:
    """One sequential fio job of ``size`` bytes in ``bs`` blocks; raises ProcessError if fio
    is missing or fails (``apt-get install -y fio``)."""
    if not available():
        raise ProcessError("fio is not installed (apt-get install -y fio)")
    cmd = [
        "fio",
        "--name=kvmesh-limit",
        f"--directory={directory}",
        f"--rw={rw}",
        f"--bs={bs}",
        f"--size={size}",
        "--ioengine=psync",
        "--output-format=json",
        "--unlink=1",
    ]
    if rw == "write":
        cmd.append("--fsync=1" if fsync_each else "--end_fsync=1")
    if direct:
        cmd.append("--direct=1")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ProcessError(f"fio failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
    job = json.loads(proc.stdout)["jobs"][0][rw]
    pct = job.get("clat_ns", {}).get("percentile", {})
    bw = float(job["bw_bytes"])
    return FioResult(
        bw, pct.get("50.000000", 0) / 1e6, pct.get("99.000000", 0) / 1e6, size / bw if bw else 0.0
    )
