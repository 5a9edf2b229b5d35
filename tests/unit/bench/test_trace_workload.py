"""The conversation trace as a held-out router workload: selection, timing, text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvmesh.bench.router.trace_workload import expand, load_conversations, schedule
from kvmesh.errors import ConfigError


def _trace(tmp_path: Path) -> str:
    rows = [
        {"timestamp": 0, "hash_ids": [0, 1, 2]},  # conversation 1, turn 1
        {"timestamp": 1000, "hash_ids": [0, 5]},  # a one-request conversation: left out
        {"timestamp": 2000, "hash_ids": [0, 7, 8]},  # conversation 7
        {"timestamp": 4000, "hash_ids": [0, 1, 2, 3, 4]},  # conversation 1, turn 2
        {"timestamp": 8000, "hash_ids": [0, 7, 8, 9]},
        {"timestamp": 9000, "hash_ids": [0]},  # no conversation id: left out
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_conversations_with_two_or_more_requests_in_trace_order(tmp_path: Path) -> None:
    rows = load_conversations(conversations=5, max_blocks=4, path=_trace(tmp_path))
    assert [(ts, ids, s) for ts, ids, s in rows] == [
        (0, (0, 1, 2), "trace-1"),
        (2000, (0, 7, 8), "trace-7"),
        (4000, (0, 1, 2, 3), "trace-1"),  # cut at max_blocks
        (8000, (0, 7, 8, 9), "trace-7"),
    ]
    assert len(load_conversations(conversations=1, path=_trace(tmp_path))) == 2


def test_schedule_keeps_gap_proportions_at_the_asked_rate(tmp_path: Path) -> None:
    reqs = schedule(load_conversations(path=_trace(tmp_path)), rate=3.0)
    assert [round(r.at_s, 3) for r in reqs] == [0.0, 0.25, 0.5, 1.0]  # 3 gaps in 1 s, 2:2:4
    with pytest.raises(ConfigError, match="rate"):
        schedule([], 0)


def test_equal_ids_give_equal_text_and_runs_differ() -> None:
    a, b = expand((0, 1, 2), seed=1), expand((0, 1, 2, 3), seed=1)
    assert b.startswith(a) and len(b) > len(a)  # a prefix chain stays a prefix
    assert expand((0, 1), seed=2) != expand((0, 1), seed=1)


def test_the_shared_trace_is_found_or_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="KVMESH_TRACES"):
        load_conversations(path=str(tmp_path / "missing.jsonl"))
