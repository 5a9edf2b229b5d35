"""``kvmesh bench pd``'s pure parts, its client against a fake streaming server, and the
transfer measurement at a small size (the full benchmark needs vLLM: ``kvmesh bench pd``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmesh.bench.pd import bench as pd
from kvmesh.bench.pd.workload import Outcome, PDRequest, make_workload, replay, summarize
from kvmesh.errors import ConfigError
from kvmesh.router.testing import FakeVLLM


def test_trial_order_alternates() -> None:
    assert pd.trial_order(("a", "b", "c"), 0) == ["a", "b", "c"]
    assert pd.trial_order(("a", "b", "c"), 1) == ["c", "b", "a"]


def row(setup: str, phase: int, trial: int, **metrics: float) -> dict[str, object]:
    return {"setup": setup, "phase": phase, "trial": trial, **metrics}


def test_paired_ratio_pairs_by_phase_and_trial() -> None:
    trials = [
        row("kvmesh-pd", 1, 0, itl_p90_s=0.5), row("colocated", 1, 0, itl_p90_s=1.0),
        row("kvmesh-pd", 1, 1, itl_p90_s=0.9), row("colocated", 1, 1, itl_p90_s=1.0),
        row("kvmesh-pd", 1, 2, itl_p90_s=0.1),  # no partner: left out
        row("kvmesh-pd", 2, 0, ttft_p50_s=1.0), row("vllm-router-pd", 2, 0, ttft_p50_s=4.0),
    ]  # fmt: skip
    assert pd.paired_ratio(trials, "kvmesh-pd", "colocated", "itl_p90_s") == 0.7
    assert pd.paired_ratio(trials, "kvmesh-pd", "vllm-router-pd", "ttft_p50_s") == 0.25
    assert pd.paired_ratio(trials, "kvmesh-pd", "plain-rr", "ttft_p50_s") is None
    got = pd.targets(trials)
    assert got["itl_p90_pd_over_colocated"] == {"ratio": 0.7, "target_le": 0.6, "met": False}
    assert got["ttft_p50_pd_over_vllm_router_pd"]["met"] is True
    assert got["ttft_p50_pd_over_colocated"]["met"] is None  # not measured: neither met nor missed


def test_aggregate_takes_medians_and_sums_errors() -> None:
    trials = [
        row("a", 1, t, ttft_p50_s=v, errors=e) for t, (v, e) in enumerate([(1.0, 0), (3.0, 2), (2.0, 0)])
    ]
    trials[1]["first_error"] = "HTTP 500"
    got = pd.aggregate("a", trials)
    assert (got["ttft_p50_s"], got["errors"], got["first_error"], got["itl_p90_s"]) == (
        2.0,
        2,
        "HTTP 500",
        None,
    )


def test_workload_lengths_uniqueness_and_arrivals(tiny_tokenizer_dir: Path) -> None:
    from tokenizers import Tokenizer

    reqs = make_workload(tiny_tokenizer_dir, 8, seed=3, rate_per_s=2.0, prompt_tokens=(300, 400))
    tok = Tokenizer.from_file(str(tiny_tokenizer_dir / "tokenizer.json"))
    for r in reqs:
        assert 298 <= r.prompt_tokens <= 402 and r.prompt_tokens == len(tok.encode(r.prompt).ids)
        assert 128 <= r.max_tokens <= 256
    assert len({r.prompt[:20] for r in reqs}) == len(reqs)  # no two share a first block
    assert [r.at_s for r in reqs] == sorted(r.at_s for r in reqs) and reqs[0].at_s == 0.0
    assert make_workload(tiny_tokenizer_dir, 8, 3, 2.0, (300, 400)) == reqs  # seeded


def test_a_model_without_a_tokenizer_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvmesh.cli import main

    with pytest.raises(ConfigError, match=r"tokenizer\.json: the workload's prompts are tokenized"):
        make_workload(tmp_path, 2, seed=0, rate_per_s=1.0)
    (tmp_path / "notes.txt").write_text("not a model")
    assert main(["bench", "pd", "--smoke", "--model", str(tmp_path), "--json", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvmesh bench pd: ") and "holds no model" in err and "Traceback" not in err


@pytest.fixture(scope="module")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvmesh.router.testing import write_test_tokenizer

    return write_test_tokenizer(tmp_path_factory.mktemp("tok"))


def test_summarize_pools_gaps() -> None:
    outs = [
        Outcome(True, 0.0, 0.5, [0.1, 0.1, 0.3], 4, 1.0),
        Outcome(True, 0.5, 1.5, [0.2], 2, 2.0),
        Outcome(False, 0.2, error="HTTP 503: busy", end=0.3),
    ]
    got = summarize(outs)
    assert (got["ok"], got["errors"], got["first_error"]) == (2, 1, "HTTP 503: busy")
    assert got["ttft_p50_s"] == 1.0 and got["itl_p50_s"] == pytest.approx(0.15)
    assert got["requests_per_s"] == 1.0 and got["output_tokens_per_s"] == 3.0


def test_replay_measures_a_streaming_server() -> None:
    fake = FakeVLLM("x").start()
    try:
        fake.chunks, fake.chunk_delay_s, fake.delay_s = 6, 0.03, 0.1
        reqs = [PDRequest("hello world", 2, 6, 0.0), PDRequest("one two", 2, 6, 0.05)]
        got = replay(fake.url, "tiny", reqs)
    finally:
        fake.stop()
    assert (got["ok"], got["errors"]) == (2, 0)
    assert got["ttft_p50_s"] >= 0.1 and 0.02 <= got["itl_p50_s"] < 0.2
    assert "load_avg_after" in got
    import json

    sent = [json.loads(raw) for _, raw, _ in fake.requests]
    assert all(b["stream"] and b["ignore_eos"] and b["min_tokens"] == b["max_tokens"] == 6 for b in sent)


def test_transfer_measure_small() -> None:
    got = pd.measure_transfer(4 << 20, repeats=1)
    assert "error" not in got, got
    assert got["bytes"] >= 4 << 20 and got["raw_gbps"] > 0 and got["pull_gbps"] > 0
    assert got["met"] == (got["ratio"] >= 0.8)


def test_threshold_probe_against_fakes(tiny_tokenizer_dir: Path) -> None:
    from kvmesh.bench.pd.threshold import probe

    slow, fast = FakeVLLM("pd").start(), FakeVLLM("local").start()
    try:
        slow.delay_s = 0.08  # the hop's cost, in this fake
        got = probe(slow.url, fast.url, str(tiny_tokenizer_dir), "tiny", repeats=1, lengths=(20, 40))
    finally:
        slow.stop()
        fast.stop()
    assert [r["tokens"] for r in got["lengths"]] == [20, 40]
    assert all(r["hop_cost_s"] >= 0.05 for r in got["lengths"]) and got["local_faster_up_to"] == 40
