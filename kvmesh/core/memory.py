"""Preallocated host memory: a pool of fixed-size slots handing out ref-counted objects.

Every chunk of one engine has the same byte size (``chunk_size`` tokens of one layout), so
the pool is cut into equal slots: no fragmentation, O(1) allocate and free. A copy into
this memory runs at memcpy speed; a copy that allocates (``torch.empty`` + copy, or
``bytes(...)``) pays page faults and runs several times slower here.

Ownership: :meth:`MemoryPool.allocate` returns an object with one reference. Whoever keeps
a pointer to it holds a reference (:meth:`MemoryObj.ref_up`) and gives it back with
:meth:`MemoryObj.release`; the slot returns to the pool when the last reference goes, so a
buffer handed to a reader or to a pending disk write is never reused underneath it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from typing import Any

import numpy as np
import torch

from kvmesh.core.cudart import cuda_runtime
from kvmesh.core.keys import ChunkKey, KVLayout
from kvmesh.errors import ClosedError, ConfigError

log = logging.getLogger(__name__)

_TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}


def torch_dtype(name: str) -> torch.dtype:
    return _TORCH_DTYPES[name]


def copy_kv(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for same-shape, same-dtype KV, at memcpy speed.

    torch's strided copy moves one element at a time; 2-byte elements run at about half
    the speed of a contiguous copy here. Viewed as 8-byte words (the innermost dimension is
    contiguous and a multiple of 8 bytes for every real layout) the same copy runs at full
    speed.
    """
    if dst.dtype == src.dtype and dst.element_size() < 8 and dst.dim() > 0:
        try:
            dst.view(torch.int64).copy_(src.view(torch.int64))
            return
        except RuntimeError:
            pass  # innermost dim not 8-byte aligned/contiguous: fall back
    dst.copy_(src)


class MemoryObj:
    """One chunk's KV bytes in a pool slot, plus what identifies them."""

    __slots__ = ("_refs", "key", "layout", "nbytes", "pool", "slot", "tokens")

    def __init__(self, pool: MemoryPool, slot: int, nbytes: int) -> None:
        self.pool = pool
        self.slot = slot
        self.nbytes = nbytes
        self._refs = 1
        self.key: ChunkKey | None = None
        self.layout: KVLayout | None = None
        self.tokens: np.ndarray | None = None

    @property
    def refs(self) -> int:
        return self._refs

    def ref_up(self) -> MemoryObj:
        with self.pool._lock:
            if self._refs <= 0:
                raise ClosedError("ref_up on a released memory object")
            self._refs += 1
        return self

    def release(self) -> None:
        with self.pool._lock:
            if self._refs <= 0:
                raise ClosedError("memory object released more often than referenced")
            self._refs -= 1
            if self._refs == 0:
                self.pool._free_slot(self.slot)
            # Any dropped reference may make a chunk evictable: wake allocators waiting on it.
            self.pool._releases += 1
            self.pool._released.notify_all()

    def byte_view(self) -> torch.Tensor:
        """The object's bytes as a flat uint8 tensor (no copy)."""
        start = self.slot * self.pool.slot_bytes
        return self.pool.buffer[start : start + self.nbytes]

    def raw(self) -> memoryview:
        """The object's bytes as a memoryview (no copy), for I/O."""
        start = self.slot * self.pool.slot_bytes
        return self.pool.array[start : start + self.nbytes].data

    def tensor(self) -> torch.Tensor:
        """Typed view ``[layers, 2, tokens, kv_heads, head_size]`` (no copy)."""
        if self.layout is None or self.tokens is None:
            raise ClosedError("memory object has no layout yet")
        shape = self.layout.shape(len(self.tokens))
        return self.byte_view().view(torch_dtype(self.layout.dtype)).view(shape)


REGISTER_PIECE = 64 << 30  # cudaHostRegister fails on larger ranges on some drivers (vLLM splits too)


def _cuda_ok(err: Any) -> bool:
    code = err[0] if isinstance(err, tuple) else err
    return int(code) == 0


def register_host(
    cudart: Any, ptr: int, nbytes: int, slot_bytes: int, piece: int = REGISTER_PIECE
) -> list[int]:
    """Page-lock ``nbytes`` at ``ptr`` with ``cudaHostRegister`` in pieces of at most
    ``piece`` bytes, each a whole number of slots (a slot never straddles two
    registrations). Returns the pieces' addresses (for :func:`unregister_host`), or ``[]``
    on a failure: then the pieces done are unregistered and CUDA's last error is cleared,
    so the caller's fallback and later CUDA calls see no stale error."""
    step = max(slot_bytes, piece // slot_bytes * slot_bytes)
    done: list[int] = []
    try:
        for off in range(0, nbytes, step):
            if not _cuda_ok(cudart.cudaHostRegister(ptr + off, min(step, nbytes - off), 0)):
                raise RuntimeError("cudaHostRegister failed")
            done.append(ptr + off)
        return done
    except (AttributeError, RuntimeError, TypeError):
        unregister_host(cudart, done)  # also clears the error the failed call left
        return []


def unregister_host(cudart: Any, pieces: list[int]) -> None:
    """Undo :func:`register_host`. Must run before the memory is freed: the driver keeps a
    registration of freed memory, and a later allocation at the same addresses then fails
    its copies ("invalid argument") and its own registration ("already registered")."""
    for ptr in pieces:
        with contextlib.suppress(Exception):
            cudart.cudaHostUnregister(ptr)
    with contextlib.suppress(Exception):
        cudart.cudaGetLastError()  # clears the thread's last error (a refusal leaves it set)


class MemoryPool:
    """``capacity_bytes`` of host memory cut into slots of ``slot_bytes``.

    The buffer is allocated once, up front; its pages are touched lazily by the OS.
    """

    def __init__(self, capacity_bytes: int, slot_bytes: int) -> None:
        if slot_bytes <= 0:
            raise ValueError(f"slot_bytes must be positive, got {slot_bytes}")
        num_slots = capacity_bytes // slot_bytes
        if num_slots < 1:
            raise ValueError(
                f"the CPU pool ({capacity_bytes} bytes) cannot hold one chunk of {slot_bytes} bytes; "
                "raise max_local_cpu_size or lower chunk_size"
            )
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        # torch allocates; a numpy array holds that tensor and every view the pool hands
        # out holds the array, so the array dies only once the pool and all its views are
        # gone, just before the memory is freed: when a registration is undone (pin()).
        self.array: np.ndarray = torch.empty(num_slots * slot_bytes, dtype=torch.uint8).numpy()
        self.buffer = torch.from_numpy(self.array)
        self._free = list(range(num_slots - 1, -1, -1))
        self._lock = threading.Lock()
        self._released = threading.Condition(self._lock)
        self._releases = 0  # references dropped so far; see wait_for_release
        self.pinned = False
        self.registered = False  # pinned in place by cudaHostRegister (not reallocated pinned)

    def pin(self) -> None:
        """Page-lock the buffer, once, before any slot is used (the vLLM connector does
        this when the KV lives on a GPU): copies between it and the device then run
        asynchronously (``non_blocking``) at full PCIe/NVLink speed.

        The existing buffer is registered with CUDA (``cudaHostRegister``, through the
        runtime torch loaded: :mod:`kvmesh.core.cudart`) rather than reallocated: torch's
        pinned allocator rounds every allocation up to a power of two, which for a 40 GiB
        pool would lock 64 GiB. Where registering fails or is not available the buffer is
        reallocated pinned instead."""
        if self.pinned:
            return
        if not torch.cuda.is_available():
            raise ConfigError("cannot pin the CPU pool: CUDA is not available in this process")
        with self._lock:
            if len(self._free) != self.num_slots:
                raise ClosedError("the pool must be pinned before any slot is allocated")
            nbytes = self.buffer.numel()
            cudart = cuda_runtime()
            pieces = (
                []
                if cudart is None
                else register_host(cudart, self.buffer.data_ptr(), nbytes, self.slot_bytes)
            )
            if pieces:
                # Unregistered when the array is freed (weakref callbacks run before numpy
                # frees the data), not at exit, when CUDA may already be torn down.
                weakref.finalize(self.array, unregister_host, cudart, pieces).atexit = False
                self.registered = True
            else:
                why = "failed" if cudart is not None else "is not reachable (no libcudart loaded)"
                log.warning("kvmesh: cudaHostRegister %s; allocating the %d-byte pool pinned", why, nbytes)
                self.buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
                self.array = self.buffer.numpy()
            self.pinned = True

    @property
    def free_slots(self) -> int:
        with self._lock:
            return len(self._free)

    @property
    def used_bytes(self) -> int:
        return (self.num_slots - self.free_slots) * self.slot_bytes

    def allocate(self, nbytes: int) -> MemoryObj | None:
        """A fresh object of ``nbytes`` (≤ slot size), or ``None`` when no slot is free."""
        if nbytes > self.slot_bytes or nbytes <= 0:
            raise ValueError(f"cannot allocate {nbytes} bytes from a pool of {self.slot_bytes}-byte slots")
        with self._lock:
            if not self._free:
                return None
            return MemoryObj(self, self._free.pop(), nbytes)

    def wait_for_free(self, timeout: float) -> bool:
        """Block until some slot is released (or ``timeout`` passes)."""
        with self._lock:
            if self._free:
                return True
            return self._released.wait(timeout)

    @property
    def releases(self) -> int:
        with self._lock:
            return self._releases

    def wait_for_release(self, since: int, timeout: float) -> bool:
        """Block until a reference is dropped after :attr:`releases` read ``since``
        (a slot freed, or a chunk a reader or a write held becoming evictable)."""
        with self._lock:
            return self._released.wait_for(lambda: self._releases != since, timeout)

    def _free_slot(self, slot: int) -> None:
        # Called with self._lock held.
        self._free.append(slot)
        self._released.notify_all()
