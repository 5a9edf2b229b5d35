"""``kvmesh prewarm``: fill the cache with documents before users ask about them.

Each document is sent to a running OpenAI-compatible server (vLLM with ``KVMeshConnector``)
as a completion prompt with ``max_tokens=1``: the server prefills it, and the connector
saves its chunks to kvmesh (and, with a remote tier, to every replica). The prompt-token
count reported back (``usage.prompt_tokens``) shows how much each document warmed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm


def prewarm(
    url: str,
    model: str,
    files: Sequence[str | os.PathLike[str]],
    progress: bool = True,
    timeout_s: float = 600.0,
) -> list[dict[str, Any]]:
    """Send each file as a prompt; returns one ``{"file", "prompt_tokens", "seconds"}``
    dict per file (plus ``"error"`` for a file the server refused). ``url`` is the server
    root (``http://host:8000``) or its ``/v1`` base."""
    endpoint = url.rstrip("/")
    endpoint = endpoint + ("/completions" if endpoint.endswith("/v1") else "/v1/completions")
    results: list[dict[str, Any]] = []
    with httpx.Client(timeout=timeout_s) as client:
        for path in tqdm(list(files), desc="prewarm", unit="doc", disable=not progress):
            t0 = time.perf_counter()
            row: dict[str, Any] = {"file": str(path)}
            try:
                text = Path(path).read_text(encoding="utf-8")
                resp = client.post(
                    endpoint, json={"model": model, "prompt": text, "max_tokens": 1, "temperature": 0.0}
                )
                resp.raise_for_status()
                row["prompt_tokens"] = int(resp.json()["usage"]["prompt_tokens"])
            except (OSError, httpx.HTTPError, KeyError, TypeError, ValueError) as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"
            row["seconds"] = round(time.perf_counter() - t0, 3)
            results.append(row)
    return results


def _run(args: argparse.Namespace) -> int:
    rows = prewarm(args.url, args.model, args.files, progress=not args.quiet)
    for row in rows:
        print(json.dumps(row))
    failed = [r for r in rows if "error" in r]
    total = sum(r.get("prompt_tokens", 0) for r in rows)
    print(
        f"prewarmed {len(rows) - len(failed)} of {len(rows)} documents, {total} prompt tokens",
        file=sys.stderr,
    )
    return 1 if failed else 0


def add_prewarm_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``prewarm`` to a ``kvmesh`` subcommand set (``argparse`` subparsers)."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "prewarm", help="send documents through a running vLLM server so kvmesh caches their KV"
    )
    p.add_argument("--url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="model name as the server knows it")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("files", nargs="+", metavar="FILE", help="text files, one prompt each")
    p.set_defaults(func=_run)
    return p
