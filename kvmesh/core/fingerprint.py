"""Model fingerprints: chunks are keyed by what defines the weights, not by the model's name.

A chunk's namespace used to hash the model *name*. Replace the checkpoint behind a path or a
Hub id (a fine-tune, a new revision) and every replica would serve the old model's KV with
every checksum passing; two replicas loading the same weights from different paths would
never share. The fingerprint is built from the content instead:

- ``config.json`` as canonical JSON (without the keys that name a path or a tool version);
- every ``*.safetensors`` file's header (tensor names, dtypes, shapes, offsets) plus a few
  small samples of its tensor bytes spread over the file (a fine-tune keeps the header and
  changes the bytes): a few dozen KiB read per file, never the whole file;
- other weight files (``*.bin``, ``*.pt``, ``*.gguf``) by size and the same byte samples;
- when there is no local directory, the Hub commit hash vLLM resolved;
- the settings that change KV for the same weights: compute dtype, KV-cache dtype,
  quantization, hf overrides (e.g. rope scaling).

``mode="full"`` hashes every byte of every weight file (slow for large models; for
operators who need certainty against a partial in-place edit). An operator can also name the
identity outright with the ``model_fingerprint`` connector key (a release tag, a commit).

Pure Python and numpy-free: the router may import it.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import xxhash

from kvmesh.errors import ConfigError

FINGERPRINT_VERSION = "fp1"
_VOLATILE_CONFIG_KEYS = frozenset({"_name_or_path", "transformers_version", "_commit_hash"})
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_SAMPLES = 8  # byte samples per weight file
_SAMPLE_BYTES = 4096
_MAX_HEADER = 100 << 20  # a safetensors header above this is not one
_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
_FULL_READ = 8 << 20

Mode = Literal["sample", "full"]


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str).encode()


def _config_digest(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot fingerprint the model: {path} is not readable JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"cannot fingerprint the model: {path} is not a JSON object")
    return {k: v for k, v in config.items() if k not in _VOLATILE_CONFIG_KEYS}


def _safetensors_header(fh: Any, path: Path, size: int) -> tuple[bytes, int]:
    raw = fh.read(8)
    if len(raw) != 8:
        raise ConfigError(f"cannot fingerprint the model: {path} is too short to be safetensors")
    (n,) = struct.unpack("<Q", raw)
    if n > _MAX_HEADER or 8 + n > size:
        raise ConfigError(f"cannot fingerprint the model: {path} has a bad safetensors header length {n}")
    header = fh.read(n)
    try:
        parsed = json.loads(header)
    except ValueError:
        raise ConfigError(f"cannot fingerprint the model: {path} has a corrupt safetensors header") from None
    return _canonical(parsed), 8 + n


def _file_digest(path: Path, mode: Mode) -> str:
    size = path.stat().st_size
    h = xxhash.xxh3_128()
    h.update(str(size).encode())
    with open(path, "rb") as fh:
        data_start = 0
        if path.suffix == ".safetensors":
            header, data_start = _safetensors_header(fh, path, size)
            h.update(header)
        if mode == "full":
            fh.seek(data_start)
            while block := fh.read(_FULL_READ):
                h.update(block)
        else:
            span = max(size - data_start - _SAMPLE_BYTES, 0)
            for i in range(_SAMPLES):
                fh.seek(data_start + span * i // max(_SAMPLES - 1, 1))
                h.update(fh.read(_SAMPLE_BYTES))
    return h.hexdigest()


def weights_identity(model_dir: str | os.PathLike[str], mode: Mode = "sample") -> dict[str, Any]:
    """What defines the weights in ``model_dir``: its config and its weight files' content."""
    root = Path(model_dir)
    config = root / "config.json"
    if not config.is_file():
        raise ConfigError(f"cannot fingerprint the model: {root} has no config.json")
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in _WEIGHT_SUFFIXES)
    if not files:
        raise ConfigError(
            f"cannot fingerprint the model: no weight files ({', '.join(_WEIGHT_SUFFIXES)}) under {root}; "
            "set the connector key model_fingerprint"
        )
    return {
        "config": _config_digest(config),
        # Relative names: the same checkpoint copied elsewhere has the same identity.
        "weights": {str(p.relative_to(root)): _file_digest(p, mode) for p in files},
    }


def local_model_dir(model: str, revision: str | None = None) -> Path | None:
    """The directory holding ``model``: itself if it is one, else its Hub snapshot in the
    local cache (never downloads), else ``None``."""
    if Path(model).is_dir():
        return Path(model)
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None
    try:
        found = snapshot_download(model, revision=revision, local_files_only=True)
    except Exception:  # any lookup failure means "not cached here": the caller falls back
        return None
    return Path(found)


def commit_of(revision: object) -> str | None:
    """The commit hash vLLM resolved a Hub revision to, if it has one."""
    resolved = getattr(revision, "resolved", None) or getattr(revision, "commit_hash", None)
    for candidate in (resolved, revision):
        if isinstance(candidate, str) and _COMMIT_RE.match(candidate):
            return candidate
    return None


def model_fingerprint(
    model: str,
    *,
    revision: object = None,
    kv_settings: Mapping[str, Any] | None = None,
    mode: Mode = "sample",
) -> str:
    """A stable id for "these weights with these KV-relevant settings".

    ``model`` is a directory or a Hub id; ``kv_settings`` holds what changes KV for the same
    weights (dtype, kv_cache_dtype, quantization, hf_overrides). Raises ``ConfigError`` when
    nothing identifies the weights: a model that is neither a directory, nor cached, nor
    pinned to a commit must be named with ``model_fingerprint`` (a wrong guess would serve
    another model's KV).
    """
    if mode not in ("sample", "full"):
        raise ConfigError(f"fingerprint mode must be 'sample' or 'full', got {mode!r}")
    directory = local_model_dir(model, revision if isinstance(revision, str) else None)
    identity: dict[str, Any]
    if directory is not None:
        identity = {"weights": weights_identity(directory, mode)}
    elif (commit := commit_of(revision)) is not None:
        identity = {"hub": model, "commit": commit}
    else:
        raise ConfigError(
            f"cannot fingerprint model {model!r}: it is not a local directory, not in the local Hub "
            "cache and has no resolved commit; set the connector key model_fingerprint to a value "
            "that changes whenever the weights do (a release tag, a commit hash)"
        )
    identity["kv"] = dict(sorted((kv_settings or {}).items()))
    return f"{FINGERPRINT_VERSION}:{xxhash.xxh3_128(_canonical(identity)).hexdigest()}"


# -- LoRA adapters -----------------------------------------------------------------------
# An adapter changes every layer's K and V for the same token ids, so its chunks must never
# be served to another adapter or to the base model (LMCache did, vllm#44250). Its identity is
# its content, like the model's: the same weights loaded under two names (two replicas, two
# operators) share chunks; a retrained adapter behind the same name or path does not.
ADAPTER_CONFIG = "adapter_config.json"
# Keys of adapter_config.json that name a path, a revision or a tool version, not the weights.
_VOLATILE_ADAPTER_KEYS = frozenset({"base_model_name_or_path", "revision", "peft_version", "auto_mapping"})
_adapter_cache: dict[tuple[str, str], str] = {}


def adapter_identity(adapter_dir: str | os.PathLike[str], mode: Mode = "sample") -> dict[str, Any]:
    """What defines a (peft-format) LoRA adapter in ``adapter_dir``: its ``adapter_config.json``
    (rank, alpha, target modules, ...) and its weight files' content."""
    root = Path(adapter_dir)
    if not root.is_dir():
        raise ConfigError(f"cannot fingerprint the LoRA adapter: {root} is not a directory")
    config = root / ADAPTER_CONFIG
    if not config.is_file():
        raise ConfigError(f"cannot fingerprint the LoRA adapter: {root} has no {ADAPTER_CONFIG}")
    try:
        parsed = json.loads(config.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"cannot fingerprint the LoRA adapter: {config} is not readable JSON ({exc})"
        ) from None
    if not isinstance(parsed, dict):
        raise ConfigError(f"cannot fingerprint the LoRA adapter: {config} is not a JSON object")
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in _WEIGHT_SUFFIXES)
    if not files:
        raise ConfigError(
            "cannot fingerprint the LoRA adapter: no weight files "
            f"({', '.join(_WEIGHT_SUFFIXES)}) under {root}"
        )
    try:
        weights = {str(p.relative_to(root)): _file_digest(p, mode) for p in files}
    except ConfigError as exc:
        raise ConfigError(str(exc).replace("the model", "the LoRA adapter")) from None
    except OSError as exc:
        raise ConfigError(f"cannot fingerprint the LoRA adapter: {root} is not readable ({exc})") from None
    return {
        "config": {k: v for k, v in parsed.items() if k not in _VOLATILE_ADAPTER_KEYS},
        "weights": weights,
    }


def adapter_fingerprint(adapter_dir: str | os.PathLike[str], mode: Mode = "sample") -> str:
    """A stable id for the LoRA adapter in ``adapter_dir``: the same for the same bytes under
    any path or name, different when its weights or config differ. Computed once per
    (resolved) path in this process: vLLM loads an adapter's files once and never reloads
    them under the same path while it runs. Raises ``ConfigError`` for a missing or corrupt
    adapter (keying it by its name instead could serve another adapter's KV)."""
    if mode not in ("sample", "full"):
        raise ConfigError(f"fingerprint mode must be 'sample' or 'full', got {mode!r}")
    key = (os.path.realpath(os.fspath(adapter_dir)), mode)
    found = _adapter_cache.get(key)
    if found is None:
        identity = adapter_identity(key[0], mode)
        found = f"lora-{FINGERPRINT_VERSION}:{xxhash.xxh3_128(_canonical(identity)).hexdigest()}"
        _adapter_cache[key] = found
    return found
