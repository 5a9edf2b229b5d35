"""kvmesh.core.jit: kernels compile, cached on disk where numba can write its cache, and in
memory where it cannot (a read-only root filesystem and no writable home: numba's own
``cache=True`` raises at import there)."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest
from numba import njit
from numba.core import config

from kvmesh.core import jit


class NoLocator:
    """A numba cache locator that finds nowhere to write, as on a read-only filesystem."""

    @classmethod
    def from_function(cls, py_func: Any, py_file: str) -> None:
        return None


def _double(x: np.ndarray) -> None:
    for i in range(x.size):
        x[i] *= 2


def test_kernel_without_a_writable_cache_compiles_in_memory(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(config, "CACHE_LOCATOR_CLASSES", f"{__name__}.NoLocator")
    monkeypatch.setattr(jit, "_uncached", [])
    with pytest.raises(RuntimeError, match="no locator available"):
        njit(cache=True)(_double)  # what numba alone does there: the import would fail
    with caplog.at_level(logging.WARNING, logger="kvmesh.core.jit"):
        doubled = jit.kernel(_double)
        jit.kernel(_double)  # logged once per process, not per kernel
    x = np.arange(4, dtype=np.float64)
    doubled(x)
    assert x.tolist() == [0.0, 2.0, 4.0, 6.0]
    assert doubled.targetoptions["nogil"] is True
    assert [r.message for r in caplog.records if "cannot cache" in r.message] == [caplog.records[0].message]
    assert jit._uncached == ["_double", "_double"]


def test_kernel_with_a_writable_cache_caches_on_disk() -> None:
    assert jit.kernel(_double)._cache.cache_path  # numba found a place to write
