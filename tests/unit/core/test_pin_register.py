"""Page-locking the CPU pool in pieces (issue #25), against a recording stand-in for CUDA's
runtime (fault injection: no GPU here; the real call runs in scripts/gpu_check.py)."""

from __future__ import annotations

from typing import Any

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
    import pytest
    import torch

    from kvmesh.core.cudart import cuda_runtime, loaded_library

    if torch.cuda.is_available() or loaded_library("libcudart") is not None:
        pytest.skip("a CUDA build: scripts/gpu_check.py checks the real runtime there")
    assert cuda_runtime() is None
