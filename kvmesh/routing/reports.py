"""Reading what replicas say about their own costs, as untrusted input.

Two sources, the same figures (:meth:`kvmesh.core.engine.CacheEngine.cost_figures`):

* the engine's admin API, ``GET /kvmesh/admin/v1/stats`` (its ``costs`` object), polled every
  ``interval_s`` by :class:`ReportPoller` for replicas with an admin URL; works whatever
  vLLM's logging settings;
* ``kvmesh:*`` gauges on vLLM's ``/metrics`` (:mod:`kvmesh.integrations.vllm.prom`), which
  the pool scrapes anyway: :func:`report_from_metrics`.

Either is another process's word. Every field is type-checked and bounded here; a value
outside its plausible range is dropped and counted (``rejected``), never clamped into a
figure that looks real; bodies are read up to ``MAX_BODY`` bytes. What survives is still
only a prior: :class:`~kvmesh.routing.fit.ReplicaFit` checks it against observed TTFTs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import time
from collections.abc import Callable, Iterable
from typing import Any

import aiohttp

from kvmesh.admin.schema import ENGINE_PREFIX
from kvmesh.routing.fit import TIER_MEDIUM, Report
from kvmesh.routing.replies import ReplyError, json_capped

log = logging.getLogger(__name__)

MAX_BODY = 1 << 20
# Plausible ranges; outside them a figure is refused.
BOUNDS = {
    "bytes_per_token": (1.0, float(64 << 20)),  # up to 64 MiB of KV per token
    "bytes_per_s": (1e5, 1e13),  # 100 KB/s .. 10 TB/s
    "latency_s": (0.0, 60.0),
    "prefill_tokens_per_s": (1.0, 1e8),
    "count": (0.0, 2.0**53),
    "bytes": (0.0, 1e17),
}


def _num(value: Any, kind: str, rejected: list[str], what: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        rejected.append(f"{what}: not a number")
        return None
    v = float(value)
    lo, hi = BOUNDS[kind]
    if not (math.isfinite(v) and lo <= v <= hi):
        rejected.append(f"{what}: out of range")
        return None
    return v


def report_from_figures(figures: Any, now: float, source: str = "admin") -> tuple[Report | None, list[str]]:
    """A :class:`Report` from an engine's ``costs`` object, and what was refused in it."""
    rejected: list[str] = []
    if not isinstance(figures, dict):
        return None, ["costs: not an object"]
    rep = Report(at=now, source=source)
    rep.bytes_per_token = _num(figures.get("bytes_per_token"), "bytes_per_token", rejected, "bytes_per_token")
    rep.prefill_tokens_per_s = _num(
        figures.get("prefill_tokens_per_s"), "prefill_tokens_per_s", rejected, "prefill_tokens_per_s"
    )
    rep.prefill_steps = int(_num(figures.get("steps"), "count", rejected, "steps") or 0)
    tiers = figures.get("tiers")
    for tier, t in tiers.items() if isinstance(tiers, dict) else ():
        medium = TIER_MEDIUM.get(tier) if isinstance(tier, str) else None
        if medium is None or not isinstance(t, dict):
            rejected.append("tiers: unknown tier")
            continue
        bw = _num(t.get("load_bytes_per_s"), "bytes_per_s", rejected, f"{tier}.load_bytes_per_s")
        lat = _num(t.get("load_latency_s"), "latency_s", rejected, f"{tier}.load_latency_s")
        loads = _num(t.get("loads"), "count", rejected, f"{tier}.loads")
        if bw is not None and lat is not None:
            rep.media[medium] = (bw, lat, int(loads or 0))
    use = figures.get("use")
    for tier, u in use.items() if isinstance(use, dict) else ():
        if tier not in TIER_MEDIUM or not isinstance(u, dict):
            continue
        used = _num(u.get("bytes_used"), "bytes", rejected, f"{tier}.bytes_used")
        cap = _num(u.get("capacity_bytes"), "bytes", rejected, f"{tier}.capacity_bytes")
        if used is not None:
            rep.use[tier] = (used, cap if cap else None)
    return rep, rejected


_KVMESH_RE = re.compile(r"^kvmesh:([a-z_]+)(\{[^\n}]*\})?[ \t]+(\S+)", re.MULTILINE)
_TIER_RE = re.compile(r'tier="([^"\\]{1,32})"')
_METRIC_KEYS = {
    "tier_load_bytes_per_second": "load_bytes_per_s",
    "tier_load_latency_seconds": "load_latency_s",
    "tier_bytes_used": "bytes_used",
    "tier_capacity_bytes": "capacity_bytes",
}


def report_from_metrics(text: str, now: float, previous: Report | None) -> tuple[Report | None, list[str]]:
    """A :class:`Report` from the ``kvmesh:*`` gauges of a vLLM ``/metrics`` page (None when
    it has none). Gauges carry no load counts, so a changed figure counts as new."""
    if "kvmesh:" not in text:
        return None, []
    figures: dict[str, Any] = {"tiers": {}, "use": {}}
    for m in _KVMESH_RE.finditer(text):
        name, labels, raw = m.group(1), m.group(2) or "", m.group(3)
        try:
            value: float = float(raw)
        except ValueError:
            continue
        if name == "kv_bytes_per_token":
            figures["bytes_per_token"] = value
        elif name == "prefill_tokens_per_second":
            figures["prefill_tokens_per_s"] = value
        elif name in _METRIC_KEYS:
            tier = _TIER_RE.search(labels)
            if tier is None:
                continue
            key = _METRIC_KEYS[name]
            group = "use" if key in ("bytes_used", "capacity_bytes") else "tiers"
            figures[group].setdefault(tier.group(1), {})[key] = value
    rep, rejected = report_from_figures(figures, now, "metrics")
    if rep is not None:
        prev = previous.media if previous is not None else {}
        for medium, (bw, lat, _) in list(rep.media.items()):
            old = prev.get(medium)
            count = 0 if old is None else old[2] + (old[0] != bw or old[1] != lat)
            rep.media[medium] = (bw, lat, count)
        old_rate = previous.prefill_tokens_per_s if previous is not None else None
        steps = previous.prefill_steps if previous is not None else 0
        rep.prefill_steps = steps + (rep.prefill_tokens_per_s != old_rate)
    return rep, rejected


class ReportPoller:
    """Polls each replica's admin ``stats`` every ``interval_s`` into ``on_report``."""

    def __init__(
        self,
        targets: Callable[[], Iterable[tuple[str, str]]],
        on_report: Callable[[str, Report | None, list[str]], None],
        *,
        token: str | None = None,
        interval_s: float = 2.0,
        timeout_s: float = 2.0,
    ) -> None:
        self._targets = targets
        self._on_report = on_report
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.interval_s = interval_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._task: asyncio.Task[None] | None = None

    def start(self, client: aiohttp.ClientSession) -> None:
        self._task = asyncio.create_task(self._loop(client), name="kvmesh-cost-reports")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _loop(self, client: aiohttp.ClientSession) -> None:
        while True:
            try:
                await self.poll_all(client)
            except Exception:  # one bad round must not stop the polling for good
                log.exception("cost report polling failed")
            await asyncio.sleep(self.interval_s)

    async def poll_all(self, client: aiohttp.ClientSession) -> None:
        await asyncio.gather(*(self._poll(client, name, url) for name, url in list(self._targets())))

    async def _poll(self, client: aiohttp.ClientSession, name: str, admin_url: str) -> None:
        url = admin_url.rstrip("/") + ENGINE_PREFIX + "stats"
        try:
            async with client.get(url, headers=self._headers, timeout=self._timeout) as resp:
                if resp.status != 200:
                    log.debug("cost report from %s: HTTP %d", name, resp.status)
                    return
                body = await json_capped(resp, MAX_BODY)
        except ReplyError as exc:
            self._on_report(name, None, [f"stats: {exc}"])
            return
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
            log.debug("cost report from %s failed: %r", name, exc)
            return
        costs = body.get("costs") if isinstance(body, dict) else None
        report, rejected = report_from_figures(costs, time.monotonic())
        self._on_report(name, report, rejected)
