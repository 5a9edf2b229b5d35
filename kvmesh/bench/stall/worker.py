"""One mode of ``kvmesh bench stall`` in a vLLM process of its own, driven by the parent
(:mod:`kvmesh.bench.stall.bench`) one JSON command a line on stdin, answering on stdout lines
that start with ``PREFIX`` (the protocol of ``kvmesh bench ttft``'s worker).

    python -m kvmesh.bench.stall.worker SPEC.json

SPEC: ``{"mode", "model_dir", "kvmesh": {connector config}, "decode_tokens", "load_tokens"}``.
Commands: ``{"op": "prepare", "source", "trial"}`` computes the loading prompt once (the
connector stores it, the writes land), then leaves it only in ``source`` (``disk``: cpu tier
and vLLM's prefix cache dropped, page cache too; ``redis``: the disk tier dropped as well;
``vllm``: nothing dropped, so vLLM's own prefix cache has it: the floor, no load at all);
``{"op": "run", "with_load": bool, "trial"}`` steps four decodes through ``llm_engine.step()``
and, with ``with_load``, adds the loading request once each decode has 4 tokens: the answer
has the decodes' inter-token gaps after that point (p99, max) and the loading request's TTFT.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import sys
import time
import traceback
import zlib
from pathlib import Path
from typing import Any

from kvmesh.bench.runner import percentile
from kvmesh.bench.ttft.spec import FAIR_ENV, FAIR_LLM_ARGS
from kvmesh.bench.ttft.worker import PREFIX, reply
from kvmesh.errors import ProcessError
from kvmesh.harness.connector import KVMESH_MODULE
from kvmesh.harness.services import drop_page_cache

DECODES = 4


def _prompt(seed: int, n: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(6, vocab - 1) for _ in range(n - 1)]


def _load_seconds(stats: dict[str, Any]) -> dict[str, float]:
    """Per tier, the seconds its loads took so far (the connector's cost figures)."""
    tiers = stats.get("costs", {}).get("tiers", {})
    return {name: float(t.get("load_seconds", 0.0)) for name, t in tiers.items()}


def serve(spec: dict[str, Any]) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    from kvmesh.integrations.vllm.rpc import RpcClient, socket_path

    engine_id = f"kvmesh-stall-{spec['mode']}-{os.getpid()}"
    kv = KVTransferConfig(
        kv_connector="KVMeshConnector",
        kv_connector_module_path=KVMESH_MODULE,
        kv_role="kv_both",
        engine_id=engine_id,
        kv_load_failure_policy="recompute",
        kv_connector_extra_config=spec["kvmesh"],
    )
    llm = LLM(model=spec["model_dir"], kv_transfer_config=kv, **FAIR_LLM_ARGS)
    client = RpcClient(socket_path(engine_id, 0, 0, spec["kvmesh"].get("socket_dir")), timeout_s=60)
    vocab = int(json.loads(Path(spec["model_dir"], "config.json").read_text())["vocab_size"])
    eng = llm.llm_engine
    load_prompt: list[int] = []

    def rpc(op: str, **args: Any) -> Any:
        got = client.call(op, **args)
        if got is None:
            raise ProcessError(f"kvmesh connector rpc {op!r} failed")
        return got

    def prepare(source: str, trial: int) -> dict[str, Any]:
        nonlocal load_prompt
        # A prompt of this mode's own: with the same prompt, the second mode's worker found it
        # in the shared Redis (the first one's store), loaded it instead of computing it, and
        # so never wrote it to its own disk: its "disk" trial then read the far Redis.
        # And one per source (by name: "vllm" and "disk" have the same length).
        seed = 10_000 + 97 * trial + 1_009 * (zlib.crc32(source.encode()) % 1_000)
        seed += 1_000_003 * (zlib.crc32(spec["mode"].encode()) % 100_000)
        load_prompt = _prompt(seed, spec["load_tokens"], vocab)
        sp = SamplingParams(max_tokens=1, temperature=0.0)
        llm.generate([TokensPrompt(prompt_token_ids=load_prompt)], sp, use_tqdm=False)
        landed = rpc("wait_for_writes", timeout=60.0)
        if source == "vllm":  # the floor: vLLM's own prefix cache holds the prompt, no load
            return {"landed": landed, "page_cache_dropped": False}
        if source != "cpu":  # cpu: the prompt stays in the cpu tier (a cpu hit)
            rpc("clear", tier="cpu")
        if source not in ("disk", "cpu") and "local_disk" in spec["kvmesh"]:
            rpc("clear", tier="disk")
        for _ in range(100):  # blocks held by a finishing request: retried
            if llm.reset_prefix_cache():
                break
            time.sleep(0.05)
        return {"landed": landed, "page_cache_dropped": drop_page_cache()}

    def run(with_load: bool, trial: int) -> dict[str, Any]:
        before = _load_seconds(rpc("stats")) if with_load else {}
        decode_sp = SamplingParams(max_tokens=spec["decode_tokens"], temperature=0.0, ignore_eos=True)
        stamps: dict[str, list[float]] = {}
        tag = f"t{trial}-{int(with_load)}-{time.monotonic_ns()}"
        for i in range(DECODES):
            rid = f"{tag}-d{i}"
            ids = _prompt(500 + 31 * trial + i, 120, vocab)
            eng.add_request(rid, TokensPrompt(prompt_token_ids=ids), decode_sp)
            stamps[rid] = []
        load_id, load_at, cached = f"{tag}-load", None, None
        counts: dict[str, int] = {}
        while eng.has_unfinished_requests():
            outs = eng.step()
            now = time.perf_counter()
            for o in outs:
                n = len(o.outputs[0].token_ids)  # type: ignore[index]
                if n > counts.get(o.request_id, 0):
                    stamps.setdefault(o.request_id, []).append(now)
                    counts[o.request_id] = n
                if o.request_id == load_id and o.finished:
                    cached = o.num_cached_tokens
            if load_at is None and all(counts.get(f"{tag}-d{i}", 0) >= 4 for i in range(DECODES)):
                load_at = time.perf_counter()
                if with_load:
                    sp = SamplingParams(max_tokens=1, temperature=0.0)
                    eng.add_request(load_id, TokensPrompt(prompt_token_ids=load_prompt), sp)
        start = load_at or 0.0
        gaps: list[float] = []
        for i in range(DECODES):
            ts = stamps[f"{tag}-d{i}"]
            gaps += [b - a for a, b in itertools.pairwise(ts) if b > start]
        gaps.sort()
        return {
            "itl_p99_s": percentile(gaps, 99) if gaps else None,
            "itl_max_s": gaps[-1] if gaps else None,
            "gaps": len(gaps),
            "load_ttft_s": (stamps[load_id][0] - start) if with_load and stamps.get(load_id) else None,
            "load_cached_tokens": cached,
            # seconds each tier's reads took in this run (the load's share of its TTFT)
            "load_read_s": {
                t: round(v - before.get(t, 0.0), 4)
                for t, v in (_load_seconds(rpc("stats")) if with_load else {}).items()
                if v > before.get(t, 0.0)
            },
        }

    warm = SamplingParams(max_tokens=2, temperature=0.0)
    # A warm-up prompt of this mode's own: with one for all, the second worker found the
    # first one's in the shared Redis, and its first load (over a new connection) taught its
    # cost model the far Redis's latency at 1.7 s.
    warm_ids = _prompt(1 + zlib.crc32(spec["mode"].encode()) % 100_000, 200, vocab)
    llm.generate([TokensPrompt(prompt_token_ids=warm_ids)], warm, use_tqdm=False)
    reply({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        try:
            if cmd["op"] == "prepare":
                reply(prepare(cmd["source"], int(cmd["trial"])))
            elif cmd["op"] == "run":
                reply(run(bool(cmd["with_load"]), int(cmd["trial"])))
            elif cmd["op"] == "stats":
                reply({"kvmesh_stats": rpc("stats")})
        except Exception as exc:  # one failed command is a result; the next may work
            traceback.print_exc()
            reply({"error": f"{type(exc).__name__}: {exc}"})
    client.close()
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m kvmesh.bench.stall.worker SPEC.json  (commands on stdin)", file=sys.stderr)
        return 2
    for key, value in FAIR_ENV.items():
        os.environ.setdefault(key, value)
    try:
        serve(json.loads(Path(argv[0]).read_text()))
    except Exception as exc:
        traceback.print_exc()
        reply({"error": f"{type(exc).__name__}: {exc}"})
        return 1
    return 0


__all__ = ["PREFIX", "main"]

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
