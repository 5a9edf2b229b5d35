"""``kvmesh epp``: the endpoint picker for a Gateway API Inference Extension gateway.

Flags override ``--config`` (an :class:`~kvmesh.epp.config.EppConfig` YAML; its ``routing:``
takes the routing keys of ``kvmesh router``), which overrides the defaults. Heavy imports (grpc,
tokenizers) wait until the command runs, so ``kvmesh --help`` stays fast.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from typing import Any

from kvmesh.errors import ConfigError, ProcessError
from kvmesh.routing.config import POLICIES


def register(sub: Any) -> argparse.ArgumentParser:
    """Add the ``epp`` subcommand to ``sub`` (from ``add_subparsers``)."""
    p: argparse.ArgumentParser = sub.add_parser(
        "epp",
        help="Envoy ext_proc endpoint picker (Gateway API Inference Extension) with kvmesh's scoring",
        description="Pick the model server for each request a gateway asks about, by prefix-cache hit, "
        "load and session: the kvmesh routing core behind Envoy's ext_proc protocol.",
    )
    p.add_argument(
        "--config", help="YAML file with EppConfig keys (routing: takes the routing keys of kvmesh router)"
    )
    p.add_argument("--model", help="model directory; its tokenizer is used to tokenize like the engine")
    p.add_argument(
        "--endpoint",
        action="append",
        default=[],
        metavar="IP:PORT[,events=EP][,replay=EP]",
        help="a static model server endpoint (repeat the flag); events/replay: its ZMQ KV-event endpoints",
    )
    p.add_argument("--pool", help="InferencePool name: discover its pods from the Kubernetes API")
    p.add_argument("--pool-namespace", help="namespace of the InferencePool (default: default)")
    p.add_argument("--policy", choices=POLICIES, help="routing policy (default: kvmesh)")
    p.add_argument("--served-model-name", action="append", dest="served_model_names", help="accepted model")
    p.add_argument("--host", help="address to listen on (default 127.0.0.1; in a pod: its IP)")
    p.add_argument("--grpc-port", type=int, help="ext_proc port (default 9002)")
    p.add_argument("--health-port", type=int, help="gRPC health port (default 9003)")
    p.add_argument("--metrics-port", type=int, help="Prometheus port (default 9090)")
    p.add_argument("--fallbacks", type=int, help="fallback endpoints after the primary (default 0)")
    p.add_argument(
        "--cert-path", help="directory with tls.crt and tls.key for ext_proc's TLS (default: self-signed)"
    )
    p.add_argument(
        "--secure-serving",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="serve ext_proc over TLS (default: on)",
    )
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    p.set_defaults(func=run_epp)
    return p


def config_from_args(args: argparse.Namespace) -> Any:
    from kvmesh.epp.config import EppConfig, KubeConfig
    from kvmesh.epp.scoring import endpoint_config

    base = EppConfig.from_yaml(args.config) if args.config else EppConfig()
    routing = base.routing.merged(
        model=args.model,
        policy=args.policy,
        served_model_names=tuple(args.served_model_names) if args.served_model_names else None,
        replicas=tuple(endpoint_config(spec) for spec in args.endpoint) or None,
    )
    kube = base.kube
    if args.pool:
        kube = KubeConfig(pool=args.pool, namespace=args.pool_namespace or "default")
    elif args.pool_namespace:
        raise ConfigError("--pool-namespace needs --pool")
    data = base.model_dump()
    data["routing"] = routing
    data["kube"] = kube
    flags = ("host", "grpc_port", "health_port", "metrics_port", "fallbacks", "cert_path", "secure_serving")
    for key in flags:
        if getattr(args, key) is not None:
            data[key] = getattr(args, key)
    cfg = EppConfig.from_dict(data)
    if not cfg.routing.replicas and cfg.kube is None:
        raise ConfigError(
            "no endpoints: give --endpoint IP:PORT (repeatable), --pool NAME, or kube: in --config"
        )
    return cfg


def run_epp(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = config_from_args(args)
    except ConfigError as exc:
        print(f"kvmesh epp: {exc}", file=sys.stderr)
        return 2
    from kvmesh.epp.discovery import KubeDiscovery
    from kvmesh.epp.scoring import EndpointPicker
    from kvmesh.epp.server import EppServer, serve_forever
    from kvmesh.routing.loop import loop_factory

    try:
        picker = EndpointPicker(cfg)
        discovery = KubeDiscovery(cfg.kube) if cfg.kube is not None else None
        server = EppServer(cfg, picker, discovery)
    except (OSError, ValueError) as exc:
        print(f"kvmesh epp: {exc}", file=sys.stderr)
        return 2
    where = (
        f"pool {cfg.kube.namespace}/{cfg.kube.pool}" if cfg.kube else f"{len(cfg.routing.replicas)} endpoints"
    )
    print(
        f"kvmesh epp: {cfg.routing.policy} policy over {where}; ext_proc {cfg.host}:{cfg.grpc_port} "
        f"({'TLS' if cfg.secure_serving else 'plaintext'}), "
        f"health :{cfg.health_port}, metrics :{cfg.metrics_port}"
    )
    try:
        with asyncio.Runner(loop_factory=loop_factory()) as runner:  # uvloop: less per message
            runner.run(serve_forever(server))
    except ProcessError as exc:
        print(f"kvmesh epp: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    return 0
