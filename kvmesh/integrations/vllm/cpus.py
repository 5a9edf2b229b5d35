"""Keep kvmesh's background threads off the cores vLLM-CPU computes on.

vLLM-CPU binds its worker process to the cores of its OpenMP threads (``core ids=[0]`` with
one reserved core on a 2-core machine) and leaves the reserved cores to its engine-core and
API processes. Threads kvmesh starts inside the worker inherit that binding, so without this
the saver, the lookup and load readers, the write-behind queues and the RPC threads would
all share the forward's core, and every microsecond they run is taken from a step. Here
each such thread moves itself to the cores its process may use but the worker's compute
threads do not (the parent process's affinity minus the worker's); where there are none
(a GPU worker is not bound, or the machine has one core) nothing changes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator

log = logging.getLogger(__name__)

_lock = threading.Lock()
_cpus: frozenset[int] | None = None  # decided once per process, by the first caller


def _decide() -> frozenset[int]:
    if not hasattr(os, "sched_getaffinity"):
        return frozenset()
    try:
        compute = os.sched_getaffinity(0)  # the calling (worker) thread's binding
        allowed = os.sched_getaffinity(os.getppid())  # vLLM's engine core: the reserved cores too
    except OSError:
        return frozenset()
    return frozenset(allowed - compute)


def background_cpus() -> frozenset[int]:
    """The cores for kvmesh's background threads; empty: leave threads where they are."""
    global _cpus
    with _lock:
        if _cpus is None:
            _cpus = _decide()
        return _cpus


def background_thread() -> None:
    """Move the calling thread to :func:`background_cpus` (a thread initializer)."""
    cpus = background_cpus()
    if cpus:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, cpus)  # 0 = this thread only (Linux)


@contextlib.contextmanager
def spawning_background_threads() -> Iterator[None]:
    """Threads started inside this block (by the calling thread) start on the background
    cores; the caller's own binding is restored afterwards."""
    cpus = background_cpus()
    if not cpus:
        yield
        return
    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, mine)
    log.debug("kvmesh: background threads on cores %s (compute on %s)", sorted(cpus), sorted(mine))
