"""``kvmesh demo``'s summary: the table, one sentence per row, the split of the gain, the
plot; the runs themselves are canned here (the demo is run for real by ``make demo``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvmesh import demo
from kvmesh.bench.common.groups import Outcome, Setup
from kvmesh.cli import build_parser


def _row(hit: float, p50: float, p90: float, rps: float, **extra: Any) -> dict[str, Any]:
    return {"hit_rate": hit, "ttft_p50_s": p50, "ttft_p90_s": p90, "requests_per_s": rps, **extra}


ROWS = {
    demo.PLAIN_RR: _row(0.40, 0.20, 0.40, 9.0),
    demo.KVMESH_RR: _row(0.68, 0.14, 0.32, 9.6),
    demo.KVMESH: _row(0.70, 0.13, 0.28, 11.0),
}


def test_the_three_setups_are_plain_rr_kvmesh_rr_and_kvmesh() -> None:
    assert [(s.router, s.policy, s.cache) for s in demo.SETUPS] == [
        ("kvmesh", "round-robin", "none"),
        ("kvmesh", "round-robin", "kvmesh"),
        ("kvmesh", "kvmesh", "kvmesh"),
    ]
    assert len({s.name for s in demo.SETUPS}) == 3  # distinct router logs
    assert demo.PHASES == (("none", "kvmesh"),)  # both groups up together: interleaved
    seeds = {demo.seed_of(s, r) for s in demo.SETUPS for r in range(5)}
    assert len(seeds) == 15


def test_split_gain_divides_the_change_between_cache_and_router() -> None:
    # TTFT p90 0.40 -> 0.32 (cache) -> 0.28 (router): 0.08 of 0.12 is the cache's
    s = demo.split_gain(0.40, 0.32, 0.28, lower_is_better=True)
    assert s == {"gain": True, "cache_pct": pytest.approx(66.7), "router_pct": pytest.approx(33.3)}
    up = demo.split_gain(9.0, 9.6, 11.0, lower_is_better=False)
    assert up["gain"] and up["cache_pct"] == pytest.approx(30.0) and up["router_pct"] == pytest.approx(70.0)
    # the router undoing part of the cache's gain: its share is negative, they still add to 100
    back = demo.split_gain(0.40, 0.20, 0.30, lower_is_better=True)
    assert back["gain"] and back["cache_pct"] == 200.0 and back["router_pct"] == -100.0
    worse = demo.split_gain(0.40, 0.45, 0.50, lower_is_better=True)
    assert worse["gain"] is False
    assert demo.split_gain(1.0, 0.9, 1.0, lower_is_better=True) == {
        "gain": False,
        "cache_pct": None,
        "router_pct": None,
    }


def test_one_sentence_per_row_with_each_share() -> None:
    lines = demo.sentences(ROWS)
    assert len(lines) == 3
    assert lines[0].startswith("plain vLLM + round-robin (what users run today): hit rate 0.40")
    assert lines[1].startswith("kvmesh replicas + round-robin, the cache's share: hit rate 0.40 -> 0.68")
    assert "p90 x0.80 (paired; medians 0.400 -> 0.320 s)" in lines[1]
    assert lines[2].startswith("kvmesh replicas + kvmesh router, the router's share: hit rate 0.68 -> 0.70")
    assert "p90 x0.88 (paired; medians 0.320 -> 0.280 s)" in lines[2]  # the router's step
    assert "p90 x0.70 (paired; medians 0.400 -> 0.280 s)" in lines[2]  # the whole way from plain vLLM
    assert "of the gain in TTFT p90 (medians) the cache gives 67% and the router 33%" in lines[2]
    assert "of the gain in requests/s (medians) the cache gives 30% and the router 70%" in lines[2]


def test_sentences_say_when_a_setup_has_no_figures() -> None:
    rows = {**ROWS, demo.KVMESH_RR: {"error": "ProcessError: vLLM replica exited"}}
    assert demo.sentences(rows) == [
        "kvmesh replicas + round-robin: no figures (ProcessError: vLLM replica exited)."
    ]
    worse = {**ROWS, demo.KVMESH: _row(0.70, 0.3, 0.5, 8.0)}
    assert "TTFT p90 (medians) got worse overall" in demo.sentences(worse)[2]


def test_table_compares_every_p90_with_plain_vllm() -> None:
    rows = demo.table({**ROWS, demo.KVMESH: {**ROWS[demo.KVMESH], "errors": 2}})
    assert [r["setup"] for r in rows] == list(demo.TITLES.values())
    assert [r["p90_vs_plain"] for r in rows] == ["x1.00", "x0.80", "x0.70"]
    assert rows[2]["errors"] == 2 and rows[0]["errors"] == 0
    failed = demo.table({demo.PLAIN_RR: ROWS[demo.PLAIN_RR]})
    assert failed[1] == {"setup": "kvmesh replicas + round-robin", "note": "no run"}
    assert demo.ratio(1.0, 0) is None and demo.ratio(None, 1.0) is None


def test_run_prints_writes_json_and_a_panel_per_metric(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen: dict[str, Any] = {}

    def fake_interleaved(setups: tuple[Setup, ...], phases: Any, p: Any, *args: Any, **kw: Any) -> Outcome:
        seen.update(setups=setups, phases=phases, p=p, idle_floor=kw.get("idle_floor"))
        runs = {s: [{**ROWS[s], "requests": 72, "errors": 0}] * p.repeats for s in setups}
        return Outcome(runs)

    monkeypatch.setattr(demo, "run_interleaved", fake_interleaved)
    monkeypatch.setattr(demo, "ensure_model", lambda model_dir, preset: str(model_dir))
    out = demo.run(
        model_dir=str(tmp_path / "m"),
        json_path=str(tmp_path / "demo.json"),
        plot_path=str(tmp_path / "demo.png"),
        p=demo.params(repeats=2),
        workdir=str(tmp_path / "w"),
    )
    assert seen["setups"] == demo.SETUPS and seen["phases"] == demo.PHASES and seen["idle_floor"] is False
    saved = json.loads((tmp_path / "demo.json").read_text())
    assert [r["setup"] for r in saved["rows"]] == list(demo.TITLES.values())
    assert saved["rows"][2]["ttft_p90_s"] == 0.28 and len(saved["rows"][2]["repeats"]) == 2
    assert saved["split"]["ttft_p90_s"]["cache_pct"] == pytest.approx(66.7)
    assert saved["sentences"] == out["sentences"] and len(out["sentences"]) == 3
    assert demo.failed(out) == []
    from PIL import Image

    with Image.open(tmp_path / "demo.png") as img:
        assert img.size[0] > 3 * img.size[1] // 2  # four panels side by side
    printed = capsys.readouterr().out
    assert "p90_vs_plain" in printed and "- kvmesh replicas + kvmesh router, the router's share" in printed


def test_cli_passes_the_workload_through(monkeypatch: pytest.MonkeyPatch) -> None:
    got: dict[str, Any] = {}

    def fake_run(**kw: Any) -> dict[str, Any]:
        got.update(kw)
        return {"rows": [{"setup": "x", "errors": 1}]}

    monkeypatch.setattr(demo, "run", fake_run)
    args = build_parser().parse_args(["demo", "--tenants", "6", "--repeats", "1", "--num-blocks", "20"])
    assert args.func(args) == 1  # a row lost requests
    p = got["p"]
    assert (p.tenants, p.users, p.turns, p.repeats, p.num_blocks, p.prefix_words) == (6, 2, 3, 1, 20, 250)
    assert got["workload_name"] == "default"
    # the held-out workload is bench router's, which the router's weights were never tuned on
    args = build_parser().parse_args(["demo", "--workload", "held-out", "--repeats", "1"])
    args.func(args)
    held = got["p"]
    assert got["workload_name"] == "held-out" and demo.WORKLOADS["held-out"].endswith("never tuned on it")
    assert (held.tenants, held.users, held.turns, held.prefix_words, held.prefix_words_max) == (
        8,
        3,
        2,
        200,
        700,
    )
    assert held.zipf and held.arrival == "turns" and held.question_words == 25
    assert demo.held_out_seed_of(demo.KVMESH, 0) not in {
        demo.seed_of(s, r) for s in demo.SETUPS for r in range(50)
    }


def test_paired_ratios_pair_repeats_and_fall_back_to_medians() -> None:
    plain = _row(0.4, 0.2, 0.5, 5.0, repeats=[_row(0.4, 0.2, 0.4, 5.0), _row(0.4, 0.2, 0.8, 5.0)])
    ours = _row(0.7, 0.1, 0.3, 8.0, repeats=[_row(0.7, 0.1, 0.2, 8.0), _row(0.7, 0.1, 0.6, 8.0)])
    # per repeat 0.2/0.4 = 0.5 and 0.6/0.8 = 0.75: median 0.625 (the medians' ratio would be 0.6)
    assert demo.paired_ratio(ours, plain, "ttft_p90_s") == pytest.approx(0.625)
    assert demo.paired_ratio(_row(0.7, 0.1, 0.3, 8.0), plain, "ttft_p90_s") == pytest.approx(0.6)
    assert demo.table({demo.PLAIN_RR: plain, demo.KVMESH: ours})[2]["p90_vs_plain"] == "x0.62"


def test_a_written_report_renders_again_from_its_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = {s: {**r, "errors": 0, "repeats": [r]} for s, r in ROWS.items()}
    workload = {
        "what": demo.WORKLOADS["default"],
        "tenants": 12,
        "users": 2,
        "turns": 3,
        "concurrency": 4,
        "replica_kv_blocks": 40,
        "repeats": 1,
    }
    first = demo.report(rows, workload, 12.0, str(tmp_path / "a.json"))
    again = demo.report(demo.rows_from_json(json.loads((tmp_path / "a.json").read_text())), workload, 12.0)
    assert again["sentences"] == first["sentences"] and again["split"] == first["split"]
    # the output and the JSON say which workload it was: the one the weights were tuned on
    assert "tuned on" in capsys.readouterr().out and "commit" not in first
    assert json.loads((tmp_path / "a.json").read_text())["provenance"]["commit"]
