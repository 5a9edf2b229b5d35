"""``kvmesh cache lookup|clear|pin|unpin|move|compress|decompress|health|wait|stats``.

Talks to the controller on the router (``--controller URL``, default ``$KVMESH_CONTROLLER``
or http://127.0.0.1:8080) and prints a table per replica, or the controller's JSON with
``--json``. The token comes from ``--token`` or ``KVMESH_ADMIN_TOKEN``.

Exit status: 0 when every replica answered (and, for ``wait``, finished); 1 when some
replica gave an error (or did not finish); 2 when the call itself failed (unreachable,
401, 422: the message says which field).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

DEFAULT_CONTROLLER = "http://127.0.0.1:8080"
TIERS = ("cpu", "disk", "remote")


def add_cache_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``cache`` subcommand (and its operations) to ``subparsers``."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "cache",
        help="operate the cluster-wide KV cache through the router's controller",
        description="Look up, clear, pin, move, compress the KV cache of every replica; check health.",
    )
    sub = p.add_subparsers(dest="cache_op", required=True)

    def op(name: str, help_text: str, tokens: str = "") -> argparse.ArgumentParser:
        q: argparse.ArgumentParser = sub.add_parser(name, help=help_text, description=help_text)
        q.add_argument(
            "--controller",
            default=os.environ.get("KVMESH_CONTROLLER", DEFAULT_CONTROLLER),
            help="router base URL (default: $KVMESH_CONTROLLER or %(default)s)",
        )
        q.add_argument("--token", help="bearer token (default: $KVMESH_ADMIN_TOKEN)")
        q.add_argument(
            "--replica", action="append", dest="replicas", metavar="NAME", help="only this replica (repeat)"
        )
        q.add_argument("--json", action="store_true", help="print the controller's JSON answer")
        q.add_argument("--http-timeout", type=float, default=30.0, help="seconds to wait for the answer")
        if tokens:
            g = q.add_mutually_exclusive_group(required=tokens == "required")
            g.add_argument("--tokens", help="token ids: '1,2,3' or '1 2 3'")
            g.add_argument("--tokens-file", help="file of token ids (JSON list or whitespace-separated)")
            g.add_argument("--prompt", help="text, tokenized by the router like /v1/completions")
            g.add_argument("--prompt-file", help="file whose text is the prompt")
            g.add_argument("--messages-file", help="JSON file of chat messages (like /v1/chat/completions)")
        q.set_defaults(func=run_cache, op_name=name)
        return q

    look = op("lookup", "per replica and tier: how many leading tokens of a prompt are cached", "required")
    look.add_argument("--cache-salt", help="the tenant's cache salt: only chunks stored under it count")
    c = op("clear", "drop chunks: all, of one tier or replica, or of a prompt", "optional")
    c.add_argument("--tier", choices=TIERS)
    c.add_argument("--force", action="store_true", help="drop pinned chunks too")
    for name, text in (("pin", "pin a prompt's chunks"), ("unpin", "unpin a prompt's chunks")):
        q = op(name, text, "required")
        q.add_argument("--tier", choices=("cpu", "disk"), help="default: cpu and disk")
    m = op("move", "move a prompt's chunks to a tier; prints bytes moved", "required")
    m.add_argument("--tier", choices=TIERS, required=True)
    z = op("compress", "re-encode a prompt's chunks with a codec; prints bytes before/after", "required")
    z.add_argument("--codec", choices=("zstd", "raw"), default="zstd")
    z.add_argument("--tier", choices=TIERS, help="default: every lower tier")
    d = op("decompress", "re-encode a prompt's chunks as raw; prints bytes before/after", "required")
    d.add_argument("--tier", choices=TIERS, help="default: every lower tier")
    op("health", "per replica: up/down, tier states, pool use, write queue, last heartbeat")
    w = op("wait", "block until every async write queued so far has landed (check_finish)")
    w.add_argument("--timeout", type=float, default=60.0, help="longest wait in seconds")
    w.add_argument("--no-wait", action="store_true", help="only check, do not wait")
    op("stats", "per replica and tier: hits, misses, bytes, evictions, corrupt and unauthenticated objects")
    return p


# -- request ---------------------------------------------------------------------------------------
def _read_tokens(text: str) -> list[int]:
    text = text.strip()
    items = json.loads(text) if text.startswith("[") else text.replace(",", " ").split()
    return [int(t) for t in items]


def build_request(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """``(operation, body)`` for parsed ``kvmesh cache`` arguments."""
    name: str = args.op_name
    body: dict[str, Any] = {}
    if args.replicas:
        body["replicas"] = list(args.replicas)
    if getattr(args, "tokens", None):
        body["tokens"] = _read_tokens(args.tokens)
    elif getattr(args, "tokens_file", None):
        body["tokens"] = _read_tokens(Path(args.tokens_file).read_text())
    elif getattr(args, "prompt", None) is not None:
        body["prompt"] = args.prompt
    elif getattr(args, "prompt_file", None):
        body["prompt"] = Path(args.prompt_file).read_text()
    elif getattr(args, "messages_file", None):
        body["messages"] = json.loads(Path(args.messages_file).read_text())
    for key in ("tier", "codec", "cache_salt"):
        if getattr(args, key, None) is not None:
            body[key] = getattr(args, key)
    if getattr(args, "force", False):
        body["force"] = True
    if name == "wait":
        body.update(wait=not args.no_wait, timeout_s=args.timeout)
        return "check_finish", body
    return name, body


def run_cache(args: argparse.Namespace) -> int:
    import httpx

    try:
        op, body = build_request(args)
    except (OSError, ValueError) as exc:
        print(f"kvmesh cache: {exc}", file=sys.stderr)
        return 2
    token = args.token or os.environ.get("KVMESH_ADMIN_TOKEN")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    timeout = args.http_timeout + (body.get("timeout_s", 0.0) if body.get("wait") else 0.0)
    url = args.controller.rstrip("/") + "/kvmesh/v1/" + op
    try:
        resp = httpx.post(url, json=body, headers=headers, timeout=timeout)
    except httpx.HTTPError as exc:
        print(f"kvmesh cache: cannot reach the controller at {args.controller}: {exc}", file=sys.stderr)
        return 2
    if resp.status_code != 200:
        print(f"kvmesh cache: {op}: {_http_error(resp)}", file=sys.stderr)
        return 2
    data = resp.json()
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        print(render(op, data))
    answers = data.get("replicas", {}).values()
    ok = all(a.get("ok") for a in answers)
    if op == "check_finish":
        ok = ok and all(a["result"].get("finished") for a in answers if a.get("ok"))
    return 0 if ok else 1


def _http_error(resp: Any) -> str:
    if resp.status_code == 401:
        return "401 unauthorized: give --token or set KVMESH_ADMIN_TOKEN"
    try:
        err = resp.json().get("error", {})
    except ValueError:
        return f"HTTP {resp.status_code}"
    where = f" (field {err['field']!r})" if err.get("field") else ""
    return f"HTTP {resp.status_code}: {err.get('message', '')}{where}"


# -- tables ----------------------------------------------------------------------------------------
def table(header: list[str], rows: list[list[Any]]) -> str:
    cells = [header, *[["-" if c is None else str(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _bytes(n: Any) -> str:
    if not isinstance(n, int | float):
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)  # pragma: no cover


def render(op: str, data: dict[str, Any]) -> str:
    """A readable table of a controller answer."""
    rows: list[list[Any]] = []
    errors: list[list[Any]] = []
    header: list[str]
    for name, ans in data.get("replicas", {}).items():
        if not ans.get("ok"):
            errors.append([name, ans.get("status", "error"), ans.get("error")])
            continue
        r = ans["result"]
        tiers = r.get("tiers", {})
        if op == "lookup":
            rows.append([name, *[_tier_val(tiers, t, "tokens") for t in TIERS], r.get("hit_tokens")])
        elif op == "clear":
            rows.append([name, *[r["cleared"].get(t) for t in TIERS]])
        elif op in ("pin", "unpin"):
            rows.append([name, r.get("chunks"), ",".join(r.get("tiers", []))])
        elif op == "move":
            rows.append([name, r.get("tier"), _bytes(r.get("bytes_moved"))])
        elif op in ("compress", "decompress"):
            for t, v in tiers.items():
                if "error" in v:
                    rows.append([name, t, "-", "-", "-", v["error"]])
                    continue
                ratio = f"{v['after'] / v['before']:.2f}" if v.get("before") else "-"
                rows.append([name, t, _bytes(v["before"]), _bytes(v["after"]), ratio, v.get("note", "")])
        elif op == "health":
            pool = r.get("pool", {})
            queue = sum(r.get("write_queue", {}).values())
            age = ans.get("last_heartbeat_s_ago")
            rows.append(
                [
                    name,
                    ans.get("status"),
                    *[tiers.get(t) for t in TIERS],
                    f"{100 * pool.get('used_fraction', 0):.1f}%",
                    queue,
                    "-" if age is None else f"{age:.1f}s ago",
                ]
            )
        elif op == "check_finish":
            pending = sum(r.get("pending", {}).values())
            rows.append([name, "yes" if r.get("finished") else "NO", pending, f"{r.get('waited_s', 0):.2f}s"])
        elif op == "stats":
            for t, s in tiers.items():
                if t == "engine":
                    continue
                rows.append(
                    [
                        name,
                        t,
                        s.get("hits"),
                        s.get("misses"),
                        _bytes(s.get("bytes_in")),
                        _bytes(s.get("bytes_out")),
                        s.get("evictions"),
                        s.get("corrupt"),
                        s.get("errors"),
                    ]
                )
    headers = {
        "lookup": ["replica", "cpu", "disk", "remote", "hit tokens"],
        "clear": ["replica", "cpu", "disk", "remote"],
        "pin": ["replica", "chunks", "tiers"],
        "unpin": ["replica", "chunks", "tiers"],
        "move": ["replica", "tier", "moved"],
        "compress": ["replica", "tier", "before", "after", "ratio", "note"],
        "decompress": ["replica", "tier", "before", "after", "ratio", "note"],
        "health": ["replica", "status", "cpu", "disk", "remote", "pool", "queue", "heartbeat"],
        "check_finish": ["replica", "finished", "pending", "waited"],
        "stats": ["replica", "tier", "hits", "misses", "in", "out", "evictions", "corrupt", "errors"],
    }
    header = headers.get(op, ["replica"])
    parts = []
    if rows:
        parts.append(table(header, rows))
    if op == "lookup" and data.get("remote") is not None:
        parts.append(f"shared remote tier: {data['remote'].get('tokens')} of {data.get('tokens')} tokens")
    if errors:
        parts.append(table(["replica", "status", "error"], errors))
    return "\n\n".join(parts) if parts else "(no replicas)"


def _tier_val(tiers: dict[str, Any], tier: str, key: str) -> Any:
    v = tiers.get(tier)
    if v is None:
        return None
    return v.get(key, "error")
