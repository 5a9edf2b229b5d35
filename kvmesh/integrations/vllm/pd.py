"""Prefill/decode disaggregation in the connector: the producer and consumer halves.

vLLM's disaggregation handshake, as NIXL uses it:

1. The router sends the prompt to a producer (``kv_role: kv_producer`` or ``kv_both``) with
   ``max_tokens: 1`` and ``kv_transfer_params: {"do_remote_decode": true}``. When vLLM
   finishes it, the connector's ``request_finished`` asks the worker to :meth:`PdWorker.export`
   the prompt: its saved chunks are pinned under a fresh, unguessable transfer id (until the
   consumer confirms or ``pd_pin_timeout_s``; bounded, see :class:`~kvmesh.transport.PinLedger`)
   and their keys returned. vLLM puts what ``request_finished`` returns in the response's
   top-level ``kv_transfer_params`` (completions and chat alike), signed with the fleet key
   (:mod:`~kvmesh.integrations.vllm.pd_params`).

2. The router sends the original request to a consumer (``kv_consumer`` or ``kv_both``)
   with exactly those ``kv_transfer_params``. The scheduler side's lookup first asks the
   worker to :meth:`PdWorker.pull` the chunks from the producer's transfer server into its
   pool (kvmesh.transport), then looks the prompt up as usual: the pulled chunks are
   external hits vLLM loads, like any chunk kvmesh holds. The pull confirms, so the
   producer unpins at once. The worker acts only on params whose signature and expiry hold,
   and connects only to the signed address: a refusal is counted
   (``pd_fallbacks_total[params_*]``), logged once, and vLLM computes the prompt.

Security modes (:func:`pd_mode`): with a fleet key, params are signed and every transfer
connection is authenticated (``signed``); without one, ``kv_producer`` / ``kv_consumer``
refuse to start unless ``pd_allow_insecure: true`` says otherwise (``insecure``, logged as
such), and ``kv_both`` replicas run with PD off (``off``: no transfer server, no pulls).

A pull that fails (producer gone, hung, a chunk failing verification, keys of another
model) is counted in the worker's ``pd_fallbacks_total[reason]``; the lookup then finds
whatever the shared tier holds (``pd_fallback_outcomes[shared]``), and vLLM computes the
rest (``[recompute]``). Output is never wrong: only verified chunks of the same key enter.

The pull runs inside the scheduler's lookup (synchronous, bounded by
``pd_fetch_timeout_s``): the scheduler waits for it (milliseconds for a 2,000-token prompt
of the test model over loopback; at most the timeout for a hung producer). With
``pd_async_pull: true`` it runs on a worker thread instead and the lookup answers vLLM "not
known yet" (``None``) until it ends; on vLLM-CPU the worker's busy step loop starves that
thread of the GIL (a 1,100-token pull timed out at 3 s in the e2e test), so it is off by
default.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from kvmesh.core.engine import CacheEngine
from kvmesh.core.keys import ChunkKey, as_token_array
from kvmesh.errors import ConfigError
from kvmesh.integrations.vllm.options import ConnectorOptions
from kvmesh.integrations.vllm.pd_params import (
    PARAMS_KEY,
    Transfer,
    new_transfer_id,
    remote_prefill,
    response_params,
    verify_params,
    wants_export,
)
from kvmesh.transport import PinLedger, TransferServer, confirm, pull
from kvmesh.transport.client import stall_budget

log = logging.getLogger(__name__)

__all__ = ["PARAMS_KEY", "PdWorker", "pd_mode", "remote_prefill", "response_params", "wants_export"]

SAVER_WAIT_S = 2.0  # export waits this long for the request's last saves to reach the pool


def pd_mode(options: ConnectorOptions, kv_role: str) -> str:
    """``signed`` (a fleet key), ``insecure`` (no key, ``pd_allow_insecure``) or ``off``
    (``kv_both`` without either: no transfer server, no pulls). A ``kv_producer`` or
    ``kv_consumer`` with neither is a :class:`ConfigError`: a PD replica must not start
    open to any host on its network by default."""
    if options.fleet_key is not None:
        return "signed"
    if options.pd_allow_insecure:
        log.warning(
            "kvmesh: prefill/decode transfers are INSECURE (pd_allow_insecure, no fleet key): any host "
            "that reaches this replica can read or pin held KV, and kv_transfer_params are not signed"
        )
        return "insecure"
    if kv_role in ("kv_producer", "kv_consumer"):
        raise ConfigError(
            f"kv_role {kv_role} needs a fleet key: set fleet_key_file in kv_connector_extra_config (or "
            "KVMESH_FLEET_KEY_FILE) to a file from `kvmesh config fleet-key`, the same on every replica; "
            "or set pd_allow_insecure: true to run prefill/decode unauthenticated (see docs/security.md)"
        )
    log.info("kvmesh: no fleet key: prefill/decode transfers are off on this kv_both replica")
    return "off"


def advertised_host(options: ConnectorOptions) -> str:
    if options.pd_advertise_host:
        return options.pd_advertise_host
    if options.kv_ip in ("0.0.0.0", "::", ""):
        return socket.gethostname()
    return options.kv_ip


def _tokens(ids: Any) -> np.ndarray:
    return as_token_array(np.asarray(ids, dtype=np.int64))


class PdWorker:
    """The worker process's PD half: a transfer server (producer roles) and pulls
    (consumer roles), answering the scheduler over the connector's RPC socket.
    ``enabled=False`` (:func:`pd_mode` ``off``): no server, and every pull is refused."""

    def __init__(
        self,
        engine: CacheEngine,
        options: ConnectorOptions,
        *,
        produce: bool,
        port: int,
        rank: int = 0,
        drain_saves: Callable[[float], bool] = lambda _t: True,
        enabled: bool = True,
    ) -> None:
        self.engine = engine
        self.options = options
        self.rank = rank
        self.key = options.fleet_key
        # Without a key nothing is authenticated: only the explicit opt-in allows that.
        self.enabled = enabled and (self.key is not None or options.pd_allow_insecure)
        self._drain = drain_saves
        self.counters: Counter[str] = Counter()
        self.fallbacks: Counter[str] = Counter()
        self.outcomes: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._pulls: dict[str, tuple[threading.Event, float]] = {}  # background pulls
        self._logged: set[str] = set()  # refusal reasons already logged at warning level
        self.pins: PinLedger | None = None
        self.server: TransferServer | None = None
        if produce and self.enabled:
            slots = engine.cpu.pool.num_slots
            self.pins = PinLedger(
                engine,
                options.pd_pin_timeout_s,
                max_requests=options.pd_pin_max_requests,
                max_chunks=max(1, int(slots * options.pd_pin_max_fraction)),
            )
            # Rank r of a tensor-parallel producer listens on kv_port + r (or a free port).
            want = port + rank if port else 0
            self.server = TransferServer(engine, self.pins, options.kv_ip, want, key=self.key).start()
            log.info(
                "kvmesh: PD transfer server of rank %d on %s:%d (%s)",
                rank,
                options.kv_ip,
                self.server.port,
                "fleet key" if self.key is not None else "UNAUTHENTICATED",
            )

    def handlers(self) -> dict[str, Callable[..., Any]]:
        return {
            "pd_export": self.export,
            "pd_pull": self.pull,
            "pd_pull_start": self.pull_start,
            "pd_pull_done": self.pull_done,
            "pd_confirm": self.confirm_params,
        }

    # -- producer ----------------------------------------------------------------------
    def export(self, req: str, tokens: list[int], transfer_id: str | None = None) -> dict[str, Any] | None:
        """Pin the leading chunks of ``tokens`` held in the pool for vLLM request ``req``
        under ``transfer_id`` (the scheduler's, shared by every rank; default a fresh one);
        where and under which keys a consumer fetches them. ``None``: this replica serves
        no KV."""
        if self.server is None or self.pins is None:
            return None
        tid = transfer_id if transfer_id is not None else new_transfer_id()
        if not isinstance(tid, str) or not 16 <= len(tid) <= 128:
            raise ValueError("transfer_id must be a string of 16 to 128 characters (secrets.token_urlsafe)")
        arr = _tokens(tokens)
        # The request's last chunks were handed to the saver in its final step.
        if not self._drain(SAVER_WAIT_S):
            log.warning("kvmesh: PD export of %s: saves still queued after %.0f s", req, SAVER_WAIT_S)
        keys = self.engine.keys.keys_for_array(arr)
        held = self.engine.cpu.contains(keys)
        n = held.index(False) if False in held else len(held)
        keys = self.pins.hold(tid, keys[:n])  # bounded: may keep fewer
        n = len(keys)
        self.server.prepare(keys)  # checksums and MACs now, off the transfer's path
        with self._lock:
            self.counters["pd_exports"] += 1
            self.counters["pd_export_chunks"] += n
        bounds = self.engine.keys.chunk_bounds(len(arr))
        return {
            "transfer_id": tid,
            "keys": [k.text for k in keys],
            "num_tokens": bounds[n - 1][1] if n else 0,
            "model_fingerprint": self.engine.model_id,
            "host": advertised_host(self.options),
            "port": self.server.port,
        }

    # -- consumer ----------------------------------------------------------------------
    def _verified(self, req: str, params: Mapping[str, Any], arr: np.ndarray | None) -> Transfer | str:
        """The params' transfer, or why they are refused (counted, logged once per reason;
        no connection is made for refused params)."""
        if not self.enabled:
            return "pd_off"
        got = verify_params(params, self.key)
        if isinstance(got, Transfer):
            return got
        with self._lock:
            if arr is None:  # a confirm: no pull fell back
                self.counters["pd_confirms_refused"] += 1
            else:
                self.fallbacks[got] += 1
            first_time = got not in self._logged
            self._logged.add(got)
        if arr is not None:
            found = self.engine.lookup(arr)
            with self._lock:
                self.outcomes["shared" if found else "recompute"] += 1
        log.log(
            logging.WARNING if first_time else logging.DEBUG,
            "kvmesh: refused the kv_transfer_params of %s (%s): not pulled, nothing connected to; "
            "vLLM computes what no tier holds (later refusals of this kind are logged at debug level)",
            req,
            got,
        )
        return got

    def pull(self, req: str, tokens: list[int], params: dict[str, Any]) -> dict[str, Any]:
        """Bring the producer's chunks of ``tokens`` into this engine's pool (then the
        scheduler's usual lookup finds them). Never raises for transfer trouble."""
        arr = _tokens(tokens)
        with self._lock:
            self.counters["pd_pulls"] += 1
        tr = self._verified(req, params, arr)
        if not isinstance(tr, Transfer):
            return {"tokens": 0, "reason": tr}
        host, port = tr.host, tr.port(self.rank)
        theirs = list(tr.keys)
        keys = self.engine.keys.keys_for_array(arr)
        n = _agreeing(keys, theirs, self.engine.config.chunk_size)
        if not theirs or not keys:
            self.confirm(host, port, tr.transfer_id)
            return {"tokens": 0, "reason": None}
        if n == 0:
            # Another model fingerprint, layout, chunk size or salt: nothing there is ours.
            self.confirm(host, port, tr.transfer_id)
            self._fallback(req, "key_mismatch", arr, 0, f"producer keys {theirs[0]} vs ours {keys[0]}")
            return {"tokens": 0, "reason": "key_mismatch"}
        keys = keys[:n]
        held = self.engine.cpu.contains(keys)
        first = held.index(False) if False in held else len(held)
        t0 = time.monotonic()
        res = pull(
            self.engine,
            host,
            port,
            tr.transfer_id,
            keys[first:],
            arr,
            timeout_s=self.options.pd_fetch_timeout_s,
            connect_timeout_s=self.options.pd_connect_timeout_s,
            first=first,
            key=self.key,
        )
        with self._lock:
            self.counters["pd_pull_chunks"] += res.chunks
            self.counters["pd_pull_bytes"] += res.nbytes
            self.counters["pd_pull_ms"] += int((time.monotonic() - t0) * 1000)
            self.counters["pd_confirm_failures"] += int(res.confirmed is False)
            self.counters["pd_pull_resumes"] += res.resumes
            first_resume = res.resumes > 0 and "resumed" not in self._logged
            if first_resume:
                self._logged.add("resumed")
        if res.resumes:
            log.log(
                logging.WARNING if first_resume else logging.DEBUG,
                "kvmesh: PD pull for %s from %s:%d stalled (nothing arrived for %.1f s) and resumed on "
                "a fresh connection %d time(s); %d of %d chunks arrived (later resumes are logged at "
                "debug level, counted in pd_pull_resumes)",
                req,
                host,
                port,
                stall_budget(self.options.pd_fetch_timeout_s, self.options.pd_connect_timeout_s),
                res.resumes,
                res.chunks,
                len(keys) - first,
            )
        if res.confirmed is False:
            log.warning(
                "kvmesh: the producer at %s:%d did not acknowledge the confirm of %s; its pins "
                "end after its pd_pin_timeout_s",
                host,
                port,
                req,
            )
        if res.reason is not None:
            self._fallback(req, res.reason, arr, res.tokens, res.detail)
        return {"tokens": res.tokens, "reason": res.reason, "seconds": res.seconds}

    def pull_start(self, req: str, tokens: list[int], params: dict[str, Any]) -> bool:
        """:meth:`pull` on a thread of its own: the scheduler goes on scheduling other
        requests and asks :meth:`pull_done` at its next steps."""
        now = time.monotonic()
        with self._lock:
            # Entries whose scheduler never asked again (request aborted) go after a while.
            stale = 2 * self.options.pd_fetch_timeout_s + 60
            for r in [r for r, (ev, t0) in self._pulls.items() if ev.is_set() and now - t0 > stale]:
                del self._pulls[r]
            if req in self._pulls:
                return True
            done = threading.Event()
            self._pulls[req] = (done, now)

        def run() -> None:
            try:
                self.pull(req, tokens, params)
            except Exception:  # a malformed parameter set: a miss, never a dead thread
                log.exception("kvmesh: PD pull for %s failed", req)
            finally:
                done.set()

        threading.Thread(target=run, name="kvmesh-pd-pull", daemon=True).start()
        return True

    def pull_done(self, req: str) -> bool:
        """Whether the background pull of ``req`` has ended (or none is known)."""
        with self._lock:
            entry = self._pulls.get(req)
            if entry is None:
                return True
            if entry[0].is_set():
                del self._pulls[req]
                return True
            return False

    def confirm(self, host: str, port: int, transfer_id: str) -> bool:
        """Release the producer's pins without pulling (nothing to fetch, or vLLM's own
        prefix cache already holds the prompt). Only for verified addresses."""
        timeout = min(1.0, self.options.pd_fetch_timeout_s)
        return confirm(host, port, transfer_id, timeout_s=timeout, key=self.key)

    def confirm_params(self, params: dict[str, Any]) -> bool:
        tr = self._verified("a confirm", params, None)
        if not isinstance(tr, Transfer):
            return False
        return self.confirm(tr.host, tr.port(self.rank), tr.transfer_id)

    def _fallback(self, req: str, reason: str, arr: np.ndarray, pulled: int, detail: str) -> None:
        # What the lookup that follows will find instead: the shared tier's copy, or nothing
        # (vLLM computes those tokens).
        found = self.engine.lookup(arr)
        outcome = "shared" if found > pulled else "recompute"
        with self._lock:
            self.fallbacks[reason] += 1
            self.outcomes[outcome] += 1
        log.warning(
            "kvmesh: PD pull for %s ended after %d tokens (%s: %s); %s",
            req,
            pulled,
            reason,
            detail,
            "the shared tier has more" if outcome == "shared" else "vLLM recomputes the rest",
        )

    def stats(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = dict(self.counters)
            out["pd_fallbacks_total"] = dict(self.fallbacks)
            out["pd_fallback_outcomes"] = dict(self.outcomes)
        if self.pins is not None:
            out.update(self.pins.stats())
        if self.server is not None:
            out.update(self.server.stats())
            out["pd_port"] = self.server.port
        return out

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        if self.pins is not None:
            self.pins.close()


def _agreeing(keys: list[ChunkKey], theirs: list[str], chunk_size: int) -> int:
    """How many leading chunk keys the producer named alike (namespace and prefix hash;
    the shard part differs between tensor-parallel ranks)."""
    n = 0
    for mine, text in zip(keys, theirs, strict=False):
        try:
            other = ChunkKey.parse(text, chunk_size)
        except ValueError:
            break
        if (other.namespace, other.prefix_hash, other.num_tokens) != (
            mine.namespace,
            mine.prefix_hash,
            mine.num_tokens,
        ):
            break
        n += 1
    return n
