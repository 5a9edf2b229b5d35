"""``kvmesh config check FILE``: how each key of a kvmesh or LMCache config file is read.

Prints one line per key (taken / mapped / ignored / unsupported, with the reason), then
the resulting kvmesh settings. Exit status 0 when the file loads, 1 when it does not (the
error says which key and what is valid), 2 with ``--strict`` when a key has no equivalent.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvmesh.config import CacheConfig, read_file_layer
from kvmesh.config_lmcache import redact_url
from kvmesh.errors import ConfigError


def register(sub: argparse._SubParsersAction[Any]) -> None:
    cfg = sub.add_parser("config", help="configuration tools")
    csub = cfg.add_subparsers(dest="config", required=True)
    chk = csub.add_parser("check", help="show how each key of a kvmesh or LMCache config file is read")
    chk.add_argument("file", help="YAML config file (kvmesh or LMCache, v1 or v0)")
    chk.add_argument(
        "--env", action="store_true", help="also apply LMCACHE_* / KVMESH_* variables, as the connector does"
    )
    chk.add_argument("--strict", action="store_true", help="fail on keys kvmesh has no equivalent for")
    chk.set_defaults(func=_check)


def _check(args: argparse.Namespace) -> int:
    try:
        layers = [read_file_layer(args.file)]
        if args.env:
            layers += CacheConfig.env_layers(base=None)
        if args.strict:
            layers.append(("--strict", {"strict": True}))
        cfg = CacheConfig.from_layers(layers)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2 if args.strict and "strict" in str(exc) else 1
    width = max((len(r.key) for r in cfg.readings), default=0)
    for r in cfg.readings:
        target = f" -> {r.target}" if r.target else ""
        note = f"  # {r.note}" if r.note else ""
        print(f"{r.action:<11} {r.key:<{width}}{target}{note}  [{r.source}]")
    unsupported = sum(r.action == "unsupported" for r in cfg.readings)
    print()
    print("kvmesh settings:")
    for name, value in cfg.model_dump().items():
        if name == "admin_token" and value:
            value = "***"
        elif name == "remote_url" and value:
            value = redact_url(value)
        print(f"  {name}: {value!r}")
    if unsupported:
        print(f"\n{unsupported} key(s) have no kvmesh equivalent (warned at start; errors with strict: true)")
    return 0
