"""One setup of ``kvmesh bench ttft`` in a fresh vLLM process (run by :mod:`kvmesh.bench.ttft`).

    python -m kvmesh.bench.ttft_worker SPEC.json OUT.json

SPEC is a :class:`kvmesh.bench.ttft_spec.SetupSpec` as JSON. Per prompt length: one untimed
warm-up cycle, then ``trials`` cycles of: new prompt, cold ``max_tokens=1`` request (the
connector stores), settle, kvmesh write-behind drained, ``reset_prefix_cache()``, kvmesh cpu
tier cleared (disk/redis setups; through the connector's control socket), page cache
dropped, the same request timed again.
Writes ``{"setup", "rows": [...], "engine_start_s", ...}`` (and ``"error"`` if it failed,
with the rows measured so far) to OUT, prints it as the last line, and prints ``[ttft] ...``
progress lines on the way.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from kvmesh.bench.ttft_spec import FAIR_ENV, logprob_diff, make_prompt
from kvmesh.errors import ProcessError
from kvmesh.harness.connector import KVMESH_MODULE
from kvmesh.harness.services import drop_page_cache


def top5(output: Any) -> list[dict[int, float]]:
    return [{int(t): float(lp.logprob) for t, lp in step.items()} for step in output.outputs[0].logprobs]


def measure(spec: dict[str, Any], out: dict[str, Any]) -> None:
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
        time.sleep(spec["settle_s"])
        if spec["kvmesh_wait_writes"] and not rpc("wait_for_writes", timeout=60.0):
            raise ProcessError("kvmesh writes did not land within 60 s")
        retries = reset()
        cleared = rpc("clear", tier="cpu") if spec["kvmesh_clear_cpu"] else None
        dropped = drop_page_cache() if spec["drop_page_cache"] else False
        reload_s, again = timed(ids)
        diff, mismatches = logprob_diff(top5(cold), top5(again))
        return {
            "cold_s": cold_s,
            "reload_s": reload_s,
            "cached": int(again.num_cached_tokens or 0),
            "diff": diff,
            "mismatches": mismatches,
            "dropped": dropped,
            "retries": retries,
            "cleared": cleared,
        }

    out["reset_retries"] = 0
    for n in spec["lengths"]:
        w = cycle(make_prompt(n, "warmup", vocab, spec["seed"]))
        print(
            f"[ttft] {setup} {n} tokens warm-up: cold {1000 * w['cold_s']:.0f} ms, "
            f"reload {1000 * w['reload_s']:.0f} ms, cached {w['cached']}"
            + (f", kvmesh cpu chunks cleared {w['cleared'].get('cpu')}" if w["cleared"] is not None else ""),
            flush=True,
        )
        row: dict[str, Any] = {"prompt_tokens": n, "cold_s": [], "reload_s": [], "cached_tokens": []}
        worst, mism, dropped = 0.0, 0, True
        for k in range(spec["trials"]):
            c = cycle(make_prompt(n, k, vocab, spec["seed"]))
            row["cold_s"].append(c["cold_s"])
            row["reload_s"].append(c["reload_s"])
            row["cached_tokens"].append(c["cached"])
            if c["cleared"] is not None:
                row.setdefault("cpu_chunks_cleared", []).append(c["cleared"].get("cpu"))
            worst, mism, dropped = max(worst, c["diff"]), mism + c["mismatches"], dropped and c["dropped"]
            out["reset_retries"] += c["retries"]
            print(
                f"[ttft] {setup} {n} tokens trial {k + 1}/{spec['trials']}: "
                f"cold {1000 * c['cold_s']:.0f} ms, reload {1000 * c['reload_s']:.0f} ms, "
                f"cached {c['cached']}, max dlogprob {c['diff']:.1e}"
                f"{' TOP5 MISMATCH' if c['mismatches'] else ''}",
                flush=True,
            )
        row.update(max_logprob_diff=worst, top5_mismatches=mism, page_cache_dropped=dropped)
        out["rows"].append(row)
    if kvmesh:
        out["kvmesh_stats"] = rpc("stats")
    if client is not None:
        client.close()
    with contextlib.suppress(Exception):  # exit promptly; the parent reaps what is left
        llm.llm_engine.engine_core.shutdown()


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m kvmesh.bench.ttft_worker SPEC.json OUT.json", file=sys.stderr)
        return 2
    for key, value in FAIR_ENV.items():  # before vLLM is imported: it reads them at import / start
        os.environ.setdefault(key, value)
    spec = json.loads(Path(argv[0]).read_text())
    out: dict[str, Any] = {"setup": spec["setup"], "rows": []}
    code = 0
    try:
        measure(spec, out)
    except Exception as exc:
        traceback.print_exc()
        out["error"] = f"{type(exc).__name__}: {exc}"
        code = 1
    Path(argv[1]).write_text(json.dumps(out))
    print(json.dumps(out), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
