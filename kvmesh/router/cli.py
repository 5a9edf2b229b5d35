"""``kvmesh router``: argument parsing; everything else lives in the router modules.

Command-line flags override the ``--config`` file, which overrides the defaults. Heavy
imports (aiohttp, tokenizers) wait until the command runs, so ``kvmesh --help`` stays fast.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from kvmesh.admin.schema import TOKEN_ENV
from kvmesh.errors import ConfigError
from kvmesh.router.config import POLICIES, ReplicaConfig, RouterConfig


def add_router_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``router`` subcommand to ``subparsers`` (from ``add_subparsers``)."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "router",
        help="OpenAI-compatible router that sends each request to the replica holding its prefix",
        description="Route OpenAI requests to vLLM replicas by prefix-cache hit, load and session.",
    )
    p.add_argument("--model", help="model directory; its tokenizer is used to tokenize like the engine")
    p.add_argument(
        "--replica",
        action="append",
        default=[],
        metavar="URL[,events=EP][,replay=EP][,admin=URL][,name=NAME]",
        help="a vLLM replica (repeat the flag); events/replay: its ZMQ KV-event endpoints; "
        "admin: its kvmesh admin API (replay and admin refill the index when the router starts)",
    )
    p.add_argument("--policy", choices=POLICIES, help="routing policy (default: kvmesh)")
    p.add_argument("--config", help="YAML file with RouterConfig keys")
    p.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to listen on (default 8080)")
    p.add_argument(
        "--served-model-name", action="append", dest="served_model_names", help="accepted model name"
    )
    p.add_argument(
        "--tokenizer", choices=("local", "remote"), help="tokenize here or via a replica's /tokenize"
    )
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    p.add_argument(
        "--admin",
        action="append",
        default=[],
        metavar="URL[,name=NAME]",
        help="an engine admin endpoint the controller manages (repeat; engines may also register)",
    )
    p.add_argument("--admin-token", help=f"bearer token of the controller API (default: ${TOKEN_ENV})")
    p.set_defaults(func=run_router)
    return p


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    """The RouterConfig for parsed ``kvmesh router`` arguments (raises ConfigError)."""
    base = RouterConfig.from_yaml(args.config) if args.config else RouterConfig()
    replicas = tuple(ReplicaConfig.parse(spec) for spec in args.replica) or None
    names = tuple(args.served_model_names) if args.served_model_names else None
    # --admin adds to the file's engines; --admin-token replaces its token.
    ctl = base.controller.model_dump()
    ctl["admins"] = (*base.controller.admins, *(a for a in args.admin if a not in base.controller.admins))
    if args.admin_token:
        ctl["token"] = args.admin_token
    cfg = base.merged(
        controller=ctl,
        model=args.model,
        replicas=replicas,
        policy=args.policy,
        host=args.host,
        port=args.port,
        served_model_names=names,
        tokenizer=args.tokenizer,
    )
    if not cfg.replicas:
        raise ConfigError("no replicas: give --replica URL (repeatable) or 'replicas:' in --config")
    return cfg


def run_router(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = config_from_args(args)
    except ConfigError as exc:
        print(f"kvmesh router: {exc}", file=sys.stderr)
        return 2
    from kvmesh.router.app import RouterService
    from kvmesh.router.server import run_forever

    try:
        service = RouterService(cfg)
    except (OSError, ValueError, ConfigError) as exc:
        print(f"kvmesh router: {exc}", file=sys.stderr)
        return 2
    print(
        f"kvmesh router: {cfg.policy} policy over {len(cfg.replicas)} replicas on http://{cfg.host}:{cfg.port}"
    )
    run_forever(service)
    return 0
