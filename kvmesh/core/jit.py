"""``kernel``: numba's ``njit`` for kvmesh's compiled loops (codecs, the FTL simulator).

Each kernel is compiled once and kept in numba's on-disk cache: next to the module when its
directory is writable, else in the user's cache directory (``NUMBA_CACHE_DIR`` overrides
both). A container with a read-only root filesystem and no writable home has neither, and
numba then refuses ``cache=True`` at import. Such a process compiles its kernels in memory
instead, once per process, and logs it once: a slower start, never a failed import.

Kernels release the GIL (``nogil``): they touch no Python object, and a tier's I/O thread
running one leaves the interpreter to vLLM's forward loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar, cast

import numpy as np
from numba import njit

log = logging.getLogger(__name__)
_F = TypeVar("_F", bound=Callable[..., Any])
_uncached: list[str] = []


def kernel(fn: _F) -> _F:
    """``numba.njit(cache=True, nogil=True)`` with the function's type kept (numba has no
    stubs), or without the disk cache where numba finds nowhere to write it."""
    try:
        return cast(_F, njit(cache=True, nogil=True)(fn))
    except RuntimeError as exc:  # numba: "cannot cache function ...: no locator available"
        if not _uncached:
            log.warning(
                "numba cannot cache compiled kernels here (%s): compiling them in each process; "
                "set NUMBA_CACHE_DIR to a writable directory to keep them",
                exc,
            )
        _uncached.append(fn.__qualname__)
        return cast(_F, njit(nogil=True)(fn))


def readonly(a: np.ndarray) -> np.ndarray:
    """A read-only view of ``a``. numba compiles a kernel once per argument type, and a
    read-only array is another type: passing inputs read-only whoever made them (a tier's
    ``bytes``, a writable slot) keeps each kernel to one signature, compiled or loaded once."""
    v = a.view()
    v.flags.writeable = False
    return v
