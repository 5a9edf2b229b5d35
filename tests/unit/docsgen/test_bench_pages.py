"""The benchmark pages' reading of JSONs: paths, goals, provenance and staleness."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvmesh.docsgen import bench_pages, bench_spec
from kvmesh.docsgen.bench_spec import Missing, goal_met, resolve


def test_resolve_keys_indexes_and_filters() -> None:
    data = {
        "results": [
            {"tier": "cpu", "op": "store", "ratio": 0.9},
            {"tier": "disk", "op": "store", "ratio": 1.2},
        ]
    }
    assert resolve(data, ["results", {"tier": "disk", "op": "store"}, "ratio"]) == 1.2
    assert resolve(data, ["results", 0, "tier"]) == "cpu"
    with pytest.raises(Missing, match="no element"):
        resolve(data, ["results", {"tier": "redis"}, "ratio"])
    with pytest.raises(Missing, match="no key"):
        resolve(data, ["nope"])
    with pytest.raises(Missing, match="out of range"):
        resolve(data, ["results", 5])


@pytest.mark.parametrize(
    ("goal", "value", "met"),
    [
        ("<= 0.9", 0.9, True),
        ("<= 0.9", 0.91, False),
        (">= 0.8", 2.0, True),
        ("== true", False, False),
        ("== 0", 0, True),
    ],
)
def test_goals(goal: str, value: object, met: bool) -> None:
    assert goal_met(goal, value) is met


def test_a_bad_goal_is_refused() -> None:
    with pytest.raises(ValueError, match="goal"):
        bench_spec.parse_goal("at most 3")


@pytest.mark.parametrize(
    ("data", "commit", "dirty", "date"),
    [
        ({"provenance": {"commit": "abc1234", "dirty": True, "date": "d"}}, "abc1234", True, "d"),
        ({"env": {"git_commit": "096517f", "timestamp": "t"}}, "096517f", False, "t"),
        ({"environment": {"git_commit": "d31fd1e+dirty"}}, "d31fd1e", True, None),
        ({"commit": "3c5d288"}, "3c5d288", False, None),
        ({"results": []}, None, None, None),
    ],
)  # fmt: skip
def test_provenance_in_every_shape_the_suites_wrote(
    data: dict[str, object], commit: str | None, dirty: bool | None, date: str | None
) -> None:
    assert bench_pages.provenance(data) == bench_pages.Provenance(commit, dirty, date)


def _data(tmp_path: Path, round_commit: str | None, stands: str | None = None) -> bench_pages.BenchData:
    (tmp_path / "a.json").write_text(
        json.dumps({"provenance": {"commit": "abc1234", "dirty": False, "date": "d"}, "x": 0.5})
    )
    spec = {
        "round": {"commit": round_commit},
        "suites": {
            "s": {
                "title": "S",
                "page": "s.md",
                "figures": [{"json": "a.json", "stands": stands}],
                "targets": [{"what": "x", "json": "a.json", "value": ["x"], "goal": "<= 0.4"}],
            }
        },
    }
    (tmp_path / "pages.yaml").write_text(json.dumps(spec))
    return bench_pages.BenchData(tmp_path, bench_spec.load(tmp_path / "pages.yaml"))


def test_a_figure_is_current_only_on_the_rounds_commit(tmp_path: Path) -> None:
    def status(round_commit: str | None, stands: str | None = None) -> str:
        data = _data(tmp_path, round_commit, stands)
        return data.status(data.pages.suites["s"].figures[0])

    assert "stale" in status(None)
    assert status("abc1234") == "current"
    assert "not the round's" in status("fff0000")
    assert "stands: same code path" in status("fff0000", "same code path")


def test_a_target_is_judged_from_the_json(tmp_path: Path) -> None:
    data = _data(tmp_path, None)
    target = data.pages.suites["s"].targets[0]
    assert bench_pages.target_row(data, target) == ("0.500", "**missed**", "`abc1234`")
    block = bench_pages.suite_block(data, "s")
    assert "**missed**" in block and "`abc1234`" in block
