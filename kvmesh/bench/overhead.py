"""Measure the router's added latency: the same request sent directly and through the router.

A fake vLLM (:mod:`kvmesh.router.testing`) and the router each run in their own process, so
the client, the router and the upstream do not share an interpreter lock. Requests
alternate direct / routed over persistent connections and the report gives the median of
each and of their difference, for three prompt shapes of ``--tokens`` tokens:

* ``completion-unique``: a new prompt every time (nothing cached: the full tokenize cost);
* ``completion-repeat``: the same prompt every time (the exact-repeat cache);
* ``chat-shared-system``: a long system message shared by all, a new user turn each time
  (the per-piece cache: only the new turn is tokenized).

``python -m kvmesh.bench.overhead --model DIR`` (DIR: any model directory with a
tokenizer.json; without one a small test tokenizer is built).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvmesh.bench.stats import percentile
from kvmesh.errors import ProcessError
from kvmesh.harness.ports import free_port
from kvmesh.harness.processes import Service, get_json
from kvmesh.harness.router import RouterProcess


class _FakeVLLMProcess(Service):
    """:class:`kvmesh.router.testing.FakeVLLM` as a process of its own."""

    name = "fake vLLM"

    def __init__(self) -> None:
        self.port = free_port()
        args = [sys.executable, "-m", "kvmesh.router.testing", "--port", str(self.port)]
        super().__init__(args, {**os.environ, "PYTHONUNBUFFERED": "1"}, None)

    def ready(self) -> bool:
        return get_json(f"http://127.0.0.1:{self.port}/health", 1.0)[0] == 200


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (Linux): load-independent, unlike wall time."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextmanager
def _processes(model_dir: str) -> Iterator[tuple[int, int, int]]:
    """The fake upstream and the router over it; yields their ports and the router's pid."""
    from kvmesh.router import ReplicaConfig, RouterConfig

    with _FakeVLLMProcess() as fake:
        fake.start()
        replica = ReplicaConfig(url=f"http://127.0.0.1:{fake.port}", name="up")
        with RouterProcess(RouterConfig(model=model_dir, replicas=(replica,), port=0)) as router:
            router.start()
            assert router.proc is not None
            yield fake.port, router.port, router.proc.pid


def _words(rng: random.Random, n: int) -> str:
    from kvmesh.router.testing import _WORDS

    return " ".join(rng.choice(_WORDS) for _ in range(n))


def _shapes(tokenize: Callable[[str], int], tokens: int, seed: int) -> dict[str, Callable[[int], bytes]]:
    rng = random.Random(seed)
    # Calibrate words per token on this tokenizer, then size the texts to ~tokens.
    sample = _words(rng, 2000)
    per_word = tokenize(sample) / 2000
    n_words = int(tokens / per_word)
    repeat = _words(rng, n_words)
    system = _words(rng, n_words * 3 // 4)

    def unique(i: int) -> bytes:
        text = f"{i} " + _words(random.Random(seed * 1_000_003 + i), n_words)
        return json.dumps({"model": "tiny", "prompt": text, "max_tokens": 1}).encode()

    def repeated(i: int) -> bytes:
        return json.dumps({"model": "tiny", "prompt": repeat, "max_tokens": 1}).encode()

    def chat(i: int) -> bytes:
        user = f"{i} " + _words(random.Random(seed * 7 + i), n_words // 4)
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        return json.dumps({"model": "tiny", "messages": msgs, "max_tokens": 1}).encode()

    return {"completion-unique": unique, "completion-repeat": repeated, "chat-shared-system": chat}


def _post(conn: http.client.HTTPConnection, path: str, body: bytes) -> float:
    t = time.perf_counter()
    conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    resp.read()
    if resp.status != 200:
        raise ProcessError(f"POST {path} answered {resp.status}")
    return time.perf_counter() - t


def measure(
    model_dir: str | None = None, tokens: int = 2000, n: int = 200, warmup: int = 20
) -> dict[str, Any]:
    """Median direct / routed / added milliseconds per prompt shape (see the module docstring)."""
    from tokenizers import Tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        if model_dir is None:
            from kvmesh.router.testing import write_test_tokenizer

            model_dir = str(write_test_tokenizer(Path(tmp) / "tok"))
        tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
        shapes = _shapes(lambda s: len(tok.encode(s).ids), tokens, seed=1)
        out: dict[str, Any] = {"tokens": tokens, "n": n, "model": model_dir, "shapes": {}}
        with _processes(model_dir) as (up, rt, router_pid):
            direct = http.client.HTTPConnection("127.0.0.1", up)
            routed = http.client.HTTPConnection("127.0.0.1", rt)
            for name, make in shapes.items():
                path = "/v1/chat/completions" if name.startswith("chat") else "/v1/completions"
                d: list[float] = []
                r: list[float] = []
                cpu = 0.0
                for i in range(warmup + n):
                    body = make(i + (0 if name == "completion-repeat" else 10_000 * len(out["shapes"])))
                    td = _post(direct, path, body)
                    c0 = _cpu_s(router_pid)
                    tr = _post(routed, path, body)
                    if i >= warmup:
                        cpu += _cpu_s(router_pid) - c0
                        d.append(td)
                        r.append(tr)
                added = [b - a for a, b in zip(d, r, strict=True)]
                out["shapes"][name] = {
                    "direct_ms": round(statistics.median(d) * 1e3, 3),
                    "routed_ms": round(statistics.median(r) * 1e3, 3),
                    "added_ms_median": round(statistics.median(added) * 1e3, 3),
                    "added_ms_p90": round(percentile(added, 90) * 1e3, 3),
                    "router_cpu_ms_per_request": round(cpu / n * 1e3, 3),
                    "prompt_tokens": len(tok.encode(_prompt_text(body)).ids),
                }
        return out


def _prompt_text(body: bytes) -> str:
    data = json.loads(body)
    return str(data.get("prompt") or " ".join(m["content"] for m in data["messages"]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="model directory with tokenizer.json (default: a small test tokenizer)")
    p.add_argument("--tokens", type=int, default=2000)
    p.add_argument("-n", type=int, default=200)
    p.add_argument("--json", help="write the result here too")
    args = p.parse_args()
    result = measure(args.model, args.tokens, args.n)
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
