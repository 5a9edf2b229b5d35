"""Replaying request workloads through a real CacheEngine to get the disk tier's block trace.

Workloads are token arrays, one per request, in arrival order:

* the shared Mooncake conversation trace (``/work/shared/traces`` or ``KVMESH_TRACES``):
  each 512-token block id ``h`` expands to tokens ``h * 512 + [0, 512)``, so equal ids give
  equal tokens and the prefix structure is kept exactly; the last block may be partial;
* a synthetic multi-tenant chat: tenants share a system prompt, each user's conversation
  grows turn by turn, a few conversations are active at a time.

:func:`replay` drives the engine like a vLLM replica would (look up and load the cached
prefix, then store the whole prompt) with the disk tier's I/O trace on, and times every
``put`` the write-behind thread makes. :func:`loop_ext4` gives a small real ext4 (a loop
device over a file in ``/dev/shm``) so FIEMAP extents are the addresses of a device of
exactly the simulated size; where loop devices are not allowed (not root) the caller falls
back to a plain directory and :func:`kvmesh.storage.trace.compact`.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvmesh.core.engine import CacheEngine
from kvmesh.core.keys import ChunkKey, KVLayout
from kvmesh.paths import traces_dir
from kvmesh.tiers.base import ChunkData
from kvmesh.tiers.disk import DiskTier
from kvmesh.tiers.segments import SegmentTier

BLOCK = 512
GB = 1024**3
DEFAULT_TRACES = traces_dir()


def conversation_requests(n: int, path: str | None = None) -> list[np.ndarray]:
    """The first ``n`` requests of the conversation trace as token arrays."""
    base = os.environ.get("KVMESH_TRACES", DEFAULT_TRACES)
    path = path or os.path.join(base, "conversation_trace.jsonl")
    out: list[np.ndarray] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if len(out) >= n:
                break
            r = json.loads(line)
            ids = np.asarray(r["hash_ids"], dtype=np.uint32)
            toks = (ids[:, None] * BLOCK + np.arange(BLOCK, dtype=np.uint32)).ravel()
            out.append(toks[: max(1, min(int(r["input_length"]), len(toks)))])
    return out


def multi_tenant_requests(
    n: int,
    tenants: int = 8,
    system_tokens: int = 1500,
    turn_tokens: int = 400,
    turns: int = 6,
    active: int = 8,
    seed: int = 18,
) -> list[np.ndarray]:
    """``n`` requests of a synthetic multi-tenant chat (see the module docstring)."""
    rng = random.Random(seed)
    next_tok = [1 << 30]

    def fresh(k: int) -> np.ndarray:
        start = next_tok[0]
        next_tok[0] += k
        return np.arange(start, start + k, dtype=np.uint32)

    systems = [fresh(system_tokens) for _ in range(tenants)]
    convs: list[list[Any]] = []  # [history tokens, turns left]
    out: list[np.ndarray] = []
    while len(out) < n:
        while len(convs) < active:
            convs.append([systems[rng.randrange(tenants)], turns])
        idx = rng.randrange(len(convs))
        c = convs[idx]
        c[0] = np.concatenate([c[0], fresh(rng.randint(turn_tokens // 2, 3 * turn_tokens // 2))])
        out.append(c[0])
        c[1] -= 1
        if c[1] == 0:
            convs.pop(idx)
    return out


@dataclass
class ReplayResult:
    trace_path: str
    puts: list[tuple[float, float, int]] = field(default_factory=list)  # (start, seconds, chunks)
    seconds: float = 0.0
    stats: dict[str, Any] = field(default_factory=dict)
    hit_tokens: int = 0
    prompt_tokens: int = 0
    placement: dict[str, Any] = field(default_factory=dict)


def replay(
    requests: Sequence[np.ndarray],
    config: dict[str, Any],
    layout: KVLayout,
    trace_path: str,
    read_back: int = 0,
) -> tuple[ReplayResult, list[float]]:
    """Run ``requests`` through an engine with ``config`` (disk tier on, its I/O trace at
    ``trace_path``). Returns the result and, if ``read_back``, the latencies (s) of that
    many cold reads of chunks the disk tier holds at the end (page cache dropped per file)."""
    cfg = {**config, "disk_io_trace": trace_path}
    res = ReplayResult(trace_path)
    lock = threading.Lock()
    with CacheEngine(cfg, layout=layout, model_id="bench-disk") as eng:
        disk = eng.lower["disk"]
        inner_put = disk.put

        def timed_put(keys: Sequence[ChunkKey], chunks: Sequence[ChunkData]) -> list[bool]:
            t0 = time.perf_counter()
            out = inner_put(keys, chunks)
            with lock:
                res.puts.append((time.time(), time.perf_counter() - t0, len(keys)))
            return out

        disk.put = timed_put  # type: ignore[method-assign]  # the write-behind thread calls this
        noop = lambda s, e, out: None  # noqa: E731  # KV bytes do not matter to the disk
        t0 = time.perf_counter()
        for toks in requests:
            with eng.retrieve_chunks(toks) as got:
                res.hit_tokens += got[-1].end if got else 0
            res.prompt_tokens += len(toks)
            eng.store_with(toks, noop)
        eng.wait_for_writes(120)
        res.seconds = time.perf_counter() - t0
        res.stats = eng.stats()
        status = getattr(disk, "status", None)
        res.placement = status() if status else disk.placement.status(disk.path)  # type: ignore[attr-defined]
        lat = _cold_reads(disk, read_back, int(cfg.get("chunk_size", 256))) if read_back else []
    return res, lat


def _cold_reads(disk: Any, n: int, chunk_size: int) -> list[float]:
    keys = sorted(disk.keys())
    random.Random(0).shuffle(keys)
    out = []
    for text in keys[:n]:
        key = ChunkKey.parse(text, chunk_size)
        drop_cache(disk, text)
        t0 = time.perf_counter()
        got = disk.get([key])[0]
        if got is not None:
            out.append(time.perf_counter() - t0)
    return out


def drop_cache(disk: object, text: str) -> None:
    """Evict one chunk's pages from the page cache: the disk tier's own
    ``drop_page_cache`` (that file or byte range only, never the machine-wide drop_caches,
    which would disturb everyone else). Raises TypeError for a tier that is not on disk."""
    if not isinstance(disk, DiskTier | SegmentTier):
        raise TypeError(f"{type(disk).__name__} is not a disk tier: no page cache to drop")
    disk.drop_page_cache(text)


@contextlib.contextmanager
def loop_ext4(size_bytes: int, backing_dir: str = "/dev/shm") -> Iterator[str | None]:
    """A fresh ext4 of ``size_bytes`` on a loop device (mounted with ``discard``, so deletes
    reach the device as trims); ``None`` where that is not possible here."""
    if os.geteuid() != 0 or not shutil.which("mkfs.ext4") or not os.path.isdir(backing_dir):
        yield None
        return
    tmp = tempfile.mkdtemp(prefix="kvmesh-loop-")
    img = os.path.join(backing_dir, os.path.basename(tmp) + ".img")
    mounted = False
    try:
        with open(img, "wb") as f:
            f.truncate(size_bytes)
        subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", img], check=True, capture_output=True)
        subprocess.run(["mount", "-o", "loop,discard", img, tmp], check=True, capture_output=True)
        mounted = True
    except (OSError, subprocess.CalledProcessError):
        pass
    try:
        yield tmp if mounted else None
    finally:
        if mounted and subprocess.run(["umount", tmp], check=False, capture_output=True).returncode:
            # Still busy (a file left open by a caller): detach lazily rather than leak it.
            subprocess.run(["umount", "-l", tmp], check=False, capture_output=True)
        with contextlib.suppress(OSError):
            os.unlink(img)
        shutil.rmtree(tmp, ignore_errors=True)


def usable_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize
