"""The model identity a replica's chunks are keyed by, from what vLLM was started with."""

from __future__ import annotations

import logging
from typing import Any

from kvmesh.core.fingerprint import model_fingerprint

log = logging.getLogger(__name__)


def kv_settings(vllm_config: Any) -> dict[str, Any]:
    """vLLM settings that change the KV computed from the same weights and token ids."""
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    overrides = mc.hf_overrides if isinstance(mc.hf_overrides, dict) else repr(mc.hf_overrides)
    return {
        "dtype": str(mc.dtype).removeprefix("torch."),
        "kv_cache_dtype": str(cc.cache_dtype),
        "quantization": mc.quantization,
        "hf_overrides": overrides,
    }


def replica_identity(vllm_config: Any, override: str | None = None) -> str:
    """``override`` verbatim when the operator set ``model_fingerprint``, else the fingerprint
    of the weights vLLM loads (see :mod:`kvmesh.core.fingerprint`); ``"full"`` fingerprints
    every weight byte instead of samples."""
    if override and override != "full":
        return override
    mc = vllm_config.model_config
    fp = model_fingerprint(
        str(mc.model),
        revision=mc.revision,
        kv_settings=kv_settings(vllm_config),
        mode="full" if override == "full" else "sample",
    )
    log.info("kvmesh: model %s has fingerprint %s", mc.model, fp)
    return fp
