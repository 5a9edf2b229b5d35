"""Scorers: each rates every candidate replica for one request with a number in [0, 1].

Pure code (no I/O, no clock, no server), shared by the router and the trace simulator. A
scorer sees a :class:`RoutingRequest` (token ids, session, a stable key) and the candidates
as a :class:`ReplicaTable` (their states as arrays), and scores them all at once into one
array (``score_array``); :mod:`kvmesh.routing.picker` sums the weighted arrays. The router
builds the table from its :class:`ReplicaState` snapshots per request; the simulator keeps
one table and updates it in place, so at 1,000 replicas no step is a Python loop per
replica. ``score`` (a dict per replica) is the same code, for callers that want names.

Modelled on llm-d's scorers (prefix, queue, kv-cache utilisation, session affinity), with
one difference on purpose: the queue score is relative to the busiest replica and damped at
low load, so one request in flight does not outweigh a long prefix hit, while a queue much
longer than the others' still loses (the picker also filters grossly overloaded replicas).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import xxhash

from kvmesh.index.media import COLUMNS
from kvmesh.routing.sessions import SessionTable
from kvmesh.routing.table import ReplicaTable

DEFAULT_MEDIUM_WEIGHTS: Mapping[str, float] = {
    "GPU": 1.0,
    "CPU": 0.8,
    "DISK": 0.5,
    "REMOTE": 0.3,
    "OTHER": 0.3,
}


class MatchLike(Protocol):
    """One replica's prefix match: contiguous ``(start, end, medium)`` token ranges from 0."""

    @property
    def ranges(self) -> Sequence[tuple[int, int, Any]]: ...


class PrefixSource(Protocol):
    """Where prefixes live (``kvmesh.index.BlockIndex`` is one); replicas with no match are absent."""

    def match(self, tokens: Any, *, lora_name: str | None = None) -> Mapping[str, MatchLike]: ...


@dataclass(slots=True)
class RoutingRequest:
    """What the scorers know about one request.

    ``matches`` is filled by the prefix scorer (or the caller) once per request, so the index
    is asked once and the router can report hit tokens per medium without asking again.
    ``prompt``, when set, is what the prefix scorer hands the prefix source instead of
    ``tokens``: the router puts the index's :class:`kvmesh.index.PromptKeys` there, so the
    prompt's block keys are hashed once for the match and the speculative entry together.
    """

    tokens: Any  # 1-D uint32 numpy array (or a sequence of ints)
    session_id: str | None = None
    key: int = 0  # stable per prompt; orders ties, so equal prompts break ties alike
    lora_name: str | None = None
    matches: Mapping[str, MatchLike] | None = None
    prompt: Any = None  # the tokens as the prefix source wants them (e.g. PromptKeys), if not tokens
    # (table, matches, tokens per medium per candidate): the prefix and prefill scorers share it
    aligned: tuple[Any, Any, np.ndarray | None] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


@dataclass(slots=True)
class ReplicaState:
    """A replica as the scorers see it; the pool keeps one live and hands out copies."""

    name: str
    waiting: float = 0.0  # vllm:num_requests_waiting (scraped)
    running: float = 0.0  # vllm:num_requests_running (scraped)
    in_flight: int = 0  # this router's requests not yet finished (live)
    # queued prompt work: this router's requests before their first byte (live), plus
    # external_prefill, the other routers' as the replica's waiting gauge shows it (scraped)
    prefill_tokens: float = 0.0
    pending: int = 0  # this router's requests not yet at their first byte (live)
    external_prefill: float = 0.0  # the part of prefill_tokens from the gauges (see Pool.scraped)
    kv_usage: float | None = None  # vllm:kv_cache_usage_perc in [0, 1]; None before a scrape
    healthy: bool = True
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def load(self) -> float:
        # Scrapes lag; our own in-flight count does not, and it matters most in a burst.
        scraped = self.waiting + self.running
        own = float(self.in_flight)
        return scraped if scraped >= own else own  # not max(): this runs per replica per scorer


class Scorer(Protocol):
    """Rates candidates; the picker calls ``score_array`` when a scorer has one, else ``score``."""

    name: str

    def score(self, request: RoutingRequest, replicas: Sequence[ReplicaState]) -> dict[str, float]: ...


_MEDIA = ("REMOTE", "DISK", "CPU", "GPU")  # kvmesh.index.Medium by value: columns 0-3
_MEDIUM_COLUMN = {name: i for i, name in enumerate(_MEDIA)}
_GPU = 3
_OTHER = len(_MEDIA)  # named media of another prefix source: the first named column


def medium_tokens(request: RoutingRequest, table: ReplicaTable) -> np.ndarray | None:
    """Per candidate, its matched prompt tokens per medium (``(len(table), 8)``: columns
    REMOTE, DISK, CPU, GPU by :class:`kvmesh.index.Medium` value, then the media the index
    keeps by name, see :func:`medium_columns`), or None without matches. Computed once per
    request and table, from the index's arrays (:class:`kvmesh.index.matches.ReplicaMatches`)
    or from any mapping of matches (media without an alias all in column 4)."""
    m = request.matches
    cached = request.aligned
    if cached is not None and cached[0] is table and cached[1] is m:
        return cached[2]
    out: np.ndarray | None = None
    if m:
        out = np.zeros((len(table), COLUMNS))
        arrays = getattr(m, "medium_tokens", None)
        if arrays is not None:
            rid_names, tokens = arrays()
            rows = min(len(tokens), len(rid_names))
            pos = table.align(rid_names)
            if pos is None:  # the index's ids are the table's positions (the simulator)
                out[:rows, : tokens.shape[1]] = tokens[:rows]
            else:
                pos = pos[:rows]
                keep = pos >= 0
                out[pos[keep], : tokens.shape[1]] = tokens[:rows][keep]
        else:  # another prefix source: its ranges, one match at a time
            for name, match in m.items():
                i = table.position(name)
                if i is not None:
                    for start, end, med in match.ranges:
                        col = _MEDIUM_COLUMN.get(str(getattr(med, "name", med)).upper(), _OTHER)
                        out[i, col] += end - start
    request.aligned = (table, m, out)
    return out


_UNNAMED = ("REMOTE", "DISK", "CPU", "GPU", "OTHER", "", "", "")


def medium_columns(request: RoutingRequest) -> tuple[str, ...]:
    """The medium name of each column of :func:`medium_tokens` ("": none yet)."""
    media: Callable[[], tuple[str, ...]] | None = getattr(request.matches, "media", None)
    return media() if media is not None else _UNNAMED


def as_table(replicas: Sequence[ReplicaState] | ReplicaTable) -> ReplicaTable:
    return replicas if isinstance(replicas, ReplicaTable) else ReplicaTable.of(replicas)


class ArrayScorer:
    """A scorer whose one implementation is ``score_array``; ``score`` names its entries."""

    name: str

    def score_array(self, request: RoutingRequest, table: ReplicaTable) -> np.ndarray:
        raise NotImplementedError

    def score(self, request: RoutingRequest, replicas: Sequence[ReplicaState]) -> dict[str, float]:
        table = as_table(replicas)
        return dict(zip(table.names, self.score_array(request, table).tolist(), strict=True))


def prompt_key(tokens: Any, head: int = 256) -> int:
    """Stable 64-bit key of a prompt's first ``head`` tokens (not Python's ``hash()``)."""
    arr = tokens[:head]
    data = arr.tobytes() if hasattr(arr, "tobytes") else b"".join(int(t).to_bytes(4, "little") for t in arr)
    return xxhash.xxh3_64_intdigest(data)


class PrefixScorer(ArrayScorer):
    """Matched prompt tokens / prompt tokens, each token weighted by the medium holding it."""

    name = "prefix"

    def __init__(self, source: PrefixSource, medium_weights: Mapping[str, float] | None = None) -> None:
        self.source = source
        self._weights = {k.upper(): float(v) for k, v in (medium_weights or DEFAULT_MEDIUM_WEIGHTS).items()}
        # a medium without a weight of its own (one the index keeps by name): OTHER's, else nothing
        self._other = self._weights.get("OTHER", 0.0)
        self._by_medium: dict[Any, float] = {}
        self._columns: tuple[tuple[str, ...], np.ndarray] | None = None  # weights per column layout

    def medium_weight(self, medium: Any) -> float:
        w = self._by_medium.get(medium)
        if w is None:
            # Accept both kvmesh.index.Medium members and plain strings.
            name = str(getattr(medium, "name", medium)).upper()
            w = self._by_medium[medium] = self._weights.get(name, self._other)
        return w

    def column_weights(self, columns: tuple[str, ...]) -> np.ndarray:
        """The weight of each :func:`medium_tokens` column (cached while the layout stays)."""
        got = self._columns
        if got is None or got[0] is not columns:
            w = np.array([self._weights.get(c.upper(), self._other) if c else 0.0 for c in columns])
            got = self._columns = (columns, w)
        return got[1]

    def score_array(self, request: RoutingRequest, table: ReplicaTable) -> np.ndarray:
        n = request.num_tokens
        if request.matches is None:
            query = request.tokens if request.prompt is None else request.prompt
            request.matches = self.source.match(query, lora_name=request.lora_name) if n else {}
        tokens = medium_tokens(request, table) if n else None
        if tokens is None:
            return np.zeros(len(table))
        hit: np.ndarray = np.minimum(tokens @ self.column_weights(medium_columns(request)) / n, 1.0)
        return hit


def prefill_cost(request: RoutingRequest, replica: str, load_cost: float) -> float:
    """The prompt tokens ``replica`` must compute for ``request``, in recompute-token units:
    a block in its GPU cache is free, one in a lower or shared tier costs ``load_cost`` (a
    load, not a recompute), anything else costs 1. Needs ``request.matches`` (else: all).
    :meth:`PrefillScorer.score_array` computes the same for every candidate at once."""
    n = float(request.num_tokens)
    m = request.matches.get(replica) if request.matches else None
    if m is None:
        return n
    for start, end, medium in m.ranges:
        gpu = str(getattr(medium, "name", medium)).upper() == "GPU"
        n -= (end - start) * (1.0 if gpu else 1.0 - load_cost)
    return max(0.0, n)


class PrefillScorer(ArrayScorer):
    """Less prefill work ahead of this request's first token scores higher.

    A replica's estimate is the prompt tokens still to compute for the requests this router
    already sent it (``ReplicaState.prefill_tokens``, cleared at each one's first byte) plus
    this request's own :func:`prefill_cost` there; the score is ``(min + s) / (estimate + s)``
    over the candidates. Request counts treat a 2,000-token miss and a 50-token follow-up
    alike; this term keeps a follow-up from queueing behind someone else's long prefill when
    another replica can load the prefix, and spreads misses by the work they bring.
    """

    name = "prefill"

    def __init__(self, load_cost: float = 0.1, smoothing_tokens: float = 256.0) -> None:
        if not 0.0 <= load_cost <= 1.0:
            raise ValueError(f"load_cost must be in [0, 1], got {load_cost}")
        if smoothing_tokens <= 0:
            raise ValueError(f"smoothing_tokens must be positive, got {smoothing_tokens}")
        self.load_cost = load_cost
        self.smoothing = smoothing_tokens

    def score_array(self, request: RoutingRequest, table: ReplicaTable) -> np.ndarray:
        if not len(table):
            return np.zeros(0)
        cost = np.full(len(table), float(request.num_tokens))
        tokens = medium_tokens(request, table)
        if tokens is not None:
            # prefill_cost for every candidate: a GPU token is free, any other matched one a load
            gpu = tokens[:, _GPU]
            cost = np.maximum(0.0, cost - gpu - (tokens.sum(axis=1) - gpu) * (1.0 - self.load_cost))
        est = table.prefill_tokens + cost
        score: np.ndarray = (est.min() + self.smoothing) / (est + self.smoothing)
        return score


class QueueScorer(ArrayScorer):
    """Less load scores higher: ``1 - load / (max load + smoothing)``.

    Relative to the busiest candidate, so it means the same at 2 and at 200 requests; the
    smoothing keeps a 0-vs-1 difference small next to a prefix hit.
    """

    name = "queue"

    def __init__(self, smoothing: float = 4.0) -> None:
        if smoothing <= 0:
            raise ValueError(f"smoothing must be positive, got {smoothing}")
        self.smoothing = smoothing

    def score_array(self, request: RoutingRequest, table: ReplicaTable) -> np.ndarray:
        if not len(table):
            return np.zeros(0)
        loads = table.load
        score: np.ndarray = 1.0 - loads / (loads.max() + self.smoothing)
        return score


class KVUtilScorer(ArrayScorer):
    """Free KV cache scores higher: ``1 - kv_cache_usage``; unknown usage counts as half full."""

    name = "kv_util"

    def score_array(self, request: RoutingRequest, table: ReplicaTable) -> np.ndarray:
        usage = table.kv_usage
        return np.where(np.isnan(usage), 0.5, np.clip(1.0 - usage, 0.0, 1.0))


class SessionScorer(ArrayScorer):
    """1 for the replica that served this request's session last, 0 for the others."""

    name = "session"

    def __init__(self, table: SessionTable) -> None:
        self.table = table

    def score_array(self, request: RoutingRequest, table: ReplicaTable) -> np.ndarray:
        out = np.zeros(len(table))
        i = table.position(self.table.get(request.session_id) if request.session_id else None)
        if i is not None:
            out[i] = 1.0
        return out


class RoundRobinScorer(ArrayScorer):
    """1 for the next replica in turn (over the candidates given), 0 for the others."""

    name = "round_robin"

    def __init__(self) -> None:
        self._n = 0

    def score_array(self, request: RoutingRequest, table: ReplicaTable) -> np.ndarray:
        out = np.zeros(len(table))
        if len(table):
            out[self._n % len(table)] = 1.0
            self._n += 1
        return out


class RandomScorer(ArrayScorer):
    """A uniform random number per replica; seeded, so a simulation replays exactly."""

    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def score_array(self, request: RoutingRequest, table: ReplicaTable) -> np.ndarray:
        draw = self._rng.random
        return np.array([draw() for _ in range(len(table))], dtype=float)
