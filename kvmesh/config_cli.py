"""``kvmesh config check FILE``: how each key of a kvmesh or LMCache config file is read.

Prints one line per key (taken / mapped / ignored / unsupported / unknown, with the reason),
the resulting kvmesh settings, and kvmesh's defaults that differ from LMCache's for keys the
file does not set. Exit status 0 when the file loads, 1 when it does not (the
error says which key and what is valid), 2 with ``--strict`` when a key has no equivalent.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from kvmesh.config import CacheConfig, read_file_layer
from kvmesh.config_lmcache import redact_url
from kvmesh.config_lmcache_keys import DEFAULT_DIFFS
from kvmesh.core.fleetkey import ENV_VAR, FleetKey
from kvmesh.core.serde import ENCRYPT_NEEDS_KEY
from kvmesh.errors import ConfigError
from kvmesh.tiers.base import shared_tier_warning


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
    new = csub.add_parser(
        "fleet-key", help="print a fresh fleet key (one line of a fleet_key_file; see docs/security.md)"
    )
    new.add_argument("--out", help="write it to this file (mode 600, must not exist) instead of stdout")
    new.set_defaults(func=_fleet_key)


def _fleet_key(args: argparse.Namespace) -> int:
    key = FleetKey.generate()
    if not args.out:
        print(key)
        return 0
    try:
        fd = os.open(args.out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        print(f"error: cannot create {args.out}: {exc.strerror}", file=sys.stderr)
        return 1
    with os.fdopen(fd, "w") as f:
        f.write(f"# kvmesh fleet key: the first line signs, every line verifies (docs/security.md)\n{key}\n")
    print(f"wrote a new fleet key to {args.out}")
    return 0


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
    unsupported = sum(r.action in ("unsupported", "unknown") for r in cfg.readings)
    print()
    print("kvmesh settings:")
    for name, value in cfg.model_dump().items():
        if name == "admin_token" and value:
            value = "***"
        elif name == "remote_url" and value:
            value = redact_url(value)
        print(f"  {name}: {value!r}")
    diffs = default_diffs(cfg)
    if diffs:
        print("\nkvmesh defaults that differ from LMCache 0.5.6's (keys this configuration does not set):")
        for line in diffs:
            print(f"  {line}")
    if unsupported:
        print(f"\n{unsupported} key(s) have no kvmesh equivalent (warned at start; errors with strict: true)")
    return _check_trust(cfg)


def _check_trust(cfg: CacheConfig) -> int:
    """The fleet key as the engine will load it (the file, else ``KVMESH_FLEET_KEY_FILE``),
    and what a shared tier without one means."""
    try:
        key = FleetKey.from_config(cfg.fleet_key_file)
    except ConfigError as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return 1
    if key is None and cfg.encrypt_at_rest:
        print(f"\nerror: {ENCRYPT_NEEDS_KEY}", file=sys.stderr)
        return 1
    if key is not None:
        where = cfg.fleet_key_file or f"${ENV_VAR}"
        mode = "encrypted (AES-256-GCM)" if cfg.encrypt_at_rest else "authenticated (keyed MAC)"
        print(f"\nfleet key: {key!r} (from {where}); chunks below the cpu tier are {mode}")
    warning = shared_tier_warning(cfg.remote_url, key is not None)
    if warning:
        print(f"\nwarning: {warning}")
    return 0


def default_diffs(cfg: CacheConfig) -> list[str]:
    """One line per default of kvmesh's that differs from LMCache's, for keys ``cfg``'s
    sources do not set (either name)."""
    given = {r.key.removeprefix("lmcache.").split(".")[0] for r in cfg.readings}
    given |= {t.split("=")[0] for r in cfg.readings for t in [r.target] if t}
    out = []
    for lmc_key, lmc_default, key, why in DEFAULT_DIFFS:
        if lmc_key in given or key in given:
            continue
        ours = CacheConfig.model_fields[key].default
        name = key if key == lmc_key else f"{key} (LMCache: {lmc_key})"
        out.append(f"{name}: kvmesh {ours!r}, LMCache {lmc_default!r}  # {why}")
    return out
