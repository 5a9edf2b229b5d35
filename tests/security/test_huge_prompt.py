"""Finding 6: a huge prompt is refused fast, and the router keeps serving meanwhile.

A hostile client sends 14 MiB prompts (token ids, text, chat) to a real ``kvmesh router``
process whose replica reports ``max_model_len`` 4096 in ``/v1/models`` (as vLLM does),
while another client measures ``/health`` every few milliseconds. Both clients are
processes of their own: sharing the test's interpreter, the probe's samples would wait for
the attacker's GIL, not for the router. Where allowed, the router and the probe run at a
raised CPU priority and the attacker at the lowest: in life the attacker is on another
machine and the router has a core of its own, while the test machine has 2 cores shared with
whatever else runs (the body checker's worker keeps its own, lowered priority).

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
# POSTs each (path, body file) once per round (ROUNDS), IDLE_S apart; prints [path, status,
# error, start, end].
_ATTACK = """
import json, os, sys, time, httpx
os.nice(19)
attacks = json.loads(sys.argv[2])
with httpx.Client(timeout=60) as c:
    for _ in range(int(sys.argv[4])):
        for path, file in attacks:
            raw = open(file, "rb").read()
            time.sleep(float(sys.argv[3]))
            t0 = time.time()
            r = c.post(sys.argv[1] + path, content=raw, headers={"content-type": "application/json"})
            try:
                err = r.json().get("error")
            except ValueError:
                err = r.text[:200]
            print(json.dumps([path, r.status_code, err, t0, time.time()]), flush=True)
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
    # /health is measured all along; the attacks come IDLE_S apart, so that the samples taken
    # while no attack runs measure, under the same load, what this machine costs any request.
    probe = HealthProbe(router.url)
    try:
        plan = json.dumps([(path, str(tmp_path / name)) for name, (path, _, _) in bodies.items()])
        attack = subprocess.run(
            [sys.executable, "-c", _ATTACK, router.url, plan, str(IDLE_S), str(ROUNDS)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    finally:
        samples = probe.stop()
    assert attack.returncode == 0, attack.stderr
    results = [json.loads(line) for line in attack.stdout.splitlines()]
    assert len(results) == ROUNDS * len(bodies)
    for i, (path, status, err, start, end) in enumerate(results):
        assert status == 400, (path, status, err)
        assert err["param"] == field[path] and str(MAX_MODEL_LEN) in err["message"], err
        # The first large body also starts the body checker's worker process.
        assert end - start < (5.0 if i == 0 else 3.0), (path, end - start)
    assert not [r for r in capture.requests if r[0].startswith("/v1/")]  # none reached the replica
    during = [dt for t, dt in samples if any(s <= t <= e for _, _, _, s, e in results)]
    idle = [dt for t, dt in samples if not any(s - 0.05 <= t <= e + 0.05 for _, _, _, s, e in results)]
    assert len(during) > 200 and len(idle) > 100, (len(during), len(idle))
    # 20 ms (the target) over the idle p99: a few ms on a quiet machine; on a shared 2-core
    # one, what other work costs any request at that moment, attack or not.
    got = f"/health p99 {p99(during) * 1e3:.1f} ms during the attacks (idle {p99(idle) * 1e3:.1f} ms)"
    assert p99(during) < LIMIT_S + p99(idle), f"{got}; worst {sorted(during)[-3:]}"
    # A prompt that fits still goes through.
    ok = httpx.post(
        router.url + "/v1/completions", json={"model": "tiny", "prompt": list(range(4000))}, timeout=10
    )
    assert ok.status_code == 200, ok.text
