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
from kvmesh.router.config import RouterConfig
from kvmesh.routing.config import POLICIES, ROLES, ReplicaConfig


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
        metavar="URL[,events=EP][,replay=EP][,admin=URL][,name=NAME][,role=ROLE]",
        help="a vLLM replica (repeat the flag); events/replay: its ZMQ KV-event endpoints; "
        "admin: its kvmesh admin API (replay and admin refill the index when the router starts); "
        f"role ({'|'.join(ROLES)}, default both): its half with --pd",
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
        "--replica-header",
        action="store_true",
        default=None,
        help="name the serving replica in an x-kvmesh-replica header (off: it is a placement oracle)",
    )
    p.add_argument(
        "--max-model-len", type=int, help="longest prompt in tokens (default: the replicas' /v1/models)"
    )
    p.add_argument(
        "--admin",
        action="append",
        default=[],
        metavar="URL[,name=NAME]",
        help="an engine admin endpoint the controller manages (repeat; engines may also register)",
    )
    p.add_argument("--admin-token", help=f"bearer token of the controller API (default: ${TOKEN_ENV})")
    p.add_argument(
        "--pd",
        action="store_true",
        default=None,
        help="prefill/decode disaggregation: long uncached prompts are prefilled on a role=prefill "
        "replica, then decoded on a role=decode one with the KV it hands over",
    )
    p.add_argument(
        "--pd-threshold-tokens",
        type=int,
        metavar="N",
        help="with --pd: uncached prompt tokens above which a request is prefilled remotely (default 2048)",
    )
    p.add_argument(
        "--prefill-timeout-s",
        type=float,
        metavar="S",
        help="with --pd: a prefill not answered within S seconds is decoded alone (default 30)",
    )
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
    pd = base.pd.model_dump()
    flags = {"enabled": args.pd, "pd_threshold_tokens": args.pd_threshold_tokens,
             "prefill_timeout_s": args.prefill_timeout_s}  # fmt: skip
    pd.update({k: v for k, v in flags.items() if v is not None})
    cfg = base.merged(
        controller=ctl,
        pd=pd,
        model=args.model,
        replicas=replicas,
        policy=args.policy,
        host=args.host,
        port=args.port,
        served_model_names=names,
        tokenizer=args.tokenizer,
        replica_header=args.replica_header,
        max_model_len=args.max_model_len,
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
    pd = ""
    if cfg.pd.enabled:
        roles = [r.role for r in cfg.replicas]
        counts = ", ".join(f"{roles.count(r)} {r}" for r in ROLES if r in roles)
        pd = f" (pd: {counts}; prefill above {cfg.pd.pd_threshold_tokens} uncached tokens)"
    print(
        f"kvmesh router: {cfg.policy} policy over {len(cfg.replicas)} replicas{pd} "
        f"on http://{cfg.host}:{cfg.port}"
    )
    run_forever(service)
    return 0
