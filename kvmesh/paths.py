"""Where the shared request traces live (``shared/traces`` beside the repository)."""

from __future__ import annotations

import os
from pathlib import Path

_FALLBACK = "/work/shared/traces"


def traces_dir() -> str:
    """``KVMESH_TRACES``, else ``shared/traces`` beside the checkout (where CI puts a copy of
    shared/), else the workplace's own copy."""
    env = os.environ.get("KVMESH_TRACES")
    if env:
        return env
    sibling = Path(__file__).resolve().parents[2] / "shared" / "traces"
    return str(sibling) if sibling.is_dir() else _FALLBACK
