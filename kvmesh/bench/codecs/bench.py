"""``kvmesh bench codecs``: size and speed of raw, zstd, safetensors and cachegen, and the
output drift cachegen's loss causes.

KV sources (all cast to bfloat16, the size the targets are stated against):

* ``model`` — real KV of the bench model (random-weight Llama, ``kvmesh model make-tiny``
  preset ``bench``) over generated prompts: random-like, with little token-to-token
  correlation, the hard case for delta coding;
* ``realistic`` — synthetic KV with the statistics of trained models' KV (no trained model
  is installed here): per-channel scales spread log-normally (K has outlier channels),
  token-wise AR(1) correlation (K 0.95, V 0.8), RoPE applied to K.

Per codec: compressed size / raw bf16, encode and decode GB/s (raw bytes per second,
medians of repeats, whole serde envelope included), exactness for lossless codecs. Drift
(bench model, 100 prompts unless --quick): the prompt's KV goes through the codec, then 32
tokens are generated greedily from the exact KV and teacher-forced through the decoded
KV; reported are the share of positions whose greedy token agrees and the largest
difference of the exact run's top-5 log-probabilities.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np
import torch

from kvmesh.bench.runner import print_table, provenance, write_json, write_plot
from kvmesh.core import serde
from kvmesh.core.keys import KVLayout

CODECS = ("raw", "zstd", "safetensors", "cachegen")
TARGETS = {"cachegen_ratio": 6.0, "cachegen_agreement": 0.98, "decode_gbps": 1.0}


def realistic_kv(layers: int, kv_heads: int, head: int, tokens: int, seed: int = 0) -> torch.Tensor:
    """``[layers, 2, tokens, kv_heads, head]`` synthetic KV with trained-model statistics."""
    g = torch.Generator().manual_seed(seed)
    out = torch.empty(layers, 2, tokens, kv_heads, head)
    pos = torch.arange(tokens, dtype=torch.float32)[:, None]
    inv = 10000.0 ** (-torch.arange(0, head, 2, dtype=torch.float32) / head)
    cos, sin = torch.cos(pos * inv), torch.sin(pos * inv)
    for layer in range(layers):
        for kv, rho in ((0, 0.95), (1, 0.8)):
            scale = torch.exp(torch.randn(kv_heads, head, generator=g) * (1.0 if kv == 0 else 0.4))
            x = torch.empty(tokens, kv_heads, head)
            x[0] = torch.randn(kv_heads, head, generator=g)
            noise = torch.randn(tokens, kv_heads, head, generator=g) * (1 - rho**2) ** 0.5
            for t in range(1, tokens):
                x[t] = rho * x[t - 1] + noise[t]
            x = x * scale
            if kv == 0:  # RoPE on K: pairs (i, i + head/2) rotate with position
                a, b = x[..., : head // 2], x[..., head // 2 :]
                c, s = cos[:, None], sin[:, None]
                x = torch.cat([a * c - b * s, a * s + b * c], dim=-1)
            out[layer, kv] = x
    return out


def _model_kv(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    layers = [(cache.layers[i].keys, cache.layers[i].values) for i in range(len(cache.layers))]
    # HF: [batch, heads, tokens, head] -> kvmesh: [layers, 2, tokens, heads, head]
    return torch.stack([torch.stack([k[0].transpose(0, 1), v[0].transpose(0, 1)]) for k, v in layers])


def _roundtrip(kv: torch.Tensor, codec: str) -> torch.Tensor:
    layout = KVLayout(kv.shape[0], kv.shape[3], kv.shape[4], "bfloat16")
    n = kv.shape[2]
    raw = kv.to(torch.bfloat16).contiguous().view(torch.uint8).reshape(-1).numpy().data
    blob = serde.encode_bytes("k", layout, np.arange(n, dtype=np.uint32), raw, codec)
    _, out = serde.decode(blob)
    return torch.frombuffer(bytearray(out), dtype=torch.bfloat16).view(kv.shape)


def measure(kv: torch.Tensor, codec: str, repeats: int) -> dict[str, Any]:
    layout = KVLayout(kv.shape[0], kv.shape[3], kv.shape[4], "bfloat16")
    n = kv.shape[2]
    raw = kv.to(torch.bfloat16).contiguous().view(torch.uint8).reshape(-1).numpy().data
    tokens = np.arange(n, dtype=np.uint32)
    enc, dec = [], []
    blob = b""
    out: Any = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        blob = serde.encode_bytes("k", layout, tokens, raw, codec)
        t1 = time.perf_counter()
        _, out = serde.decode(blob)
        t2 = time.perf_counter()
        enc.append(t1 - t0)
        dec.append(t2 - t1)
    x = kv.to(torch.bfloat16).float()
    y = torch.frombuffer(bytearray(out), dtype=torch.bfloat16).view(kv.shape).float()
    return {
        "codec": codec,
        "raw_bf16_bytes": raw.nbytes,
        "stored_bytes": len(blob),
        "ratio": round(raw.nbytes / len(blob), 3),
        "encode_gbps": round(raw.nbytes / statistics.median(enc) / 1e9, 3),
        "decode_gbps": round(raw.nbytes / statistics.median(dec) / 1e9, 3),
        "exact": bytes(out) == bytes(raw),
        "rel_error": round(float((y - x).norm() / x.norm()), 5),
    }


def drift(model_dir: str, codecs: list[str], prompts: int, prompt_len: int, gen: int) -> list[dict[str, Any]]:
    """Greedy agreement and top-5 logprob difference of decoded-KV runs vs exact-KV runs."""
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()  # type: ignore[no-untyped-call]
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    stats: dict[str, dict[str, list[float]]] = {c: {"agree": [], "lp": []} for c in codecs}
    for _ in range(prompts):
        ids = torch.randint(3, vocab, (1, prompt_len), generator=g)
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=gen, do_sample=False, min_new_tokens=gen)
        new = out[:, prompt_len:]
        exact = _model_kv(model, ids)
        base = _teacher_forced(model, exact, new, DynamicCache)
        top5 = base.topk(5, dim=-1).indices
        for c in codecs:
            lossy = _teacher_forced(model, _roundtrip(exact, c).float(), new, DynamicCache)
            stats[c]["agree"].append(float((lossy.argmax(-1) == base.argmax(-1)).float().mean()))
            stats[c]["lp"].append(float((lossy.gather(-1, top5) - base.gather(-1, top5)).abs().max()))
    return [
        {
            "codec": c,
            "greedy_agreement": round(statistics.mean(s["agree"]), 4),
            "max_top5_logprob_diff": round(max(s["lp"]), 5),
        }
        for c, s in stats.items()
    ]


def _teacher_forced(model: Any, kv: torch.Tensor, new: torch.Tensor, cache_cls: Any) -> torch.Tensor:
    """Log-probabilities at each generated position given the prompt's KV ``kv``."""
    cache = cache_cls()
    for layer in range(kv.shape[0]):
        k = kv[layer, 0].transpose(0, 1)[None].contiguous()
        v = kv[layer, 1].transpose(0, 1)[None].contiguous()
        cache.update(k, v, layer)
    n = kv.shape[2]
    pos = torch.arange(n, n + new.shape[1])[None]
    with torch.no_grad():
        logits = model(new, past_key_values=cache, position_ids=pos, use_cache=True).logits
    return torch.log_softmax(logits[0].float(), dim=-1)


def run(
    quick: bool = False,
    json_path: str | None = None,
    plot_path: str | None = None,
    model_dir: str | None = None,
    prompts: int | None = None,
    smoke: bool = False,
) -> dict[str, Any]:
    from kvmesh.bench.ttft.bench import default_model_dir
    from kvmesh.harness.model import PRESETS, make_tiny

    prov = provenance("codecs")  # the code this run measures: read now, the tree may move on
    mdir = str(make_tiny(out_dir=model_dir or default_model_dir(), **PRESETS["bench"]))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(mdir, dtype=torch.float32).eval()  # type: ignore[no-untyped-call]
    cfg = model.config
    head = cfg.hidden_size // cfg.num_attention_heads
    repeats = 1 if smoke else 3 if quick else 5
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, cfg.vocab_size, (1, 256), generator=g)
    sources = {
        "model": _model_kv(model, ids),
        "realistic": realistic_kv(cfg.num_hidden_layers, cfg.num_key_value_heads, head, 256),
        "realistic-8b": realistic_kv(32, 8, 128, 256),  # one llama-8b-shaped chunk: 32 MiB bf16
    }
    if smoke:  # every code path once (a test): its numbers mean nothing
        del sources["realistic-8b"]
    rows = []
    for name, kv in sources.items():
        for c in CODECS:
            rows.append({"kv": name, **measure(kv, c, repeats)})
    print_table(rows, ["kv", "codec", "ratio", "encode_gbps", "decode_gbps", "exact", "rel_error"])
    n_prompts = prompts if prompts is not None else (1 if smoke else 10 if quick else 100)
    drift_rows = drift(mdir, ["raw", "cachegen"], n_prompts, prompt_len=256, gen=32)
    print_table(drift_rows, ["codec", "greedy_agreement", "max_top5_logprob_diff"])
    cg = {r["kv"]: r for r in rows if r["codec"] == "cachegen"}
    verdict = {
        "cachegen_ratio_min": min(r["ratio"] for r in cg.values()),
        "cachegen_ratio_target_met": all(r["ratio"] >= TARGETS["cachegen_ratio"] for r in cg.values()),
        "cachegen_agreement": next(r["greedy_agreement"] for r in drift_rows if r["codec"] == "cachegen"),
        "lossless_exact": all(r["exact"] for r in rows if r["codec"] != "cachegen"),
        "decode_gbps_min": {c: min(r["decode_gbps"] for r in rows if r["codec"] == c) for c in CODECS},
    }
    verdict["cachegen_agreement_target_met"] = verdict["cachegen_agreement"] >= TARGETS["cachegen_agreement"]
    verdict["cachegen_decode_target_met"] = verdict["decode_gbps_min"]["cachegen"] >= TARGETS["decode_gbps"]
    result = {
        "model": mdir,
        "prompts": n_prompts,
        "tokens_per_chunk": 256,
        "targets": TARGETS,
        "results": rows,
        "drift": drift_rows,
        "verdict": verdict,
    }
    print(verdict)
    if json_path:
        write_json(json_path, result, prov)
    if plot_path:
        labels = [f"{r['kv']}\n{r['codec']}" for r in rows]
        write_plot(
            plot_path,
            labels,
            {
                "size ratio (raw bf16 / stored)": [r["ratio"] for r in rows],
                "decode GB/s": [r["decode_gbps"] for r in rows],
            },
            "x / GB/s",
            "kvmesh bench codecs: compression and decode speed (256-token chunks, bf16)",
        )
    return result
