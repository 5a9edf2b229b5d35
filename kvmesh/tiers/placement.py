"""Lifetime classes of disk writes, and where each class goes (``disk_placement``).

The engine tags every disk write with a lifetime class it knows:

* ``store``   write-through store of a new chunk;
* ``evict``   write-back of a chunk the cpu tier evicted (writes come in bursts);
* ``tail``    a prompt's partial last chunk (superseded when the conversation continues);
* ``pinned``  pinned / prewarmed / moved-here documents (long-lived);
* ``rewrite`` a rewrite of stored data (recode, segment reclaim of live chunks);
* ``meta``    index / segment headers.

``disk_placement_map`` maps each class to a lifetime level (``none | short | medium | long
| extreme``, Linux's ``RWH_WRITE_LIFE_*``); the levels are the placement's streams:

* ``none``: file per chunk, no placement (today's layout);
* ``hints``: file per chunk, each file tagged with ``fcntl(F_SET_RW_HINT)`` of its level;
  kernels with an FDP-capable NVMe driver can map hints to placement handles. Whether the
  kernel accepted them is reported (:meth:`Placement.status`);
* ``segments``: per-level log-structured segments of ``disk_ru_size`` bytes (see
  :mod:`kvmesh.tiers.segments`), reclaimed whole.
"""

from __future__ import annotations

import fcntl
import os
import platform
import struct
import threading
from collections.abc import Mapping
from typing import Any

from kvmesh.errors import ConfigError

LIFETIME_CLASSES = ("store", "evict", "tail", "pinned", "rewrite", "meta")
MODES = ("none", "hints", "segments")
# Linux include/uapi/linux/fcntl.h: F_LINUX_SPECIFIC_BASE + 12, and the RWH_WRITE_LIFE_* values.
F_SET_RW_HINT = 1024 + 12
F_GET_RW_HINT = 1024 + 11
LEVELS = {"not_set": 0, "none": 1, "short": 2, "medium": 3, "long": 4, "extreme": 5}
DEFAULT_MAP: dict[str, str] = {
    "store": "medium",
    "evict": "medium",
    "tail": "short",
    "pinned": "extreme",
    "rewrite": "long",
    "meta": "none",
}
DEFAULT_RU_SIZE = 64 << 20


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ConfigError(f"disk_placement={mode!r} is unknown; valid: {', '.join(MODES)}")
    return mode


def check_class(cls: str) -> str:
    """An empty class (a caller that does not know) counts as a plain ``store``."""
    cls = cls or "store"
    if cls not in LIFETIME_CLASSES:
        raise ConfigError(f"lifetime class {cls!r} is unknown; valid: {', '.join(LIFETIME_CLASSES)}")
    return cls


class Placement:
    """Where a write of a given lifetime class goes: its level, stream, and (for ``hints``)
    the fcntl hint applied to the file. Thread-safe."""

    def __init__(
        self, mode: str = "none", ru_size: int = DEFAULT_RU_SIZE, class_map: Mapping[str, str] | None = None
    ) -> None:
        self.mode = check_mode(mode)
        if ru_size < 1 << 20 or ru_size % 4096:
            raise ConfigError(f"disk_ru_size={ru_size} must be a multiple of 4096 and >= 1 MiB")
        self.ru_size = ru_size
        self.class_map = dict(DEFAULT_MAP)
        for cls, level in (class_map or {}).items():
            check_class(cls)
            if level not in LEVELS:
                raise ConfigError(
                    f"disk_placement_map[{cls!r}]={level!r} is unknown; valid: {', '.join(LEVELS)}"
                )
            self.class_map[cls] = level
        # Streams: the distinct levels, in a fixed order, so the same map gives the same ids.
        self.levels = sorted(set(self.class_map.values()), key=LEVELS.__getitem__)
        self._lock = threading.Lock()
        self.hints_accepted = 0
        self.hints_refused = 0
        self.hint_error: str | None = None

    def level(self, cls: str) -> str:
        return self.class_map[check_class(cls)]

    def stream(self, cls: str) -> int:
        """Index of ``cls``'s stream (its level) among this placement's levels."""
        return self.levels.index(self.level(cls))

    def apply(self, fd: int, cls: str) -> bool:
        """Tag open file ``fd`` with ``cls``'s write-lifetime hint (``hints`` mode only).
        Returns whether the kernel took it; a refusal is counted, never raised: the write
        goes ahead unplaced."""
        if self.mode != "hints":
            return False
        hint = LEVELS[self.level(cls)]
        try:
            fcntl.fcntl(fd, F_SET_RW_HINT, struct.pack("=Q", hint))
            back = struct.unpack("=Q", fcntl.fcntl(fd, F_GET_RW_HINT, bytes(8)))[0]
            ok = bool(back == hint)
            err = None if ok else f"kernel kept hint {back} instead of {hint}"
        except OSError as exc:
            ok, err = False, f"F_SET_RW_HINT failed: {exc.strerror} (errno {exc.errno})"
        with self._lock:
            if ok:
                self.hints_accepted += 1
            else:
                self.hints_refused += 1
                self.hint_error = err
        return ok

    def status(self, path: str | None = None) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = {
                "mode": self.mode,
                "ru_size": self.ru_size,
                "class_map": dict(self.class_map),
                "kernel": platform.release(),
            }
            if self.mode == "hints":
                out.update(
                    hints_accepted=self.hints_accepted,
                    hints_refused=self.hints_refused,
                    hint_error=self.hint_error,
                )
        if path is not None:
            out["device_write_streams"] = device_write_streams(path)
        return out


def device_write_streams(path: str) -> int | None:
    """``max_write_streams`` of the block device under ``path`` (Linux 6.16+ exposes the
    FDP placement handles an NVMe namespace offers there); ``None`` where unknown."""
    try:
        dev = os.stat(path).st_dev
        sysdir = os.path.realpath(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
        for cand in (sysdir, os.path.dirname(sysdir)):
            f = os.path.join(cand, "queue", "max_write_streams")
            if os.path.exists(f):
                with open(f, encoding="ascii") as fh:
                    return int(fh.read().strip())
    except (OSError, ValueError):
        return None
    return None
