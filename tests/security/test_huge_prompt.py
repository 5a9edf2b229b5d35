"""Finding 6: a huge prompt is refused fast, and the router keeps serving meanwhile.

A hostile client sends 14 MiB prompts (token ids, text, chat) to a real ``kvmesh router``
process whose replica reports ``max_model_len`` 4096 in ``/v1/models`` (as vLLM does),
while another client measures ``/health`` every few milliseconds. Both clients are
processes of their own: sharing the test's interpreter, the probe's samples would wait for
the attacker's GIL, not for the router. Where allowed, the router and the probe run at a
raised CPU priority and the attacker at the lowest: in life the attacker is on another
machine and the router has a core of its own, while the test machine has 2 cores shared with
whatever else runs (the body checker's worker keeps its own, lowered priority).

The bound is the router's own cost: each attack is paired with a control, the same body sent
to a sink process that receives and decodes it at the body worker's lowered priority, and
``/health``'s p99 during the attacks must stay within 20 ms of its p99 during the controls.
The controls put the same bytes through the same machine without the router, so what the
machine itself costs any request then (a shared VM's 30-70 ms hiccups under load: CI failed
once on 34 ms against an idle 2.7 ms) is not counted against the router, while a body decoded
on the router's loop (the bug, ~100 ms to seconds a body) still fails it.

Before: the token-id prompt was decoded, checked, converted and hashed on the router's
event loop (4.2 s) and forwarded to the replica; ``/health`` stalled for 1.9 s.
"""

from __future__ import annotations

import contextlib
import json
import random
import statistics
import subprocess
import sys
from pathlib import Path

import httpx
import psutil

from kvmesh.router.testing import FakeVLLM
from tests.security.conftest import StartRouter

MAX_MODEL_LEN = 4096
LIMIT_S = 0.020  # /health p99 while the attack runs (issue #23)
IDLE_S = 0.25  # between two attacks
# Rounds of the three attacks: ~300 probe samples fall inside them, so that the p99 is not
# set by one stray 20-50 ms hiccup of a shared 2-core machine (with two rounds, ~130 samples,
# the p99 was the second-worst sample, and failed about once in ten runs on a quiet machine,
# each time on one sample). A stall that comes with each attack, the bug this guards
# against, still sets it.
ROUNDS = 6
MIB = 1 << 20

# GETs /health back to back on one keep-alive connection until stdin closes, then prints
# [start (wall clock), latency] of every request as JSON.
_PROBE = """
import contextlib, json, os, sys, threading, time, httpx
with contextlib.suppress(PermissionError):
    os.nice(-10)
done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
out = []
with httpx.Client(timeout=10) as c:
    print("ready", flush=True)
    while not done.is_set():
        t0, p0 = time.time(), time.perf_counter()
        assert c.get(sys.argv[1] + "/health").status_code == 200
        out.append((t0, time.perf_counter() - p0))
        time.sleep(0.002)
print(json.dumps(out), flush=True)
"""
# POSTs each (kind, url, body file) once per round (ROUNDS), IDLE_S apart; prints [kind, path,
# status, error, start, end].
_ATTACK = """
import json, os, sys, time, httpx
os.nice(19)
attacks = json.loads(sys.argv[1])
with httpx.Client(timeout=60) as c:
    for _ in range(int(sys.argv[3])):
        for kind, url, file in attacks:
            raw = open(file, "rb").read()
            time.sleep(float(sys.argv[2]))
            t0 = time.time()
            r = c.post(url, content=raw, headers={"content-type": "application/json"})
            try:
                err = r.json().get("error")
            except ValueError:
                err = r.text[:200]
            print(json.dumps([kind, url, r.status_code, err, t0, time.time()]), flush=True)
"""
# The control: receives a body and decodes it, at the body worker's priority; answers 400.
_SINK = """
import os, socket, msgspec
from aiohttp import web
os.nice(10)
async def sink(request):
    try:
        msgspec.json.decode(await request.read())
    except msgspec.DecodeError:
        pass
    return web.json_response({"error": {"message": "control"}}, status=400)
app = web.Application(client_max_size=64 << 20)
app.router.add_post("/{tail:.*}", sink)
sock = socket.create_server(("127.0.0.1", 0))
print(sock.getsockname()[1], flush=True)
web.run_app(app, sock=sock, print=None)
"""


class HealthProbe:
    def __init__(self, url: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _PROBE, url], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "ready"

    def stop(self) -> list[tuple[float, float]]:
        out, _ = self.proc.communicate(timeout=30)
        return [(float(t), float(dt)) for t, dt in json.loads(out)]


def p99(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=100)[98]


def token_prompt_body(size: int) -> bytes:
    rng = random.Random(0)
    ids = [rng.randrange(100_000, 150_000) for _ in range(size // 8)]  # "123456, " is 8 bytes
    return json.dumps({"model": "tiny", "prompt": ids, "max_tokens": 1}).encode()


def test_huge_prompts_are_refused_fast_while_health_stays_fast(
    start_router: StartRouter, capture: FakeVLLM, tmp_path: Path
) -> None:
    capture.max_model_len = MAX_MODEL_LEN
    router = start_router()
    assert router.proc is not None
    with contextlib.suppress(psutil.AccessDenied):
        psutil.Process(router.proc.pid).nice(-10)  # the router has its core, as in production
    text = "lorem ipsum " * (14 * MIB // 12)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": text}]}
    bodies = {
        "tokens": ("/v1/completions", token_prompt_body(14 * MIB), "prompt"),
        "text": ("/v1/completions", json.dumps({"model": "tiny", "prompt": text}).encode(), "prompt"),
        "chat": ("/v1/chat/completions", json.dumps(chat).encode(), "messages"),
    }
    for name, (_, raw, _) in bodies.items():
        (tmp_path / name).write_bytes(raw)
    field = {path: f for path, _, f in bodies.values()}
    sink = subprocess.Popen([sys.executable, "-c", _SINK], stdout=subprocess.PIPE, text=True)
    try:
        assert sink.stdout is not None
        control_url = f"http://127.0.0.1:{int(sink.stdout.readline())}"
        # /health is measured all along; the attacks come IDLE_S apart, each followed by its
        # control, so that both see the same machine at nearly the same moment.
        probe = HealthProbe(router.url)
        try:
            plan = json.dumps([
                (kind, url + path, str(tmp_path / name))
                for name, (path, _, _) in bodies.items()
                for kind, url in (("attack", router.url), ("control", control_url))
            ])  # fmt: skip
            attack = subprocess.run(
                [sys.executable, "-c", _ATTACK, plan, str(IDLE_S), str(ROUNDS)],
                capture_output=True, text=True, timeout=180,
            )  # fmt: skip
        finally:
            samples = probe.stop()
    finally:
        sink.kill()
        sink.wait()
    assert attack.returncode == 0, attack.stderr
    results = [json.loads(line) for line in attack.stdout.splitlines()]
    assert len(results) == 2 * ROUNDS * len(bodies)
    attacks = [r for r in results if r[0] == "attack"]
    for i, (_, url, status, err, start, end) in enumerate(attacks):
        path = url.removeprefix(router.url)
        assert status == 400, (path, status, err)
        assert err["param"] == field[path] and str(MAX_MODEL_LEN) in err["message"], err
        # The first large body also starts the body checker's worker process.
        assert end - start < (5.0 if i == 0 else 3.0), (path, end - start)
    assert all(r[2] == 400 for r in results)
    assert not [r for r in capture.requests if r[0].startswith("/v1/")]  # none reached the replica

    def inside(*kinds: str, margin: float = 0.0) -> list[tuple[float, float]]:
        spans = [(s - margin, e + margin) for k, _, _, _, s, e in results if k in kinds]
        return [(t, dt) for t, dt in samples if any(s <= t <= e for s, e in spans)]

    during = [dt for _, dt in inside("attack")]
    control = [dt for _, dt in inside("control")]
    busy = set(inside("attack", "control", margin=0.05))
    idle = [dt for t, dt in samples if (t, dt) not in busy]
    got = (
        f"/health p99 {p99(during) * 1e3:.1f} ms during the attacks, {p99(control) * 1e3:.1f} ms"
        f" during the controls (idle {p99(idle) * 1e3:.1f} ms)"
    )
    assert p99(during) < LIMIT_S + p99(control), f"{got}; worst {sorted(during)[-3:]}"
    # Few answers during the attacks: the probe waited on a blocked loop.
    assert len(during) > 200 and len(control) > 100, (len(during), len(control))
    # A prompt that fits still goes through.
    ok = httpx.post(
        router.url + "/v1/completions", json={"model": "tiny", "prompt": list(range(4000))}, timeout=10
    )
    assert ok.status_code == 200, ok.text
