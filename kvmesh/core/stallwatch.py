"""Who held the process up: every thread's stack, dumped when kvmesh's service loops all stop.

A listener's selector thread wakes at least every 50 ms. When it wakes seconds late, its log
line says so (``held up``), but not why: another thread held the interpreter lock, or the
process got no CPU. Set ``KVMESH_STALL_DUMP_S`` (seconds; off by default) and each service
loop :func:`pet`\\ s a process-wide watchdog of :mod:`faulthandler` at most every
:data:`PET_S`; when no loop has petted it for that long, faulthandler's own C thread (which
needs no interpreter lock) writes every Python thread's stack to stderr, the replica's log.
The thread that held the lock is the one not waiting in a ``select``, ``wait`` or ``recv``.

One watchdog per process: a loop's pet replaces any other's, so it fires only when every
petting loop is stopped (a held interpreter lock stops them all). ``faulthandler`` keeps
one deferred dump per process, so with this on nothing else may use
``faulthandler.dump_traceback_later`` (pytest's ``faulthandler_timeout`` among them).

The stacks show who held the lock, not a process that got no CPU at all. With the setting
on, a loop also keeps a :func:`usage` snapshot at most :data:`USAGE_S` old, and its ``held
up`` line says what happened :func:`meanwhile`: the CPU time every thread of the process
used (a thread holding the lock runs up seconds of it), its major page faults (code or data
read back from disk: memory reclaimed while idle) and, with psutil, how busy each CPU the
thread may run on was (other processes on it) and the time the hypervisor took from it
(``steal``: a virtual CPU not scheduled at all).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import resource
import threading
import time
from dataclasses import dataclass

try:  # vLLM's dependency; optional for kvmesh (usage() then reports no per-CPU times)
    import psutil
except ImportError:  # pragma: no cover - present beside vLLM
    psutil = None

log = logging.getLogger(__name__)

ENV = "KVMESH_STALL_DUMP_S"
STDERR = 2  # the descriptor, not sys.stderr: a replica's log, whatever wraps sys.stderr
PET_S = 1.0  # re-armed at most this often (a third of the setting if less): a dump comes after
# a stall of between two thirds of the setting and all of it

USAGE_S = 1.0  # a loop's usage snapshot is renewed when this old

_lock = threading.Lock()
_after: float | None = None  # the setting, read once per process
_next = 0.0  # monotonic time of the next re-arm
_pets = 0  # loops petting now (the watchdog is cancelled when the last one stops)


def setting(environ: dict[str, str] | None = None) -> float:
    """``KVMESH_STALL_DUMP_S`` as seconds; 0 (off) when unset, not a number or below 1."""
    raw = (os.environ if environ is None else environ).get(ENV, "").strip()
    if not raw:
        return 0.0
    try:
        value = float(raw)
    except ValueError:
        log.warning("kvmesh: %s=%r is not a number of seconds: stall dumps stay off", ENV, raw)
        return 0.0
    if value < 1.0:
        log.warning("kvmesh: %s=%r is under 1 s: stall dumps stay off", ENV, raw)
        return 0.0
    return value


def _seconds() -> float:
    global _after
    if _after is None:
        _after = setting()
    return _after


def enabled() -> bool:
    """Whether stall dumps are on in this process."""
    return _seconds() > 0


def started() -> None:
    """A service loop begins petting."""
    global _pets
    if _seconds() > 0:
        with _lock:
            _pets += 1


def pet(now: float) -> None:
    """Called by a service loop each time it runs (cheap when it is not yet time to re-arm)."""
    global _next
    after = _seconds()
    if after <= 0 or now < _next:
        return
    with _lock:
        if _pets and now >= _next:
            _next = now + min(PET_S, after / 3)
            faulthandler.dump_traceback_later(after, file=STDERR)


def stopped() -> None:
    """A service loop stops petting; the last one cancels the pending dump."""
    global _pets, _next
    if _seconds() <= 0:
        return
    with _lock:
        _pets = max(0, _pets - 1)
        if not _pets:
            faulthandler.cancel_dump_traceback_later()
            _next = 0.0


def reset_for_tests(after: float | None = None) -> None:
    """Forget the setting (read again on next use) or force ``after``; cancel the dump."""
    global _after, _next, _pets
    with _lock:
        _after, _next, _pets = after, 0.0, 0
        faulthandler.cancel_dump_traceback_later()


@dataclass(frozen=True)
class Usage:
    """What the process and the machine had used by ``at`` (monotonic seconds)."""

    at: float
    cpu_s: float  # this process's user + system CPU time, every thread
    major_faults: int  # this process's page faults that read from disk
    steal_s: tuple[float, ...] = ()  # per CPU, the time the hypervisor ran something else (psutil)
    busy_s: tuple[float, ...] = ()  # per CPU, the time it ran anything (psutil)


def usage(now: float | None = None) -> Usage:
    """A snapshot for :func:`meanwhile` (~30 us: one ``getrusage`` and ``/proc/stat``)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    steal: tuple[float, ...] = ()
    busy: tuple[float, ...] = ()
    if psutil is not None:
        try:
            per_cpu = psutil.cpu_times(percpu=True)
            steal = tuple(float(getattr(t, "steal", 0.0)) for t in per_cpu)
            busy = tuple(
                float(sum(t)) - t.idle - float(getattr(t, "iowait", 0.0)) - float(getattr(t, "steal", 0.0))
                - float(getattr(t, "guest", 0.0)) - float(getattr(t, "guest_nice", 0.0))
                for t in per_cpu
            )  # fmt: skip  # guest time is counted in user time too
        except Exception:  # no /proc: the line goes without them
            steal, busy = (), ()
    now = time.monotonic() if now is None else now
    return Usage(now, ru.ru_utime + ru.ru_stime, ru.ru_majflt, steal, busy)


def meanwhile(before: Usage, after: Usage, cpus: set[int] | None = None) -> str:
    """What changed from ``before`` to ``after``, for a ``held up`` line; ``cpus``: the CPUs
    the held-up thread may run on (theirs only; every CPU's when None). Reads as: much CPU in
    the process, another of its threads held the interpreter lock; major faults, memory read
    back from disk; steal, a virtual CPU not scheduled; the thread's CPUs busy while the
    process used little, other processes had them."""
    out = (
        f"meanwhile ({after.at - before.at:.1f} s) the process used {after.cpu_s - before.cpu_s:.2f} s "
        f"of CPU in all its threads and had {after.major_faults - before.major_faults} major page faults"
    )

    def per_cpu(b: tuple[float, ...], a: tuple[float, ...]) -> str:
        if not b or len(b) != len(a):
            return ""
        return ", ".join(
            f"cpu{i} {y - x:.2f} s"
            for i, (x, y) in enumerate(zip(b, a, strict=True))
            if cpus is None or i in cpus
        )

    stolen, busy = per_cpu(before.steal_s, after.steal_s), per_cpu(before.busy_s, after.busy_s)
    if busy:
        out += f"; busy (every process) {busy}"
    if stolen:
        out += f"; the hypervisor took (steal) {stolen}"
    if cpus is not None:
        out += f"; the thread runs on cpu {','.join(map(str, sorted(cpus)))}"
    return out


__all__ = [
    "ENV",
    "PET_S",
    "USAGE_S",
    "Usage",
    "enabled",
    "meanwhile",
    "pet",
    "reset_for_tests",
    "setting",
    "started",
    "stopped",
    "usage",
]
