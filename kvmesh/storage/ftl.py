"""A page-mapped flash-translation-layer simulator (``kvmesh ftl``).

The model: ``n_ru`` reclaim units (RUs) of ``pages_per_block * blocks_per_ru`` pages; the
RU is the erase unit (FDP devices erase and garbage-collect whole RUs; a conventional
drive with ``blocks_per_ru=1`` erases single blocks). Logical pages map to physical pages
through a flat table. Every write stream (1 for a conventional drive, N reclaim-unit
handles for FDP) appends into its own open RU; garbage collection relocates into a
separate GC frontier, so the host streams stay unmixed. GC runs in the foreground when
the free pool drops to ``min_free_rus``: it picks a victim among closed RUs (greedy:
fewest valid pages; cost-benefit: highest ``(1-u) * age / 2u``), copies its valid pages and
erases it. A trim invalidates pages without writing.

Latency model: one FIFO device with ``parallelism`` independent units. A request of ``n``
pages arriving at ``t`` starts when the device is free, costs ``n * t_prog / parallelism``
(writes) or ``n * t_read / parallelism`` (reads) plus whatever GC it triggered (each copy
``t_read + t_prog``, each erase ``t_erase``, same parallelism), and its latency is
``finish - t``. Without arrival times (``arrival < 0``) requests run back to back.

The kernel is one numba-compiled loop over requests (numba ships with vLLM), several
million page writes per second; nothing here loops over pages in Python.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from kvmesh.core.jit import kernel
from kvmesh.errors import ConfigError
from kvmesh.storage.trace import GC_POLICIES, OP_READ, OP_TRIM, OP_WRITE


@dataclass(frozen=True)
class FTLConfig:
    """Geometry, GC policy and timing of the simulated drive."""

    logical_pages: int
    overprovisioning: float = 0.07  # physical = logical * (1 + op)
    pages_per_block: int = 64
    blocks_per_ru: int = 1
    streams: int = 1  # host write streams (FDP reclaim-unit handles)
    gc: str = "greedy"
    min_free_rus: int = 2
    page_bytes: int = 4096
    t_prog_us: float = 200.0
    t_read_us: float = 50.0
    t_erase_us: float = 3000.0
    parallelism: int = 32  # channels x dies working at once

    def __post_init__(self) -> None:
        if self.gc not in GC_POLICIES:
            raise ConfigError(f"ftl gc={self.gc!r} is unknown; valid: {', '.join(GC_POLICIES)}")
        for name in ("logical_pages", "pages_per_block", "blocks_per_ru", "streams", "parallelism"):
            if getattr(self, name) < 1:
                raise ConfigError(f"ftl {name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.overprovisioning < 10:
            raise ConfigError(f"ftl overprovisioning must be in (0, 10), got {self.overprovisioning}")
        if self.min_free_rus < 1:
            raise ConfigError(f"ftl min_free_rus must be >= 1, got {self.min_free_rus}")
        if self.n_ru < self.streams + self.min_free_rus + 2:
            raise ConfigError(
                f"ftl geometry has {self.n_ru} reclaim units, too few for {self.streams} streams; "
                "raise logical_pages or lower pages_per_block/blocks_per_ru"
            )

    @property
    def pages_per_ru(self) -> int:
        return self.pages_per_block * self.blocks_per_ru

    @property
    def n_ru(self) -> int:
        return math.ceil(self.logical_pages * (1 + self.overprovisioning) / self.pages_per_ru)


@dataclass
class FTLResult:
    """What a replay did to the drive."""

    host_pages: int
    gc_copies: int
    erases_per_block: np.ndarray = field(repr=False)
    latency_s: np.ndarray = field(repr=False)  # per request; NaN for trims
    gc_copies_per_request: np.ndarray = field(repr=False)
    seconds: float = 0.0  # wall time of the simulation itself

    @property
    def dlwa(self) -> float:
        return (self.host_pages + self.gc_copies) / self.host_pages if self.host_pages else 1.0

    def summary(self, ops: np.ndarray | None = None) -> dict[str, Any]:
        lat = self.latency_s
        mask = ~np.isnan(lat) if ops is None else ops == OP_WRITE
        w = lat[mask]
        pct = {f"write_p{q}_ms": float(np.percentile(w, q) * 1e3) if w.size else 0.0 for q in (50, 99)}
        return {
            "host_pages": self.host_pages,
            "gc_copies": self.gc_copies,
            "dlwa": self.dlwa,
            "erases_max": int(self.erases_per_block.max()) if self.erases_per_block.size else 0,
            "erases_mean": float(self.erases_per_block.mean()) if self.erases_per_block.size else 0.0,
            **pct,
            "sim_pages_per_s": self.host_pages / self.seconds if self.seconds > 0 else 0.0,
        }


@kernel
def _alloc(free: np.ndarray, nfree: np.ndarray) -> int:
    nfree[0] -= 1
    return int(free[nfree[0]])


@kernel
def _victim(
    state: np.ndarray, valid: np.ndarray, closed_at: np.ndarray, now: float, ppr: int, policy: int
) -> int:
    best = -1
    best_score = -1.0
    for r in range(state.shape[0]):
        if state[r] != 2:
            continue
        v = valid[r]
        if policy == 0:
            score = float(ppr - v)
        else:
            u = v / ppr
            age = now - closed_at[r] + 1.0
            score = 1e300 if v == 0 else (1.0 - u) * age / (2.0 * u)
        if score > best_score:
            best_score = score
            best = r
    return best


@kernel
def _place(
    s: int,
    lpn: int,
    l2p: np.ndarray,
    p2l: np.ndarray,
    valid: np.ndarray,
    state: np.ndarray,
    closed_at: np.ndarray,
    open_ru: np.ndarray,
    wp: np.ndarray,
    free: np.ndarray,
    nfree: np.ndarray,
    ppr: int,
    now: float,
) -> None:
    """Append logical page ``lpn`` to stream ``s``'s open RU (opening one if needed)."""
    if open_ru[s] < 0 or wp[s] == ppr:
        if open_ru[s] >= 0:
            state[open_ru[s]] = 2
            closed_at[open_ru[s]] = now
        r = _alloc(free, nfree)
        state[r] = 1
        open_ru[s] = r
        wp[s] = 0
    p = open_ru[s] * ppr + wp[s]
    wp[s] += 1
    p2l[p] = lpn
    l2p[lpn] = p
    valid[open_ru[s]] += 1


@kernel
def _simulate(
    ops: np.ndarray,
    lpns: np.ndarray,
    npages: np.ndarray,
    streams: np.ndarray,
    arrival: np.ndarray,
    n_logical: int,
    n_ru: int,
    ppr: int,
    n_streams: int,
    policy: int,
    min_free: int,
    t_prog: float,
    t_read: float,
    t_erase: float,
    blocks_per_ru: int,
) -> tuple[int, int, np.ndarray, np.ndarray, np.ndarray, int]:
    l2p = np.full(n_logical, -1, np.int64)
    p2l = np.full(n_ru * ppr, -1, np.int64)
    valid = np.zeros(n_ru, np.int64)
    state = np.zeros(n_ru, np.int8)  # 0 free, 1 open, 2 closed
    closed_at = np.zeros(n_ru, np.float64)
    erases = np.zeros(n_ru, np.int64)
    free = np.arange(n_ru - 1, -1, -1).astype(np.int64)
    nfree = np.array([n_ru], np.int64)
    gc_s = n_streams  # the GC frontier
    open_ru = np.full(n_streams + 1, -1, np.int64)
    wp = np.zeros(n_streams + 1, np.int64)
    lat = np.full(ops.shape[0], np.nan)
    gc_per_req = np.zeros(ops.shape[0], np.int64)
    host = 0
    copies = 0
    dev_free = 0.0
    now = 0.0  # host pages written so far: the clock cost-benefit ages by
    for i in range(ops.shape[0]):
        op = ops[i]
        start_lpn = lpns[i]
        n = npages[i]
        if op == OP_TRIM:
            for lpn in range(start_lpn, start_lpn + n):
                p = l2p[lpn]
                if p >= 0:
                    p2l[p] = -1
                    valid[p // ppr] -= 1
                    l2p[lpn] = -1
            continue
        t0 = arrival[i] if arrival[i] >= 0 else dev_free
        begin = max(t0, dev_free)
        if op == OP_READ:
            dev_free = begin + n * t_read
            lat[i] = dev_free - t0
            continue
        s = streams[i]
        busy = 0.0
        req_copies = 0
        for lpn in range(start_lpn, start_lpn + n):
            p = l2p[lpn]
            if p >= 0:
                p2l[p] = -1
                valid[p // ppr] -= 1
            while nfree[0] <= min_free:
                v = _victim(state, valid, closed_at, now, ppr, policy)
                if v < 0 or valid[v] >= ppr:
                    # Every closed unit is fully valid: copying one frees nothing. The drive
                    # is too full for its streams (open units hold the spare); give up.
                    return host, copies, erases, lat, gc_per_req, i
                base = v * ppr
                for q in range(base, base + ppr):
                    if p2l[q] >= 0:
                        moved = p2l[q]
                        p2l[q] = -1
                        _place(
                            gc_s, moved, l2p, p2l, valid, state, closed_at, open_ru, wp, free, nfree, ppr, now
                        )
                        req_copies += 1
                valid[v] = 0
                state[v] = 0
                erases[v] += 1
                free[nfree[0]] = v
                nfree[0] += 1
                busy += t_erase * blocks_per_ru
            _place(s, lpn, l2p, p2l, valid, state, closed_at, open_ru, wp, free, nfree, ppr, now)
            now += 1.0
        host += n
        copies += req_copies
        gc_per_req[i] = req_copies
        busy += n * t_prog + req_copies * (t_read + t_prog)
        dev_free = begin + busy
        lat[i] = dev_free - t0
    return host, copies, erases, lat, gc_per_req, -1


def simulate(
    cfg: FTLConfig,
    ops: np.ndarray,
    lpns: np.ndarray,
    npages: np.ndarray,
    streams: np.ndarray | None = None,
    arrival_s: np.ndarray | None = None,
) -> FTLResult:
    """Replay requests (one row each: op, first logical page, pages, stream, arrival s)."""
    import time

    n = len(ops)
    ops = np.ascontiguousarray(ops, dtype=np.int8)
    lpns = np.ascontiguousarray(lpns, dtype=np.int64)
    npages = np.ascontiguousarray(npages, dtype=np.int64)
    st = np.zeros(n, np.int64) if streams is None else np.ascontiguousarray(streams, dtype=np.int64)
    arr = np.full(n, -1.0) if arrival_s is None else np.ascontiguousarray(arrival_s, dtype=np.float64)
    if n and (lpns.min() < 0 or int((lpns + npages).max()) > cfg.logical_pages):
        raise ConfigError(
            f"trace addresses pages up to {int((lpns + npages).max())} but the drive has "
            f"{cfg.logical_pages} logical pages; raise logical_pages (device size)"
        )
    if n and (st.min() < 0 or st.max() >= cfg.streams):
        raise ConfigError(f"trace uses stream {int(st.max())} but the drive has {cfg.streams} streams")
    par = cfg.parallelism
    t0 = time.perf_counter()
    host, copies, erases, lat, gcr, stuck = _simulate(
        ops,
        lpns,
        npages,
        st,
        arr,
        cfg.logical_pages,
        cfg.n_ru,
        cfg.pages_per_ru,
        cfg.streams,
        GC_POLICIES[cfg.gc],
        cfg.min_free_rus,
        cfg.t_prog_us * 1e-6 / par,
        cfg.t_read_us * 1e-6 / par,
        cfg.t_erase_us * 1e-6 / par,
        cfg.blocks_per_ru,
    )
    seconds = time.perf_counter() - t0
    if stuck >= 0:
        raise ConfigError(
            f"the simulated drive ran out of reclaimable space at request {stuck}: every closed "
            f"reclaim unit is fully valid ({cfg.streams} streams keep {cfg.streams + 1} units open); "
            "raise overprovisioning or the drive size, or use fewer streams"
        )
    return FTLResult(int(host), int(copies), np.repeat(erases, cfg.blocks_per_ru), lat, gcr, seconds)


def lambert_w0(x: float) -> float:
    """Principal branch of Lambert W on [-1/e, 0] (Halley's iteration)."""
    if x < -1 / math.e - 1e-12:
        raise ValueError(f"lambert_w0 is real only for x >= -1/e, got {x}")
    w = -1.0 + math.sqrt(max(2 * (1 + math.e * x), 0.0)) if x < -0.25 else x
    for _ in range(100):
        ew = math.exp(w)
        f = w * ew - x
        if abs(f) < 1e-15:
            break
        w -= f / (ew * (w + 1) - (w + 2) * f / (2 * w + 2))
    return w


def greedy_wa_closed_form(overprovisioning: float) -> float:
    """Write amplification of greedy (equivalently FIFO, for many pages per block) GC under
    uniform random writes: ``a / (a + W0(-a e^-a))`` with ``a`` = physical/logical
    (Hu et al. 2009; Desnoyers, SYSTOR 2012)."""
    a = 1.0 + overprovisioning
    return a / (a + lambert_w0(-a * math.exp(-a)))


def uniform_random(cfg: FTLConfig, passes: float, seed: int = 0) -> tuple[np.ndarray, ...]:
    """Fill the drive sequentially once, then ``passes`` x logical_pages random page writes."""
    rng = np.random.default_rng(seed)
    n_rand = int(passes * cfg.logical_pages)
    lp = np.concatenate([np.arange(cfg.logical_pages), rng.integers(0, cfg.logical_pages, n_rand)])
    return np.zeros(len(lp), np.int8), lp, np.ones(len(lp), np.int64)


def validate(
    ops_levels: tuple[float, ...] = (0.07, 0.15, 0.28, 0.5), logical_pages: int = 1 << 18
) -> list[dict[str, Any]]:
    """Greedy GC vs the closed form at several over-provisioning levels, and a sequential
    overwrite workload (DLWA must be 1)."""
    rows = []
    for op in ops_levels:
        cfg = FTLConfig(logical_pages=logical_pages, overprovisioning=op, pages_per_block=256)
        ops, lp, npg = uniform_random(cfg, passes=4)
        warm = cfg.logical_pages * 2  # measure after the first two drive-fills (steady state)
        res = simulate(cfg, ops, lp, npg)
        sim = 1 + res.gc_copies_per_request[warm:].sum() / (len(lp) - warm)
        want = greedy_wa_closed_form(op)
        rows.append(
            {
                "workload": "uniform-random",
                "op": op,
                "dlwa": float(sim),
                "closed_form": want,
                "error": float(sim / want - 1),
                "sim_pages_per_s": res.host_pages / res.seconds,
            }
        )
    cfg = FTLConfig(logical_pages=logical_pages, overprovisioning=0.07, pages_per_block=256)
    lp = np.tile(np.arange(cfg.logical_pages), 4)
    res = simulate(cfg, np.zeros(len(lp), np.int8), lp, np.ones(len(lp), np.int64))
    rows.append(
        {
            "workload": "sequential",
            "op": 0.07,
            "dlwa": res.dlwa,
            "closed_form": 1.0,
            "error": res.dlwa - 1.0,
            "sim_pages_per_s": res.host_pages / res.seconds,
        }
    )
    return rows


def config_dict(cfg: FTLConfig) -> dict[str, Any]:
    out = asdict(cfg)
    out["n_ru"], out["pages_per_ru"] = cfg.n_ru, cfg.pages_per_ru
    return out
