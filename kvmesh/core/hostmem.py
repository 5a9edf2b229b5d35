"""How much memory this process may use: the machine's, or its container's limit.

The CPU tier's pool is allocated up front and its pages are touched as it fills, so a pool
larger than the memory a Kubernetes pod may use starts fine and gets the pod OOM-killed
hours later, once the cache is full. :func:`check_pool` says so at start instead.

The limit is the smallest of the machine's memory and every cgroup memory limit on the way
from this process's cgroup to the root (``memory.max``, cgroup v2; ``memory.limit_in_bytes``,
v1), read from ``/proc/self/cgroup`` and ``/sys/fs/cgroup`` (both under ``root``, for tests).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from kvmesh.errors import ConfigError

log = logging.getLogger(__name__)

# A pool over this share of the limit leaves too little for vLLM, the model and the KV cache.
WARN_SHARE = 0.8


@dataclass(frozen=True)
class MemoryLimit:
    bytes: int
    what: str  # where the limit comes from, for messages


def memory_limit(root: str = "/") -> MemoryLimit:
    """The memory this process may use (see the module docstring)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    best = MemoryLimit(total, "this machine's memory")
    base = Path(root)
    try:
        lines = (base / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return best
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # cgroup v2: "0::/path"
            mount, name = base / "sys/fs/cgroup", "memory.max"
        elif "memory" in controllers.split(","):
            mount, name = base / "sys/fs/cgroup/memory", "memory.limit_in_bytes"
        else:
            continue
        for limit in _limits(mount, path, name):
            if limit < best.bytes:
                best = MemoryLimit(limit, f"the container's memory limit (cgroup {name})")
    return best


def _limits(mount: Path, path: str, name: str) -> list[int]:
    """The limits in ``name`` from ``mount/path`` up to ``mount`` (absent or ``max``: none)."""
    out = []
    here = (mount / path.lstrip("/")).resolve()
    top = mount.resolve()
    while True:
        try:
            text = (here / name).read_text().strip()
        except OSError:
            text = "max"
        if text.isdigit():
            out.append(int(text))
        if here == top or top not in here.parents:
            return out
        here = here.parent


def check_pool(capacity: int, root: str = "/") -> None:
    """Refuse a CPU pool larger than the memory this process may use; warn about one that
    leaves little for the rest (vLLM, the model, its KV cache)."""
    limit = memory_limit(root)
    gib, lim = capacity / 2**30, limit.bytes / 2**30
    if capacity > limit.bytes:
        raise ConfigError(
            f"max_local_cpu_size asks for a {gib:.1f} GiB CPU pool in this process, more than "
            f"{lim:.1f} GiB, {limit.what}: it would be killed for memory once the cache filled. "
            "Lower max_local_cpu_size (every TP rank has a pool of its own)"
        )
    if capacity > WARN_SHARE * limit.bytes:
        log.warning(
            "kvmesh: the %.1f GiB CPU pool is %.0f%% of %.1f GiB, %s: vLLM, the model and its KV "
            "cache need the rest, and the process is killed for memory once the cache fills "
            "if they do not fit (every TP rank has a pool of its own)",
            gib,
            100 * capacity / limit.bytes,
            lim,
            limit.what,
        )
