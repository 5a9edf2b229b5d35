"""The interleaving engine of ``kvmesh bench router`` and ``kvmesh demo``: setup names, the
interleaved order, and one run through a real kvmesh router process over fake replicas."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvmesh.bench.common import groups
from kvmesh.bench.common.groups import Outcome, Params, Setup
from kvmesh.harness.replicas import Replica
from kvmesh.router.testing import FakeVLLM


def test_setup_names_say_the_cache_only_when_it_is_not_the_routers_own() -> None:
    assert Setup("vllm-router", "round_robin", "none").name == "vllm-router:round_robin"
    assert Setup("vllm-router", "kv_aware", "lmcache").name == "vllm-router:kv_aware+lmcache"
    assert Setup("kvmesh", "kvmesh", "kvmesh").name == "kvmesh:kvmesh"
    assert Setup("kvmesh", "round-robin", "none").name == "kvmesh:round-robin+plain"


def test_outcome_rows_keep_setup_order_and_failures() -> None:
    a, b = Setup("kvmesh", "round-robin", "none"), Setup("kvmesh", "kvmesh", "kvmesh")
    run = {"hit_rate": 0.5, "ttft_p50_s": 0.1, "ttft_p90_s": 0.2, "requests_per_s": 3.0, "errors": 0}
    out = Outcome({a: [run], b: []}, failed={b: "ProcessError: boom"})
    rows = out.rows()
    assert rows[0]["policy"] == "round-robin" and rows[0]["ttft_p90_s"] == 0.2
    assert rows[1] == {
        "router": "kvmesh",
        "policy": "kvmesh",
        "cache": "kvmesh",
        "error": "ProcessError: boom",
    }


def test_run_interleaved_alternates_the_order_and_records_failures(monkeypatch: pytest.MonkeyPatch) -> None:
    """Replica groups are faked (fault injection: no vLLM); the loop itself is real."""
    plain, rr, ours = (
        Setup("kvmesh", "round-robin", "none"),
        Setup("kvmesh", "round-robin", "kvmesh"),
        Setup("kvmesh", "kvmesh", "kvmesh"),
    )
    calls: list[tuple[str, int]] = []

    @contextlib.contextmanager
    def fake_group(cache: str, *args: Any) -> Iterator[list[Any]]:
        if cache == "lmcache":
            raise FileNotFoundError("no lmcache")
        yield [cache]

    def fake_once(setup: Setup, replicas: Any, model: str, work: str, p: Params, seed: int) -> dict[str, Any]:
        calls.append((setup.name, seed))
        return {"hit_rate": 0.1, "ttft_p50_s": 0.1, "ttft_p90_s": 0.2, "requests_per_s": 1.0, "errors": 0}

    monkeypatch.setattr(groups, "replica_group", fake_group)
    monkeypatch.setattr(groups, "run_once", fake_once)
    lm = Setup("vllm-router", "kv_aware", "lmcache")
    p = Params(1, 1, 1, 1, repeats=3)
    lines: list[str] = []
    out = groups.run_interleaved(
        [lm, plain, rr, ours], (("lmcache",), ("none", "kvmesh")), p, "m", "w",
        lambda s, r: 10 * r + [plain, rr, ours].index(s), lines.append, idle_floor=False,
    )  # fmt: skip
    names = [n for n, _ in calls]
    order = [plain.name, rr.name, ours.name]
    assert names == order + order[::-1] + order  # every other repeat in reverse
    assert [s for _, s in calls][:3] == [0, 1, 2] and [s for _, s in calls][3:6] == [12, 11, 10]
    assert out.failed == {lm: "FileNotFoundError: no lmcache"} and len(out.runs[ours]) == 3
    assert any("interleaving" in line for line in lines)


def test_one_run_through_a_kvmesh_router_process(
    tok_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real RouterProcess (its own interpreter) in front of two fake replicas."""
    monkeypatch.setattr(groups, "reset_prefix_caches", lambda urls: None)  # the fakes have no such endpoint
    fakes = [FakeVLLM("a").start(), FakeVLLM("b").start()]
    try:
        p = Params(tenants=2, users=1, turns=2, concurrency=2, repeats=1, prefix_words=20)
        setup = Setup("kvmesh", "round-robin", "none")
        replicas = [Replica(str(tok_dir), port=int(f.port or 0)) for f in fakes]  # never started
        summary = groups.run_once(setup, replicas, str(tok_dir), str(tmp_path), p, seed=1)
        assert summary["requests"] == 4 and summary["errors"] == 0 and "error" not in summary
        chats = [sum(path == "/v1/chat/completions" for path, _, _ in f.requests) for f in fakes]
        assert sum(chats) == 4 + 2 and min(chats) >= 2  # + one router warm-up each; round-robin
        assert (tmp_path / "kvmesh-round-robin+plain-router.log").exists()
    finally:
        for f in fakes:
            f.stop()
