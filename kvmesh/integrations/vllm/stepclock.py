"""Times vLLM's forward passes, so the engine learns its own prefill rate.

The connector sees each step's forward begin at ``bind_connector_metadata`` (or, in a step
with synchronous loads, once ``start_load_kv`` has issued them: vLLM 0.32 calls
``start_load_kv`` before the forward only then, and after it otherwise) and end at
``wait_for_save``. The forward between them is what computing a prompt costs; the scheduler
side tells the worker how many tokens and requests the step scheduled
(``KVMeshConnectorMetadata.scheduled_tokens``). Each pair goes to
:meth:`kvmesh.core.loadcost.LoadCosts.observe_step`, which measures the per-token cost that
:meth:`~kvmesh.core.loadcost.LoadCosts.cut` weighs loads against.

On vLLM-CPU the forward runs on the calling thread, so host time is the forward's time. On a
GPU the host only launches the kernels, so the span is two timing events on the compute
stream, read back at a later step once the second one has completed (never waited for).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import torch

from kvmesh.core.loadcost import LoadCosts

_MAX_PENDING = 64  # GPU spans not yet complete; older ones are dropped, never waited for


class StepClock:
    def __init__(self, costs: LoadCosts, device: torch.device) -> None:
        self.costs = costs
        self.cuda = device.type == "cuda"
        self._open: tuple[int, int, Any] | None = None  # (tokens, requests, start)
        self._pending: deque[tuple[int, int, Any, Any]] = deque()
        self.last_s: float | None = None  # the last forward's seconds (host-timed steps only)

    def begin(self, tokens: int, requests: int) -> None:
        """The forward of a step of ``tokens`` tokens (``requests`` requests) starts now."""
        self._collect()
        if tokens <= 0:
            self._open = None
            return
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            ev.record()
            self._open = (tokens, requests, ev)
        else:
            self._open = (tokens, requests, time.perf_counter())

    def end(self) -> None:
        """That forward has been issued (GPU) or has run (CPU)."""
        if self._open is None:
            return
        tokens, requests, start = self._open
        self._open = None
        if not self.cuda:
            self.last_s = time.perf_counter() - start
            self.costs.observe_step(tokens, requests, self.last_s)
            return
        ev = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        ev.record()
        if len(self._pending) >= _MAX_PENDING:
            self._pending.popleft()
        self._pending.append((tokens, requests, start, ev))

    def _collect(self) -> None:
        while self._pending and self._pending[0][3].query():
            tokens, requests, start, stop = self._pending.popleft()
            self.costs.observe_step(tokens, requests, start.elapsed_time(stop) / 1e3)
