"""The three CUDA runtime calls the pool's page-locking needs, from the runtime torch loaded.

``cudaHostRegister`` reports a failure in two places: its return value and the calling
thread's *last error*, which stays set until ``cudaGetLastError`` reads it. torch's
``torch.cuda.cudart()`` binds ``cudaHostRegister`` and ``cudaHostUnregister`` but not
``cudaGetLastError``, and every ATen kernel launch checks the last error: a refused
registration left uncleared fails the next, unrelated kernel of that thread. So the calls
go through the very ``libcudart`` torch's own kernels use (found among the libraries this
process has loaded, as vLLM finds it for its CUDA IPC): a second copy of the runtime would
hold its own last error and clear nothing.

Imports torch only (scripts/gpu_check.py runs it without vLLM).
"""

from __future__ import annotations

import ctypes
from typing import Any


def loaded_library(stem: str, maps: str | None = None) -> str | None:
    """The path of the shared library named ``stem`` (``libcudart``) that this process has
    already loaded (read from ``/proc/self/maps``, or ``maps``), or ``None``."""
    if maps is None:
        try:
            with open("/proc/self/maps") as f:
                maps = f.read()
        except OSError:
            return None
    for line in maps.splitlines():
        fields = line.split(None, 5)
        path = fields[5].strip() if len(fields) == 6 else ""
        name = path.rsplit("/", 1)[-1]
        if name == stem + ".so" or name.startswith(stem + ".so.") or name.startswith(stem + "-"):
            return path
    return None


class CudaRuntime:
    """``cudaHostRegister``, ``cudaHostUnregister`` and ``cudaGetLastError`` of the libcudart
    at ``path`` (ctypes releases the GIL for each call). Each returns the ``cudaError_t``
    code, 0 for success."""

    def __init__(self, path: str) -> None:
        lib = ctypes.CDLL(path)
        self.path = path
        self._register = lib.cudaHostRegister
        self._register.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        self._register.restype = ctypes.c_int
        self._unregister = lib.cudaHostUnregister
        self._unregister.argtypes = [ctypes.c_void_p]
        self._unregister.restype = ctypes.c_int
        self._last = lib.cudaGetLastError
        self._last.argtypes = []
        self._last.restype = ctypes.c_int

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:
        return int(self._register(ctypes.c_void_p(ptr), nbytes, flags))

    def cudaHostUnregister(self, ptr: int) -> int:
        return int(self._unregister(ctypes.c_void_p(ptr)))

    def cudaGetLastError(self) -> int:
        return int(self._last())


def cuda_runtime() -> Any:
    """The runtime torch's kernels use, or ``None`` when it cannot be reached with all three
    calls (torch built without CUDA, or with the runtime linked in statically): then the
    pool is not registered at all (a refused registration could not be cleared) and is
    allocated pinned by torch instead."""
    path = loaded_library("libcudart")
    if path is None:
        return None
    try:
        return CudaRuntime(path)
    except (OSError, AttributeError):
        return None
