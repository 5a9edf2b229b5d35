"""Small Mooncake-style JSONL traces for the ``kvmesh sim run`` tests."""

from __future__ import annotations

import json
from pathlib import Path


def write_trace(path: Path, requests: list[tuple[int, int, int, list[int]]]) -> Path:
    """``requests``: (timestamp ms, input tokens, output tokens, block hash ids), one a line."""
    lines = [
        json.dumps({"timestamp": t, "input_length": n_in, "output_length": n_out, "hash_ids": ids})
        for t, n_in, n_out, ids in requests
    ]
    path.write_text("\n".join(lines) + "\n")
    return path
