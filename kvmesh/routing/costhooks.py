"""What the routing core does around the cost model, for the router and the EPP alike.

:class:`CostHooks` ties a :class:`~kvmesh.routing.cost.CostPicker` to a service: it counts a
request where it was sent (:meth:`sent`, the dispatcher's ``track`` hook: the ticket it
returns gets the dispatcher ticket's first byte, for streams, and its end), feeds the
pool's scrapes and the replicas' admin reports into the model, registers the metrics, and
serves what the model knows: ``/kvmesh/state``'s ``cost`` section and ``GET
/kvmesh/cost/records`` (the last ``RECORDS`` requests' predicted and observed TTFT, for
benchmarks).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry

from kvmesh.routing.cost import CostModel, CostPicker, Ticket, median_error
from kvmesh.routing.costmetrics import CostMetrics, fleet_usage, kv_usage
from kvmesh.routing.fit import FEATURES, Report
from kvmesh.routing.picker import Decision, Picker
from kvmesh.routing.reports import ReportPoller, report_from_metrics
from kvmesh.routing.scorers import ReplicaState

if TYPE_CHECKING:
    from kvmesh.routing.config import RoutingConfig
    from kvmesh.routing.pool import Replica

RECORDS = 10_000


class RecordedTicket:
    """A :class:`Ticket` whose first byte is also written to the hooks' records."""

    __slots__ = ("_hooks", "_seq", "ticket")

    def __init__(self, hooks: CostHooks, ticket: Ticket, seq: int) -> None:
        self._hooks = hooks
        self.ticket = ticket
        self._seq = seq

    def first_byte(self) -> None:
        observed = self.ticket.first_byte()
        if observed is not None:
            t = self.ticket
            self._hooks.records.append(
                {
                    "seq": self._seq,
                    "replica": t.name,
                    "predicted_s": round(t.predicted, 6),
                    "observed_s": round(observed, 6),
                    "sent_s": round(t.sent_at - self._hooks.started, 6),
                    "features": {k: round(float(v), 6) for k, v in zip(FEATURES, t.x, strict=True) if v},
                }
            )

    def finished(self) -> None:
        self.ticket.finished()


class CostHooks:
    def __init__(
        self,
        picker: CostPicker,
        config: RoutingConfig,
        registry: CollectorRegistry,
        candidates: Callable[[], Sequence[ReplicaState]],
        token: str | None = None,
    ) -> None:
        self.picker = picker
        self.model: CostModel = picker.model
        self.metrics = CostMetrics(self.model, registry, candidates)
        self.candidates = candidates
        self.records: deque[dict[str, Any]] = deque(maxlen=RECORDS)
        self._seq = 0
        self.started = self.model.clock()  # records' send times count from here
        self._admins: dict[str, str] = {r.key: r.admin for r in config.replicas if r.admin}
        self.poller = ReportPoller(
            lambda: list(self._admins.items()),
            self._reported,
            token=token,  # the replicas' admin API token
            interval_s=config.cost.report_interval_s,
        )

    @classmethod
    def of(
        cls,
        picker: Picker,
        config: RoutingConfig,
        registry: CollectorRegistry,
        candidates: Callable[[], Sequence[ReplicaState]],
        token: str | None = None,
    ) -> CostHooks | None:
        """Hooks for ``picker`` when it is the cost policy's, else None."""
        if not isinstance(picker, CostPicker):
            return None
        return cls(picker, config, registry, candidates, token)

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self, client: aiohttp.ClientSession) -> None:
        self.poller.start(client)

    async def stop(self) -> None:
        await self.poller.stop()

    def mount(self, app: web.Application) -> None:
        app.router.add_get("/kvmesh/cost/records", self._records)

    # -- inputs ----------------------------------------------------------------------------------
    def admin_registered(self, name: str, url: str) -> None:
        """An engine registered with the controller under a replica's name: poll it too."""
        self._admins.setdefault(name, url)

    def scraped(self, replica: Replica, text: str, gauges: dict[str, float]) -> None:
        if gauges:
            self.model.gauges_scraped(replica.name)
        fit = self.model.fits.get(replica.name)
        report, rejected = report_from_metrics(
            text, time.monotonic(), fit.report if fit is not None else None
        )
        self._reported(replica.name, report, rejected)

    def _reported(self, name: str, report: Report | None, rejected: list[str]) -> None:
        fit = self.model.fit(name)
        for why in rejected:
            fit.reject(why)
        if report is not None:
            self.model.report(name, report)

    # -- per request -----------------------------------------------------------------------------
    def sent(self, decision: Decision | None, name: str) -> RecordedTicket | None:
        if decision is None:
            return None
        ticket = self.picker.sent(decision, name)
        if ticket is None:
            return None
        self._seq += 1
        return RecordedTicket(self, ticket, self._seq)

    # -- outputs ---------------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        states = list(self.candidates())
        err = median_error(self.model)
        return {
            "replicas": self.model.describe(),
            "median_abs_rel_error": round(err, 4) if err is not None else None,
            "kv_usage": kv_usage(self.model, states),
            "fleet_kv_usage": fleet_usage(self.model, states),
        }

    async def _records(self, request: web.Request) -> web.StreamResponse:
        return web.json_response({"records": list(self.records)})
