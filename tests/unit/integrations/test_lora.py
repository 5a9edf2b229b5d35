"""LoRA requests through the connector's two halves (issue #26): the scheduler keys them by
their adapter's weights fingerprint and hands it to the worker, whose lookups, loads and
saves use that adapter's chunk namespace."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from vllm.lora.request import LoRARequest

from kvmesh import CacheEngine
from kvmesh.core.fingerprint import adapter_fingerprint
from kvmesh.integrations.vllm.metadata import KVMeshConnectorMetadata, LoadSpec, SaveSpec
from kvmesh.integrations.vllm.scheduler import SchedulerSide
from kvmesh.integrations.vllm.worker import WorkerSide
from tests.unit.core.test_lora_keys import write_adapter
from tests.unit.integrations.test_connector import BS, LAYOUT, FakeRank, paged, request, sched_out


def lora(name: str, int_id: int, path: Path | str) -> LoRARequest:
    """vLLM's own LoRARequest, as ``Request.lora_request`` carries it."""
    return LoRARequest(name, int_id, str(path))


def test_a_lora_request_is_looked_up_and_saved_under_its_adapter(tmp_path: Path) -> None:
    path = write_adapter(tmp_path / "a", seed=1)
    rank = FakeRank()
    s = SchedulerSide(256, BS, [rank])
    r = request("r", 1025, lora_request=lora("sql", 3, path))
    assert s.lookup(r, 0) == 1024
    ((op, args),) = rank.calls
    assert op == "lookup" and args["adapter"] == adapter_fingerprint(path)
    s.after_alloc(r, list(range(9)), 1024)
    meta = s.build_meta(sched_out(new=[(r, list(range(9)), 0, 1025)]))
    (load,) = meta.loads
    (save,) = meta.saves
    assert load.adapter == save.adapter == adapter_fingerprint(path)
    assert save.lora == ("sql", 3)


def test_base_requests_send_no_adapter() -> None:
    rank = FakeRank()
    s = SchedulerSide(256, BS, [rank])
    s.lookup(request("r", 1025), 0)
    assert "adapter" not in rank.calls[0][1]


@pytest.mark.parametrize("where", ["missing", "not-an-adapter"])
def test_an_adapter_that_cannot_be_fingerprinted_is_not_cached(tmp_path: Path, where: str) -> None:
    path = tmp_path / where
    if where == "not-an-adapter":
        path.mkdir()
    rank = FakeRank()
    s = SchedulerSide(256, BS, [rank])
    r = request("r", 1025, lora_request=lora("x", 1, path))
    assert s.lookup(r, 0) == 0 and not rank.calls
    assert s.build_meta(sched_out(new=[(r, list(range(9)), 0, 1025)])).saves == []


def test_the_same_adapter_under_two_names_shares_keys(tmp_path: Path) -> None:
    a = write_adapter(tmp_path / "a", seed=1)
    shutil.copytree(a, tmp_path / "copy")
    rank = FakeRank()
    s = SchedulerSide(256, BS, [rank])
    s.lookup(request("r1", 1025, lora_request=lora("one", 1, a)), 0)
    s.lookup(request("r2", 1025, lora_request=lora("two", 2, tmp_path / "copy")), 0)
    assert rank.calls[0][1]["adapter"] == rank.calls[1][1]["adapter"]


@pytest.fixture
def worker() -> Any:
    engine = CacheEngine({"chunk_size": 256, "max_local_cpu_size": 0.01}, layout=LAYOUT, model_id="unit")
    w = WorkerSide(engine, paged(num_blocks=24), BS)
    yield w
    w.close()


def test_worker_serves_an_adapters_chunks_to_that_adapter_only(worker: WorkerSide) -> None:
    tokens = list(range(1000, 1000 + 512))
    save = SaveSpec("a", tokens, [0, 1, 2, 3], 0, [11, 12, 13, 14], adapter="fp-A", lora=("sql", 3))
    worker.end_step(KVMeshConnectorMetadata(saves=[save]))
    assert worker.wait_for_writes(10)
    assert worker.lookup("base", 1, tokens) == 0
    assert worker.lookup("b", 1, tokens, adapter="fp-B") == 0
    assert worker.lookup("b2", 1, tokens, detail=True, adapter="fp-B") == {"tokens": 0, "lower": False}
    assert worker.lookup("a2", 1, tokens, adapter="fp-A") == 512
    assert worker.engine.stats()["cpu"]["pinned"] == 2  # the adapter's chunks, pinned
    dst = [10, 11, 12, 13]
    worker.start_step(KVMeshConnectorMetadata(loads=[LoadSpec("a2", 1, tokens, dst, 0, adapter="fp-A")]))
    assert worker.take_load_errors() == set()
    assert worker.engine.stats()["cpu"]["pinned"] == 0  # released after loading
    for layer in worker.layers:
        assert layer[dst].equal(layer[[0, 1, 2, 3]])
    events = worker.events.take()
    assert [(e.lora_name, e.lora_id) for e in events] == [("sql", 3), ("sql", 3)]


def test_worker_load_under_the_wrong_adapter_is_a_failed_load(worker: WorkerSide) -> None:
    """A load planned for adapter B never copies adapter A's chunks, whatever was promised."""
    tokens = list(range(2000, 2000 + 256))
    worker.end_step(KVMeshConnectorMetadata(saves=[SaveSpec("a", tokens, [0, 1], 0, adapter="fp-A")]))
    assert worker.wait_for_writes(10)
    worker.start_step(KVMeshConnectorMetadata(loads=[LoadSpec("b", 1, tokens, [5, 6], 0, adapter="fp-B")]))
    assert worker.take_load_errors() == {5, 6}
