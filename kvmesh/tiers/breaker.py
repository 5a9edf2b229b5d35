"""Retries within one deadline, and the circuit breaker, for every remote tier.

:class:`RemoteGuard` runs a tier's network operations. The contract (Redis today; S3 and
Redis Cluster tiers reuse it):

* **One budget per operation.** ``timeout_s`` bounds a whole operation, retries and backoff
  included (see :mod:`kvmesh.tiers.deadline`; a caller's earlier deadline wins). A retry is
  only tried when the budget still covers its backoff; the client caps each socket wait at
  the time left.
* **A timeout opens the breaker at once.** A server that accepts connections but does not
  answer (black-holed, SIGSTOPped, swapping) is the case that stalls a batch, so the first
  timeout marks the tier down. Fast failures (connection refused or reset) open it after
  ``failure_threshold`` consecutive failed attempts.
* **Down costs nothing.** While the breaker is open every operation fails at once with
  :class:`~kvmesh.errors.TierUnavailableError` (the tier answers a miss or ``False``), and
  a daemon thread pings every ``probe_interval_s`` with its own short timeout; the first
  answer closes the breaker.
* **Server answers are not outages.** An error reply (WRONGTYPE, OOM) raises
  :class:`~kvmesh.errors.TierError` without touching the breaker.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from kvmesh.errors import TierError, TierUnavailableError
from kvmesh.metrics import TierMetrics
from kvmesh.tiers.deadline import deadline, time_left

log = logging.getLogger(__name__)
T = TypeVar("T")
# A try with less budget than this left is not started: it could not finish, and a timeout
# it provoked would open the breaker although the server is fine.
MIN_TRY_S = 0.005
BACKOFF_BASE_S = 0.02
BACKOFF_CAP_S = 0.5


class RemoteGuard:
    """Deadline-bounded retries and a circuit breaker around one remote service."""

    def __init__(
        self,
        name: str,
        url: str,
        metrics: TierMetrics,
        *,
        ping: Callable[[], bool],
        timeout_s: float,
        retries: int = 3,
        failure_threshold: int = 3,
        probe_interval_s: float = 1.0,
        timeout_errors: tuple[type[BaseException], ...] = (TimeoutError,),
        conn_errors: tuple[type[BaseException], ...] = (OSError,),
        server_errors: tuple[type[BaseException], ...] = (),
        auth_errors: tuple[type[BaseException], ...] = (),
    ) -> None:
        """``auth_errors``: the server answered and refused our credentials; reported as an
        authentication failure, not as unreachable (checked before ``conn_errors``)."""
        self.name = name
        self.url = url
        self.metrics = metrics
        self.timeout_s = timeout_s
        self.retries = max(0, retries)
        self.failure_threshold = max(1, failure_threshold)
        self.probe_interval_s = probe_interval_s
        self._ping = ping
        self._timeout_errors = timeout_errors
        self._conn_errors = conn_errors
        self._server_errors = server_errors
        self._auth_errors = auth_errors
        self._ping_error: BaseException | None = None
        self._lock = threading.Lock()
        self._failures = 0
        self._up = threading.Event()
        self._closed = threading.Event()
        self._probe: threading.Thread | None = None

    def start(self) -> None:
        """Ping once (a service unreachable at start is not an error: the guard starts down
        and the probe brings it up), then start the probe thread."""
        if self._safe_ping():
            self._mark_up()
        elif self._auth_errors and isinstance(self._ping_error, self._auth_errors):
            log.error(
                "kvmesh tier %s: %s refused our credentials (%s); starting down: check the "
                "username and password (the URL's user:password@, or LMCache's extra_config keys)",
                self.name,
                self.url,
                self._ping_error,
            )
            self.metrics.set("up", 0)
        else:
            # The cause names a TLS or DNS misconfiguration, which no retry mends.
            cause = (
                f"{type(self._ping_error).__name__}: {self._ping_error}"[:300]
                if self._ping_error
                else "no answer"
            )
            log.warning(
                "kvmesh tier %s: %s unreachable at start (%s); starting down", self.name, self.url, cause
            )
            self.metrics.set("up", 0)
        self._probe = threading.Thread(target=self._probe_loop, name=f"kvmesh-probe-{self.name}", daemon=True)
        self._probe.start()

    @property
    def up(self) -> bool:
        return self._up.is_set() and not self._closed.is_set()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def health(self) -> str:
        if not self.up:
            return "down"
        return "degraded" if self._failures else "up"

    def guard(self, op: Callable[[], T]) -> T | None:
        """:meth:`run`, with ``None`` when the operation could not run (down, closed, error)."""
        try:
            return self.run(op)
        except TierError:
            return None

    def run(self, op: Callable[[], T]) -> T:
        if self._closed.is_set():
            raise TierUnavailableError(f"tier {self.name} is closed")
        if not self._up.is_set():
            raise TierUnavailableError(
                f"tier {self.name}: {self.url} is down; waiting for it to answer a ping"
            )
        with deadline(self.timeout_s):
            attempt = 0
            while True:
                left = time_left()
                if left is not None and left < MIN_TRY_S:
                    self.metrics.inc("deadline_misses")
                    raise TierUnavailableError(f"tier {self.name}: the operation's time budget is spent")
                try:
                    result = op()
                except self._auth_errors as exc:
                    self.metrics.inc("errors")
                    self._trip(exc)
                    raise TierUnavailableError(
                        f"tier {self.name}: {self.url} refused our credentials (authentication failed: {exc})"
                    ) from None
                except self._timeout_errors as exc:
                    self.metrics.inc("errors")
                    self.metrics.inc("timeouts")
                    self._trip(exc)
                    raise TierUnavailableError(f"tier {self.name}: {self.url} timed out: {exc}") from None
                except self._conn_errors as exc:
                    self.metrics.inc("errors")
                    tripped = self._record_failure(exc)
                    pause = _backoff(attempt + 1)
                    left = time_left()
                    if tripped or attempt >= self.retries or (left is not None and pause + MIN_TRY_S >= left):
                        raise TierUnavailableError(
                            f"tier {self.name}: {self.url} unreachable: {exc}"
                        ) from None
                    attempt += 1
                    time.sleep(pause)
                except self._server_errors as exc:
                    self.note_error(exc)
                    raise TierError(f"tier {self.name}: {exc}") from None
                else:
                    with self._lock:
                        self._failures = 0
                    return result

    def timed_out(self, exc: BaseException, count: int = 1) -> None:
        """``count`` operations its caller stopped waiting for at the deadline (they hang
        past every socket timeout): counted as timeouts, and the breaker opens, as for one
        that timed out inside :meth:`run`."""
        self.metrics.inc("errors", count)
        self.metrics.inc("timeouts", count)
        self._trip(exc)

    def note_error(self, exc: BaseException) -> None:
        self.metrics.inc("errors")
        log.debug("kvmesh tier %s: %s", self.name, exc)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        if self._probe is not None:
            self._probe.join(timeout=max(2.0, self.probe_interval_s + 1.0))

    # ---- the breaker ------------------------------------------------------------------

    def _record_failure(self, exc: BaseException) -> bool:
        """Count one fast failure; True when the breaker is (now) open."""
        with self._lock:
            self._failures += 1
            if self._failures < self.failure_threshold and self._up.is_set():
                return False
        self._trip(exc)
        return True

    def _trip(self, exc: BaseException) -> None:
        with self._lock:
            if not self._up.is_set():
                return
            self.metrics.set("up", 0)  # the gauge moves first, as in _mark_up
            self._up.clear()
            failures = self._failures
        log.warning(
            "kvmesh tier %s: %s (%d consecutive failures); marking down, probing every %.1fs",
            self.name,
            str(exc) or type(exc).__name__,
            max(failures, 1),
            self.probe_interval_s,
        )

    def _mark_up(self) -> None:
        with self._lock:
            self._failures = 0
            self.metrics.set("up", 1)  # before health() says up: whoever saw that reads 1 too
            self._up.set()

    def _safe_ping(self) -> bool:
        try:
            self._ping_error = None
            with deadline(self.timeout_s):  # a server that drips its answer: one budget at most
                return self._ping()
        except Exception as exc:  # whatever the client raises, an unanswered ping means "down"
            self._ping_error = exc
            return False

    def _probe_loop(self) -> None:
        while not self._closed.wait(self.probe_interval_s):
            if not self._up.is_set() and self._safe_ping():
                log.warning("kvmesh tier %s: %s answers again; marking up", self.name, self.url)
                self._mark_up()


def _backoff(attempt: int) -> float:
    """Equal-jitter exponential backoff: replicas that failed together don't retry in step."""
    cap = min(BACKOFF_CAP_S, BACKOFF_BASE_S * (2**attempt))
    return float(cap / 2 + random.uniform(0, cap / 2))
