"""Keep kvmesh's background threads off the cores vLLM-CPU computes on.

vLLM-CPU binds its worker process to the cores of its OpenMP threads (``core ids=[0]`` with
one reserved core on a 2-core machine) and leaves the reserved cores to its engine-core and
API processes. Threads kvmesh starts inside the worker inherit that binding, so without this
the saver, the lookup and load readers, the write-behind queues and the RPC threads would
all share the forward's core, and every microsecond they run is taken from a step. Here
each such thread moves itself to the cores its process may use but the worker's compute
threads do not (the parent process's affinity minus the worker's); where there are none
(a GPU worker is not bound, or the machine has one core) nothing changes.

Those cores are this replica's own only when vLLM chose the binding (``VLLM_CPU_OMP_THREADS_BIND``
unset or ``auto``: it binds to all cores but the ``VLLM_CPU_NUM_OF_RESERVED_CPU`` ones it leaves
to the replica's engine core and server). An explicit list means the operator split the cores
between replicas, and the cores this worker is not bound to are another replica's compute
cores: threads moved there take turns with that replica's forward, and every GIL hand-off
between them and this worker's compute thread waits for a core the other replica holds (two
replicas bound to one core each served 1.5 requests/s with kvmesh's threads on each other's
core, against 39 alone). So with an explicit list the threads stay where they are.
``KVMESH_BACKGROUND_CPUS`` overrides the choice: ``auto`` (the rule above), ``off`` (never
move), or a list of core ids (``2,3`` or ``2-3``).
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


ENV = "KVMESH_BACKGROUND_CPUS"


def parse_cpus(text: str) -> frozenset[int]:
    """``"2,3"`` / ``"2-3"`` -> {2, 3}; raises ``ValueError`` for anything else."""
    out: set[int] = set()
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        first, last = int(lo), int(hi) if sep else int(lo)
        if first < 0 or last < first:
            raise ValueError(f"bad core range {part.strip()!r}")
        out.update(range(first, last + 1))
    return frozenset(out)


def _decide(environ: dict[str, str] | None = None) -> frozenset[int]:
    env = os.environ if environ is None else environ
    if not hasattr(os, "sched_getaffinity"):
        return frozenset()
    choice = env.get(ENV, "auto").strip().lower() or "auto"
    if choice == "off":
        return frozenset()
    if choice != "auto":
        try:
            return parse_cpus(choice)
        except ValueError:
            log.warning("kvmesh: %s=%r is not auto, off or a list of cores; using auto", ENV, choice)
    bind = env.get("VLLM_CPU_OMP_THREADS_BIND", "auto").strip().lower()
    if bind not in ("", "auto"):
        return frozenset()  # the operator split the cores: the others are not ours
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
