"""The lookup RPC's ``wait`` (how long a worker may hold a lookup for an idle scheduler) from
a caller that sends nonsense: a string, a bool, NaN, infinity, a negative or a huge number.
None of it raises, and none holds the caller past ALONE_LOOKUP_WAIT_S: a slow remote still
answers "pending" within the cap. The remote's slowness is a ``faulty://`` tier's injected
latency (a real hung Redis is in tests/e2e/test_remote_stall.py)."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from kvmesh import CacheEngine, KVLayout
from kvmesh.integrations.vllm.asyncload import ALONE_LOOKUP_WAIT_S
from kvmesh.integrations.vllm.metadata import KVMeshConnectorMetadata, SaveSpec
from kvmesh.integrations.vllm.worker import WorkerSide
from kvmesh.tiers.testing import reset_memory_stores
from tests.unit.integrations.test_connector import BS, paged

LAYOUT = KVLayout(3, 2, 16, torch.float32)
TOKENS = list(range(5000, 5000 + 1024))


@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerSide]:
    reset_memory_stores()
    engine = CacheEngine(
        {
            "chunk_size": 256,
            "max_local_cpu_size": 0.01,
            "remote_url": "faulty://wait",
            "remote_timeout_s": 2.0,
        },
        layout=LAYOUT,
        model_id="wait",
    )
    w = WorkerSide(engine, paged(num_blocks=24), BS)
    w.end_step(KVMeshConnectorMetadata(saves=[SaveSpec("a", TOKENS, list(range(8)), 0)]))
    assert w.wait_for_writes(10)
    w.clear("cpu")
    engine.lower["remote"].latency_s = 0.5  # type: ignore[attr-defined]
    yield w
    w.close()


@pytest.mark.parametrize("wait", ["50", True, math.nan, math.inf, -1.0, 1e9, [1], None])
def test_a_nonsense_wait_is_bounded_and_never_raises(
    worker: WorkerSide, wait: Any, request: pytest.FixtureRequest
) -> None:
    t0 = time.monotonic()
    req = request.node.name  # a request of its own: every lookup is new, none is answered yet
    assert worker.lookup(req, 1, TOKENS, detail=True, wait=wait) == {"pending": True}
    assert time.monotonic() - t0 < ALONE_LOOKUP_WAIT_S + 0.2
