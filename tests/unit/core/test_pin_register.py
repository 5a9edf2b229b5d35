"""Page-locking the CPU pool in pieces (issue #25), against a recording stand-in for CUDA's
runtime (fault injection: no GPU here; the real call runs in scripts/gpu_check.py)."""

from __future__ import annotations

import functools
from typing import Any

import pytest

from kvmesh.core.memory import REGISTER_PIECE, register_host

GIB = 1 << 30


class FakeCudart:
    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at = fail_at
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []
        self.last_error = 0

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> Any:
        if self.fail_at is not None and len(self.registered) == self.fail_at:
            self.last_error = 2  # cudaErrorMemoryAllocation, left set as CUDA does
            return 2
        self.registered.append((ptr, nbytes))
        return 0

    def cudaHostUnregister(self, ptr: int) -> Any:
        self.unregistered.append(ptr)
        return 0

    def cudaGetLastError(self) -> Any:
        err, self.last_error = self.last_error, 0
        return err


def test_a_large_pool_is_registered_in_slot_aligned_pieces_of_at_most_64_gib() -> None:
    cudart = FakeCudart()
    slot = 48 << 20  # 48 MiB does not divide 64 GiB: pieces end on slot boundaries
    total = 3000 * slot  # ~140 GiB
    assert register_host(cudart, 4096, total, slot)
    sizes = [n for _, n in cudart.registered]
    assert sum(sizes) == total and len(sizes) == 3
    assert all(n <= REGISTER_PIECE and n % slot == 0 for n in sizes)
    assert [p for p, _ in cudart.registered] == [4096 + sum(sizes[:i]) for i in range(3)]


def test_a_failed_piece_unregisters_the_others_and_clears_the_error() -> None:
    cudart = FakeCudart(fail_at=1)
    assert not register_host(cudart, 0, 100 * GIB, GIB)
    assert cudart.unregistered == [0]  # the first piece, registered before the failure
    assert cudart.last_error == 0  # no stale error for the fallback's CUDA calls


def test_a_small_pool_is_one_call() -> None:
    cudart = FakeCudart()
    assert register_host(cudart, 0, 10 * GIB, GIB)
    assert cudart.registered == [(0, 10 * GIB)]


def test_the_runtime_is_the_libcudart_this_process_loaded() -> None:
    """The clearing call must reach torch's own runtime (a second copy keeps its own last
    error): the path comes from the process's loaded libraries, versioned or not."""
    from kvmesh.core.cudart import loaded_library

    maps = (
        "7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/libc.so.6\n"
        "7f02-7f03 r-xp 00000000 08:01 2 /opt/venv/nvidia/cu13/lib/libcudart.so.13\n"
        "7f04-7f05 rw-p 00000000 00:00 0 \n"
        "7f06-7f07 r-xp 00000000 08:01 3 /opt/x/libcudart_static_helper.so\n"
    )
    assert loaded_library("libcudart", maps) == "/opt/venv/nvidia/cu13/lib/libcudart.so.13"
    assert loaded_library("libcudart", "7f-8f r-xp 0 0:0 0 /t/lib/libcudart-8a2e1f.so.12\n") == (
        "/t/lib/libcudart-8a2e1f.so.12"  # torch's own bundled, hashed name
    )
    assert loaded_library("libcudart", "7f-8f r-xp 0 0:0 0 /t/libcudart_static_helper.so\n") is None


def test_without_a_loaded_runtime_the_pool_is_not_registered() -> None:
    """On this machine (CPU torch) no libcudart is loaded: no runtime is offered, so no
    registration that could leave an uncleared error is ever made."""
    import torch

    from kvmesh.core.cudart import cuda_runtime, loaded_library

    if torch.cuda.is_available() or loaded_library("libcudart") is not None:
        pytest.skip("a CUDA build: scripts/gpu_check.py checks the real runtime there")
    assert cuda_runtime() is None


def test_a_pinned_pool_is_unregistered_when_its_memory_goes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver keeps a registration of freed memory, and a later allocation at the same
    addresses then fails its copies with "invalid argument" (seen on an H200 when the GPU
    check dropped pools without unregistering): the pool's pieces are unregistered once the
    pool and every view of its memory are gone, and not before."""
    import gc

    import torch

    from kvmesh.core import memory

    cudart = FakeCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(memory, "cuda_runtime", lambda: cudart)
    pool = memory.MemoryPool(10 << 20, 1 << 20)
    monkeypatch.setattr(memory, "register_host", functools.partial(memory.register_host, piece=4 << 20))
    pool.pin()
    base = pool.buffer.data_ptr()
    assert pool.pinned and cudart.registered == [
        (base, 4 << 20),
        (base + (4 << 20), 4 << 20),
        (base + (8 << 20), 2 << 20),
    ]
    view = pool.buffer[5:9]  # a slot view handed out, outliving the pool
    del pool
    gc.collect()
    assert cudart.unregistered == []  # the memory is still in use
    del view
    gc.collect()
    assert cudart.unregistered == [p for p, _ in cudart.registered]


def test_a_refused_registration_falls_back_to_torch_pinned_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """A runtime that refuses: the pool is reallocated pinned by torch (stood in for here,
    no CUDA), nothing stays registered and no error is left set."""
    import torch

    from kvmesh.core import memory

    cudart = FakeCudart(fail_at=0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(memory, "cuda_runtime", lambda: cudart)
    real_empty = torch.empty

    def empty(*args: Any, pin_memory: bool = False, **kw: Any) -> torch.Tensor:
        return real_empty(*args, **kw)  # CPU torch cannot pin: the call's shape is what counts

    monkeypatch.setattr(torch, "empty", empty)
    pool = memory.MemoryPool(4 << 20, 1 << 20)
    pool.pin()
    assert pool.pinned and cudart.registered == [] and cudart.last_error == 0
    assert pool.array.ctypes.data == pool.buffer.data_ptr()
