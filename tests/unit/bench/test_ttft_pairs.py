"""The method of ``kvmesh bench ttft``: the interleaving order, the pairing of trials, the
equal-token accounting and the rows summarised from the trials."""

from __future__ import annotations

from typing import Any

import pytest

from kvmesh.bench.ttft import pairs as ttft_pairs
from kvmesh.bench.ttft.pairs import WARMUP, compute_targets, paired, schedule, summarize


def test_schedule_interleaves_rounds_and_alternates_order() -> None:
    order = schedule(["a", "b", "c"], [500, 2000], 2)
    assert len(order) == 3 * 2 * 3  # (warm-up + 2 rounds) x lengths x setups
    steps = [order[i : i + 3] for i in range(0, len(order), 3)]
    # one step = one (round, length): every setup once, on the same prompt
    for step in steps:
        assert len({(t, n) for t, n, _ in step}) == 1 and sorted(s for *_, s in step) == ["a", "b", "c"]
    assert [(s[0][0], s[0][1]) for s in steps] == [(WARMUP, 500), (WARMUP, 2000), (0, 500), (0, 2000),
                                                  (1, 500), (1, 2000)]  # fmt: skip
    firsts = [s[0][2] for s in steps]
    assert firsts == ["a", "c", "a", "c", "a", "c"]  # forward, reversed, forward...
    # each setup goes first as often as last over the timed rounds
    timed = steps[2:]
    assert sum(s[0][2] == "a" for s in timed) == sum(s[-1][2] == "a" for s in timed)


def test_schedule_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="at least one"):
        schedule([], [500], 1)
    with pytest.raises(ValueError, match="distinct"):
        schedule(["a", "a"], [500], 1)


def _trial(setup: str, n: int, trial: Any, reload: float, cached: int, **kw: Any) -> dict[str, Any]:
    return {"setup": setup, "prompt_tokens": n, "trial": trial, "reload_s": reload, "cold_s": 1.0,
            "cached_tokens": cached, "diff": 1e-6, "mismatches": 0, "dropped": True, "loadavg_1m": 1.5,
            **kw}  # fmt: skip


def test_paired_ratios_are_trial_by_trial() -> None:
    # A is twice as fast as B in every trial, while the machine drifts 10x across trials: the
    # paired ratio stays 0.5, a ratio of medians taken at other times would not.
    trials = []
    for k, scale in enumerate([1.0, 10.0, 2.0, 5.0]):
        trials += [_trial("a", 2000, k, 0.05 * scale, 1920), _trial("b", 2000, k, 0.1 * scale, 1920)]
    trials += [_trial("a", 2000, WARMUP, 9.0, 1920), _trial("b", 2000, WARMUP, 0.001, 1920)]  # not counted
    trials += [_trial("a", 500, 0, 9.0, 384), _trial("b", 500, 0, 0.001, 384)]  # another length
    p = paired(trials, "a", "b", 2000, 0.9)
    assert p["pairs"] == 4 and p["ratios"] == [0.5] * 4
    assert p["median"] == 0.5 and p["p90"] == 0.5 and p["met"] is True and p["target"] == "<= 0.9"
    assert p["equal_tokens"] is True and p["tokens_num"] == p["tokens_den"] == 1920


def test_pairs_only_trials_both_sides_have() -> None:
    trials = [
        _trial("a", 2000, 0, 0.2, 1920),
        _trial("b", 2000, 0, 0.1, 1920),
        _trial("a", 2000, 1, 0.3, 1920),
    ]
    trials.append({**_trial("b", 2000, 1, 0.1, 1920), "reload_s": None, "error": "boom"})  # failed cycle
    p = paired(trials, "a", "b", 2000, 0.9)
    assert p["pairs"] == 1 and p["median"] == 2.0 and p["met"] is False
    none = paired(trials, "a", "c", 2000, 0.9)
    assert none["pairs"] == 0 and none["median"] is None and none["met"] is None
    assert none["equal_tokens"] is False


def test_equal_token_accounting_flags_unequal_work() -> None:
    # kvmesh with tail chunks reloads 1,999 of 2,000 tokens, the peer 1,920: not like for like
    trials = [_trial("tail", 2000, k, 0.03, 1999) for k in range(3)]
    trials += [_trial("peer", 2000, k, 0.1, 1920) for k in range(3)]
    trials += [_trial("notail", 2000, k, 0.09, 1920) for k in range(3)]
    unequal = paired(trials, "tail", "peer", 2000)
    assert unequal["equal_tokens"] is False and (unequal["tokens_num"], unequal["tokens_den"]) == (1999, 1920)
    assert unequal["met"] is None  # no target given
    assert paired(trials, "notail", "peer", 2000)["equal_tokens"] is True
    # one pair off is enough to flag it
    trials.append(_trial("notail", 2000, 3, 0.09, 1792))
    trials.append(_trial("peer", 2000, 3, 0.1, 1920))
    assert paired(trials, "notail", "peer", 2000)["equal_tokens"] is False


def test_compute_targets_keeps_the_pairs_that_ran() -> None:
    setups = ["recompute", "lmcache_mp", "kvmesh_cpu@128-tail"]
    trials = [_trial("recompute", 2000, 0, 1.0, 0), _trial("lmcache_mp", 2000, 0, 0.2, 1920)]
    trials.append(_trial("kvmesh_cpu@128-tail", 2000, 0, 0.1, 1920))
    t = compute_targets(trials, [setups])
    assert t["prompt_tokens"] == 2000
    apart = compute_targets(trials, [setups[:2], setups[2:]])  # kvmesh ran in another phase
    assert set(apart) == {"prompt_tokens"}
    assert set(t) == {"prompt_tokens", "kvmesh_cpu@128-tail/lmcache_mp", "kvmesh_cpu@128-tail/recompute"}
    assert t["kvmesh_cpu@128-tail/recompute"]["median"] == 0.1 and t["kvmesh_cpu@128-tail/recompute"]["met"]
    assert t["kvmesh_cpu@128-tail/lmcache_mp"]["median"] == 0.5
    targets = {(n, d): lim for n, d, lim in ttft_pairs.HEADLINE_PAIRS}
    assert targets["kvmesh_disk@128-tail", "example_connector"] == 0.9
    assert targets["kvmesh_cpu@128-tail", "lmcache_mp"] == 0.9
    assert targets["kvmesh_cpu@128-tail", "recompute"] == 0.5


def test_summarize_a_row() -> None:
    trials = [_trial("x", 2000, k, r, 1920) for k, r in enumerate([0.3, 0.1, 0.2, 0.5, 0.4])]
    trials.append(_trial("x", 2000, WARMUP, 9.0, 1920))
    r = summarize("x", 2000, trials)
    assert r["setup"] == "x" and r["prompt_tokens"] == 2000 and r["trials"] == 5
    assert r["ttft_s_median"] == 0.3 and r["ttft_s_p90"] == pytest.approx(0.46)
    assert r["runs"] == [0.3, 0.1, 0.2, 0.5, 0.4]
    assert r["cold_s_median"] == 1.0 and r["tokens_reloaded"] == 1920 and r["cached_tokens"] == [1920] * 5
    assert r["loadavg_1m"] == [1.5] * 5 and r["logprobs_ok"] is True and r["page_cache_dropped"] is True
    bad = summarize("y", 500, [_trial("y", 500, 0, 0.1, 384, diff=2e-4)])
    assert bad["logprobs_ok"] is False
    assert summarize("y", 500, [_trial("y", 500, 0, 0.1, 384, mismatches=1)])["logprobs_ok"] is False
    empty = summarize("z", 500, trials)
    assert empty["trials"] == 0 and empty["ttft_s_median"] is None and empty["tokens_reloaded"] is None


def test_unavailable_rows() -> None:
    rows = ttft_pairs.unavailable("lmcache_mp", [500, 2000], "not available: RuntimeError: x")
    assert [r["prompt_tokens"] for r in rows] == [500, 2000]
    assert all(r["ttft_s_median"] is None and r["error"] == "not available: RuntimeError: x" for r in rows)


def test_cold_targets_pair_each_kvmesh_miss_with_no_connector_at_every_length() -> None:
    trials = []
    for k in range(3):
        for n, cold in ((500, 0.1), (2000, 0.5)):
            trials += [
                _trial("recompute", n, k, 0.1, 0, cold_s=cold),
                _trial("kvmesh_cpu", n, k, 0.01, n, cold_s=cold * 1.05),
                _trial("kvmesh_disk", n, k, 0.01, n, cold_s=cold * 1.3),
            ]
    got = ttft_pairs.compute_cold_targets(trials, [["recompute", "kvmesh_cpu"], ["kvmesh_disk"]], [500, 2000])
    assert set(got) == {"kvmesh_cpu/recompute@500", "kvmesh_cpu/recompute@2000"}  # disk: another phase
    assert got["kvmesh_cpu/recompute@2000"]["median"] == 1.05 and got["kvmesh_cpu/recompute@2000"]["met"]
    both = ttft_pairs.compute_cold_targets(trials, [["recompute", "kvmesh_cpu", "kvmesh_disk"]], [500])
    assert (
        both["kvmesh_disk/recompute@500"]["met"] is False
        and both["kvmesh_disk/recompute@500"]["median"] == 1.3
    )
