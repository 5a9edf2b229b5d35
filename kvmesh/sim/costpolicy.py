"""``cost`` in the simulator: the router's own cost picker on simulated time, and the slow-tier fleet.

:class:`CostPolicy` is the router's :class:`~kvmesh.routing.cost.CostPicker` over the same
index, speculative entries and session table as the ``kvmesh`` policy, driven by the same
dispatcher as the router's: each request is sent (the picker's ticket, through the
dispatcher's ``track`` hook), its first token teaches the fit, its end closes the ticket.
The model's clock is the fleet's, and the fleet's table is live (``live_gauges``): the
simulator has no scrape lag.

Replicas with kvmesh tiers report their figures as a real replica's meters would (their
prefill rate and each tier's per-token load time and latency, from the cost profile); plain
replicas report nothing and are learned from their TTFTs alone.

:func:`slow_tier` is the slow shared tier of ``kvmesh sim run --fleets slow-tier``: the shared
tier 50 ms away (a per-load latency), its bandwidth unchanged, so that loading a short prefix
costs more than recomputing it and a long one less. :func:`cost_targets` checks ``cost``
against the llm-d-style weights on each fleet kind (TTFT p50 and p99 ≤ 0.8x).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvmesh.routing.cost import CostPicker, median_error
from kvmesh.routing.fit import Report
from kvmesh.sim.cost import CostProfile
from kvmesh.sim.policies import RouterPolicy

if TYPE_CHECKING:
    from kvmesh.sim.fleet import Fleet

SLOW_TIER_LATENCY_S = 0.05


def slow_tier(cost: CostProfile) -> CostProfile:
    """``cost`` with its shared tier ``SLOW_TIER_LATENCY_S`` away (per load)."""
    return cost.with_(shared_latency_s=SLOW_TIER_LATENCY_S)


class CostPolicy(RouterPolicy):
    """The router's cost picker with its tickets (see the module docstring)."""

    picker: CostPicker

    def bind(self, fleet: Fleet) -> None:
        super().bind(fleet)
        model = self.picker.model
        model.live_gauges = True
        cfg, cost = fleet.config, fleet.cost
        if not (cfg.cpu_blocks or cfg.disk_blocks or cfg.shared_blocks):
            return  # plain vLLM: nothing to report
        media: dict[str, tuple[float, float, int]] = {}
        for medium, on, per_token, latency in (
            ("CPU", cfg.cpu_blocks, cost.cpu_load_s, 0.0),
            ("DISK", cfg.disk_blocks, cost.disk_load_s, 0.0),
            ("REMOTE", cfg.shared_blocks, cost.shared_load_s, cost.shared_latency_s),
        ):
            if on and per_token > 0:
                media[medium] = (1.0 / per_token, latency, 1)  # bytes_per_token 1: bytes = tokens
        for i, name in enumerate(self.states.names):
            tps = cost.prefill_tps / cfg.slowdown(i)  # what this replica measures (a mixed fleet)
            model.report(name, Report(at=0.0, bytes_per_token=1.0, prefill_tokens_per_s=tps, media=media))

    def summary(self) -> dict[str, Any]:
        err = median_error(self.picker.model)
        return {"ttft_prediction_median_abs_error": round(err, 4) if err is not None else None}


def cost_targets(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per fleet size and kind: cost's TTFT p50 and p99 over llm-d's (target ≤ 0.8 each)."""
    out: dict[str, Any] = {}
    for r in results:
        if r["policy"] != "cost":
            continue
        peer = next(
            (
                p
                for p in results
                if p["policy"] == "llm-d" and (p["replicas"], p["fleet"]) == (r["replicas"], r["fleet"])
            ),
            None,
        )
        if peer is None:
            continue
        row = {}
        for q in ("p50", "p99"):
            ratio = round(r[f"ttft_{q}_s"] / peer[f"ttft_{q}_s"], 3) if peer[f"ttft_{q}_s"] else None
            row[f"ttft_{q}_vs_llm_d"] = {"ratio": ratio, "le_0_8": ratio is not None and ratio <= 0.8}
        out.setdefault(str(r["replicas"]), {})[r["fleet"]] = row
    return out
