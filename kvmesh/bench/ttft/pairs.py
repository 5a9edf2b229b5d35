"""The method of ``kvmesh bench ttft``, pure and unit-tested: the interleaved schedule of the
trials, the rows summarised from them, and the paired ratios the targets are read from.

All setups' vLLM workers are up at once; a *round* runs one trial of every setup at every
prompt length, setup after setup, so the two sides of a ratio run seconds apart on the same
prompt. Every other step (a round's length) runs the setups in reverse order, so no setup
always goes first or last while this machine's load drifts. A ratio is PAIRED: trial ``k`` of
A over trial ``k`` of B, same prompt, same round; the medians and p90s quoted are of those
per-trial ratios, never a ratio of two medians taken minutes apart.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from kvmesh.bench.runner import interleaved, paired_ratios, percentile, ratio_summary
from kvmesh.bench.ttft.spec import LOGPROB_TOL, TARGET_TOKENS

WARMUP = "warmup"

# (numerator, denominator, target: the ratio's median must be at most this, or None). The
# kvmesh numerators are its config defaults (128-token chunks, no tail chunk), so both sides
# reload the same tokens; ``equal_tokens`` checks that per pair from vLLM's own counts.
HEADLINE_PAIRS: tuple[tuple[str, str, float | None], ...] = (
    ("kvmesh_disk", "example_connector", 0.9),
    ("kvmesh_cpu", "lmcache_mp", 0.9),
    ("kvmesh_cpu", "recompute", 0.5),
    ("kvmesh_redis", "lmcache_redis", None),
    ("kvmesh_cpu@128-tail", "lmcache_mp", 0.9),  # the same, named explicitly (other defaults)
    ("kvmesh_disk@128-tail", "example_connector", 0.9),
    ("kvmesh_cpu@128-tail", "recompute", 0.5),
    ("kvmesh_cpu+tail", "kvmesh_cpu", None),  # what tail chunks give (a feature, unequal work)
    ("kvmesh_cpu+tail", "lmcache_mp", None),
    ("kvmesh_cpu:swa", "recompute:swa", None),  # a hybrid model (sliding window): measured, no target yet
)


def schedule(setups: Sequence[str], lengths: Sequence[int], trials: int) -> list[tuple[str | int, int, str]]:
    """The order the cycles run in: ``(trial, prompt_tokens, setup)``, one warm-up round
    (trial ``"warmup"``, untimed in the statistics) then rounds ``0..trials-1``; within a
    round each length in turn, the setups forward on even steps and reversed on odd ones."""
    if not setups or not lengths:
        raise ValueError("schedule needs at least one setup and one prompt length")
    if len(set(setups)) != len(setups):
        raise ValueError(f"setups must be distinct, got {list(setups)}")
    out: list[tuple[str | int, int, str]] = []
    step = 0
    for trial in [WARMUP, *range(trials)]:
        for n in lengths:
            out += [(trial, n, s) for s in interleaved(setups, step)]
            step += 1
    return out


def _timed(trials: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [t for t in trials if t["trial"] != WARMUP and t.get("reload_s") is not None]


def summarize(setup: str, n: int, trials: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The result row of one setup at one length from its timed trials (seconds): medians and
    p90s, tokens reloaded per trial (vLLM's ``num_cached_tokens`` after the reset: only what
    the connector loaded), the load average of each trial, the logprob check."""
    mine = sorted(
        (t for t in _timed(trials) if t["setup"] == setup and t["prompt_tokens"] == n),
        key=lambda t: t["trial"],
    )
    runs = [float(t["reload_s"]) for t in mine]
    cold = [float(t["cold_s"]) for t in mine]
    cached = [int(t["cached_tokens"]) for t in mine]
    diff = max((float(t["diff"]) for t in mine), default=None)
    mismatches = sum(int(t.get("mismatches", 0)) for t in mine)
    return {
        "setup": setup,
        "prompt_tokens": n,
        "ttft_s_median": round(statistics.median(runs), 4) if runs else None,
        "ttft_s_p90": round(percentile(runs, 90), 4) if runs else None,
        "runs": [round(x, 4) for x in runs],  # every timed reload, in trial order
        "trials": len(runs),
        "cold_s_median": round(statistics.median(cold), 4) if cold else None,
        "cached_tokens": cached,
        "tokens_reloaded": int(statistics.median(cached)) if cached else None,
        "loadavg_1m": [t.get("loadavg_1m") for t in mine],
        "max_logprob_diff": diff,
        "top5_mismatches": mismatches,
        "logprobs_ok": diff is not None and mismatches == 0 and diff <= LOGPROB_TOL,
        "page_cache_dropped": all(bool(t.get("dropped")) for t in mine) if mine else None,
    }


def unavailable(setup: str, lengths: Sequence[int], error: str) -> list[dict[str, Any]]:
    """Rows that say why a setup has no numbers (one per length, so tables stay aligned)."""
    return [
        {"setup": setup, "prompt_tokens": n, "ttft_s_median": None, "ttft_s_p90": None, "runs": [],
         "tokens_reloaded": None, "max_logprob_diff": None, "error": error}
        for n in lengths
    ]  # fmt: skip


def paired(
    trials: Sequence[Mapping[str, Any]],
    num: str,
    den: str,
    n: int,
    target: float | None = None,
    field: str = "reload_s",
) -> dict[str, Any]:
    """Per-trial ratios ``num / den`` of ``field`` (the timed reload, or ``cold_s``: the first,
    storing request) at ``n`` tokens (trial k over trial k: same prompt, same round) and their
    median and p90; ``equal_tokens`` says whether both sides reloaded the same number of
    tokens in every pair; ``met`` compares the median with ``target``."""
    by = {(t["setup"], t["trial"]): t for t in _timed(trials) if t["prompt_tokens"] == n}
    ks = sorted(k for s, k in by if s == num and (den, k) in by)
    ratios = paired_ratios([float(by[num, k][field]) for k in ks], [float(by[den, k][field]) for k in ks])
    tok_num = [int(by[num, k]["cached_tokens"]) for k in ks]
    tok_den = [int(by[den, k]["cached_tokens"]) for k in ks]
    out: dict[str, Any] = {
        "num": num,
        "den": den,
        "prompt_tokens": n,
        **ratio_summary(ratios),
        "tokens_num": int(statistics.median(tok_num)) if ks else None,
        "tokens_den": int(statistics.median(tok_den)) if ks else None,
        "equal_tokens": bool(ks) and tok_num == tok_den,
        "target": None if target is None else f"<= {target}",
    }
    out["met"] = None if target is None or out["median"] is None else out["median"] <= target
    return out


def compute_targets(
    trials: Sequence[Mapping[str, Any]],
    phases: Sequence[Sequence[str]],
    tokens: int = TARGET_TOKENS,
    pairs: Sequence[tuple[str, str, float | None]] = HEADLINE_PAIRS,
) -> dict[str, Any]:
    """The paired ratios of ``pairs`` at ``tokens``, keyed ``"num/den"``, for the pairs whose
    two sides ran in one phase (trials of two phases ran minutes apart: no pair); a pair
    whose side failed has ``median`` None."""
    out: dict[str, Any] = {"prompt_tokens": tokens}
    for num, den, target in pairs:
        if any(num in phase and den in phase for phase in phases):
            out[f"{num}/{den}"] = paired(trials, num, den, tokens, target)
    return out


# A miss (the first, storing request of a new prompt) against the same vLLM without a
# connector, at every prompt length (issue #25: at most 1.1x).
COLD_TARGET = 1.1
COLD_SETUPS = ("kvmesh_cpu", "kvmesh_disk", "kvmesh_redis")


def compute_cold_targets(
    trials: Sequence[Mapping[str, Any]], phases: Sequence[Sequence[str]], lengths: Sequence[int]
) -> dict[str, Any]:
    """Paired ratios of the cold (storing) request, each kvmesh setup over ``recompute`` in
    its phase, at each length: keyed ``"setup/recompute@N"``."""
    out: dict[str, Any] = {}
    for setup in COLD_SETUPS:
        if not any(setup in phase and "recompute" in phase for phase in phases):
            continue
        for n in lengths:
            got = paired(trials, setup, "recompute", n, COLD_TARGET, field="cold_s")
            got.pop("equal_tokens", None)  # nothing was reloaded: both computed the prompt
            out[f"{setup}/recompute@{n}"] = got
    return out
