"""One setup of ``kvmesh bench ttft`` in a vLLM process of its own, serving the parent
(:mod:`kvmesh.bench.ttft.bench`), which keeps every setup's worker up at once and interleaves them.

    python -m kvmesh.bench.ttft.worker SPEC.json      # then JSON commands on stdin

SPEC is a :class:`kvmesh.bench.ttft.spec.SetupSpec` as JSON. Once vLLM is up the worker
answers ``{"ready": true, "engine_start_s"}``, then one line per command:
``{"op": "cycle", "prompt_tokens": N, "trial": K}`` runs one cycle on the prompt
``make_prompt(N, K)``: cold ``max_tokens=1`` request (the connector stores), settle, kvmesh
write-behind drained, ``reset_prefix_cache()``, kvmesh's cpu tier or LMCache's L1 cleared
(setups that load from below), page cache dropped, the same request timed again; it answers
the times, the tokens vLLM reports cached (all from the connector, after the reset) and the
logprob check. ``{"op": "stats"}`` answers the connector's stats; ``{"op": "quit"}`` or EOF
ends. Answers are stdout lines starting with :data:`PREFIX`; an error answers ``{"error"}``.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback
import urllib.request
from pathlib import Path
from typing import Any

from kvmesh.bench.ttft.spec import FAIR_ENV, logprob_diff, make_prompt
from kvmesh.errors import ProcessError
from kvmesh.harness.connector import KVMESH_MODULE
from kvmesh.harness.services import drop_page_cache

PREFIX = "[ttft-json] "


def top5(output: Any) -> list[dict[int, float]]:
    return [{int(t): float(lp.logprob) for t, lp in step.items()} for step in output.outputs[0].logprobs]


def clear_lmcache_l1(url: str) -> None:
    """Empty an ``lmcache server``'s L1 (``POST /cache/clear``, as ``lmcache kvcache clear``
    does), so the timed reload comes from its L2."""
    req = urllib.request.Request(
        url, data=json.dumps({"tier": "l1"}).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        if resp.status != 200:
            raise ProcessError(f"lmcache server answered {resp.status} to POST {url}")


def serve(spec: dict[str, Any], out: dict[str, Any]) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    setup = spec["setup"]
    kvmesh = spec["kv_connector_module_path"] == KVMESH_MODULE
    engine_id = f"kvmesh-ttft-{setup}-{os.getpid()}"
    kv_cfg = None
    if spec["kv_connector"]:
        kv_cfg = KVTransferConfig(
            kv_connector=spec["kv_connector"],
            kv_connector_module_path=spec["kv_connector_module_path"],
            kv_role="kv_both",
            engine_id=engine_id,
            kv_connector_extra_config=spec["kv_connector_extra_config"],
            **spec["kv_transfer_args"],
        )
    t0 = time.perf_counter()
    llm = LLM(model=spec["model_dir"], kv_transfer_config=kv_cfg, **spec["llm_args"])
    out["engine_start_s"] = round(time.perf_counter() - t0, 1)
    print(f"[ttft] {setup}: vLLM up in {out['engine_start_s']} s", flush=True)
    vocab = int(json.loads(Path(spec["model_dir"], "config.json").read_text())["vocab_size"])
    sp = SamplingParams(max_tokens=1, logprobs=5, temperature=0.0)
    client = None
    if kvmesh:
        # The connector's own control socket in vLLM's worker process (stats, clear, ...).
        from kvmesh.integrations.vllm.rpc import RpcClient, socket_path

        sock = socket_path(engine_id, 0, 0, spec["kv_connector_extra_config"].get("socket_dir"))
        client = RpcClient(sock, timeout_s=60)

    def rpc(op: str, **args: Any) -> Any:
        got = client.call(op, **args) if client is not None else None
        if got is None:
            raise ProcessError(f"kvmesh connector rpc {op!r} failed (socket of engine {engine_id}; see log)")
        return got

    def timed(ids: list[int]) -> tuple[float, Any]:
        t = time.perf_counter()
        o = llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)[0]
        return time.perf_counter() - t, o

    def reset() -> int:
        # A connector still sending may hold blocks for a moment; reset fails until it is done.
        for attempt in range(100):
            if llm.reset_prefix_cache():
                return attempt
            time.sleep(0.05)
        raise ProcessError("reset_prefix_cache() still failing after 5 s (blocks held by requests)")

    def cycle(ids: list[int]) -> dict[str, Any]:
        cold_s, cold = timed(ids)
        time.sleep(spec["settle_s"] + spec["extra_settle_s"])
        if spec["kvmesh_wait_writes"] and not rpc("wait_for_writes", timeout=60.0):
            raise ProcessError("kvmesh writes did not land within 60 s")
        retries = reset()
        cleared = rpc("clear", tier="cpu") if spec["kvmesh_clear_cpu"] else None
        if spec["lmcache_clear_url"]:
            clear_lmcache_l1(spec["lmcache_clear_url"])
        dropped = drop_page_cache() if spec["drop_page_cache"] else False
        reload_s, again = timed(ids)
        diff, mismatches = logprob_diff(top5(cold), top5(again))
        return {
            "cold_s": cold_s,
            "reload_s": reload_s,
            # after reset_prefix_cache vLLM's own cache is empty: these came from the connector
            "cached_tokens": int(again.num_cached_tokens or 0),
            "diff": diff,
            "mismatches": mismatches,
            "dropped": dropped,
            "retries": retries,
            "cleared": cleared,
        }

    out["reset_retries"] = 0
    reply({"ready": True, "engine_start_s": out["engine_start_s"]})
    for line in sys.stdin:  # one command a line, from the parent; EOF or "quit" ends
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        if cmd["op"] == "stats":
            reply({"kvmesh_stats": rpc("stats") if kvmesh else None, "reset_retries": out["reset_retries"]})
            continue
        n, trial = int(cmd["prompt_tokens"]), cmd["trial"]
        try:
            c = cycle(make_prompt(n, trial, vocab, spec["seed"]))
        except Exception as exc:  # one failed cycle is a result; the next may work
            traceback.print_exc()
            reply({"error": f"{type(exc).__name__}: {exc}"})
            continue
        out["reset_retries"] += c.pop("retries")
        cleared = c.pop("cleared")
        c["cpu_chunks_cleared"] = None if cleared is None else cleared.get("cpu")
        reply(c)
    if client is not None:
        client.close()
    with contextlib.suppress(Exception):  # exit promptly; the parent reaps what is left
        llm.llm_engine.engine_core.shutdown()


def reply(obj: dict[str, Any]) -> None:
    """One protocol line on stdout (vLLM's own logging shares the stream; the parent keeps
    only the lines with this prefix), in one write: ``print`` writes the text and then the
    newline, and vLLM's worker process, writing to the same pipe, once put a log line of
    its own between the two (the answer lost, the setup dropped from the run). A write of
    up to ``PIPE_BUF`` bytes to a pipe is never interleaved."""
    sys.stdout.flush()  # what is buffered goes first
    data = memoryview((PREFIX + json.dumps(obj) + "\n").encode())
    while data:
        data = data[os.write(sys.stdout.fileno(), data) :]


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m kvmesh.bench.ttft.worker SPEC.json  (commands on stdin)", file=sys.stderr)
        return 2
    for key, value in FAIR_ENV.items():  # before vLLM is imported: it reads them at import / start
        os.environ.setdefault(key, value)
    spec = json.loads(Path(argv[0]).read_text())
    out: dict[str, Any] = {"setup": spec["setup"]}
    try:
        serve(spec, out)
    except Exception as exc:
        traceback.print_exc()
        reply({"error": f"{type(exc).__name__}: {exc}"})
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
