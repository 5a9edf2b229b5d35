"""One disk directory, one owner: an exclusive ``flock`` per disk tier directory, and the
default sub-directory convention.

The lock is ``<dir>/.lock``, held (``flock(LOCK_EX)``) for the tier's lifetime and
released by the kernel when the process dies, so a crashed owner never leaves a stale
lock. The file records the holder's pid and host, which the error a second owner gets
names. ``flock`` locks belong to an open file, so a second tier on the same directory in
the *same* process is refused too.

Directory convention (``disk_subdir``, default ``"auto"``): a tier configured with
``local_disk: /d`` lives in ``/d/rank<k>/slot<n>``: ``k`` is the TP rank (the chunk key's
shard) and ``n`` the lowest slot whose lock is free. Each TP rank and each replica on a host
therefore gets its own directory without configuration, and a restarted replica takes a
free slot back with the chunks its predecessor left there. ``disk_subdir: ""`` uses ``/d``
itself (one process only); any other value ``name`` uses ``/d/name/rank<k>``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket

from kvmesh.errors import ConfigError, DirectoryLockedError

LOCK_NAME = ".lock"
MAX_SLOTS = 64  # replicas of one rank on one host sharing one local_disk


class DirLock:
    """The exclusive lock on one directory (created if missing)."""

    def __init__(self, path: str) -> None:
        self.path = path
        os.makedirs(path, exist_ok=True)
        lock_path = os.path.join(path, LOCK_NAME)
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            who = f"process {holder[0]} on {holder[1]}" if holder else "another process"
            raise DirectoryLockedError(
                f"disk tier directory {path} is in use by {who} (lock {lock_path}); give each "
                "process its own local_disk directory, or leave disk_subdir at 'auto' so each "
                "replica and TP rank gets its own sub-directory",
                holder[0] if holder else None,
            ) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
        self._fd: int | None = fd

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
            os.close(fd)  # closing the last descriptor of the open file drops the flock


def _holder(fd: int) -> tuple[int, str] | None:
    try:
        pid, host = os.pread(fd, 256, 0).decode().split()[:2]
        return int(pid), host
    except (OSError, ValueError, UnicodeDecodeError):
        return None  # the holder has not written its pid yet


def claim(path: str, subdir: str, shard: int) -> tuple[str, DirLock]:
    """Choose and lock the directory of a disk tier configured at ``path`` (see the module
    docstring): ``(directory, its lock)``."""
    if subdir == "":
        return path, DirLock(path)
    if subdir != "auto":
        if os.sep in subdir or subdir in (".", ".."):
            raise ConfigError(f"disk_subdir {subdir!r} must be 'auto', '' or a plain directory name")
        where = os.path.join(path, subdir, f"rank{shard}")
        return where, DirLock(where)
    base = os.path.join(path, f"rank{shard}")
    for n in range(MAX_SLOTS):
        where = os.path.join(base, f"slot{n}")
        try:
            return where, DirLock(where)
        except DirectoryLockedError:
            continue
    raise DirectoryLockedError(
        f"all {MAX_SLOTS} slots under {base} are held by live processes; give this replica "
        "another local_disk directory"
    )
