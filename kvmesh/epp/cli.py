"""``kvmesh epp``: the endpoint picker for a Gateway API Inference Extension gateway.

Flags override ``--config`` (an :class:`~kvmesh.epp.config.EppConfig` YAML; its ``routing:``
takes the routing keys of ``kvmesh router``), which overrides the defaults. The reference
EPP's flags and config file are read too (:mod:`kvmesh.epp.upstream`), so its Helm charts run
``kvmesh epp`` with only the image changed. Heavy imports (grpc, tokenizers) wait until the
command runs, so ``kvmesh --help`` stays fast.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from kvmesh.epp import upstream
from kvmesh.epp.config import POOL_GROUPS
from kvmesh.errors import ConfigError, ProcessError
from kvmesh.routing.config import POLICIES

log = logging.getLogger("kvmesh.epp")


def register(sub: Any) -> argparse.ArgumentParser:
    """Add the ``epp`` subcommand to ``sub`` (from ``add_subparsers``)."""
    p: argparse.ArgumentParser = sub.add_parser(
        "epp",
        help="Envoy ext_proc endpoint picker (Gateway API Inference Extension) with kvmesh's scoring",
        description="Pick the model server for each request a gateway asks about, by prefix-cache hit, "
        "load and session: the kvmesh routing core behind Envoy's ext_proc protocol.",
    )
    p.add_argument(
        "--config",
        "--config-file",
        help="YAML file with EppConfig keys (routing: takes the routing keys of kvmesh router), or the "
        "reference EPP's EndpointPickerConfig",
    )
    p.add_argument("--config-text", help="the same YAML given inline, instead of a file")
    p.add_argument("--model", help="model directory; its tokenizer is used to tokenize like the engine")
    p.add_argument(
        "--endpoint",
        action="append",
        default=[],
        metavar="IP:PORT[,events=EP][,replay=EP]",
        help="a static model server endpoint (repeat the flag); events/replay: its ZMQ KV-event endpoints",
    )
    p.add_argument(
        "--pool", "--pool-name", help="InferencePool name: discover its pods from the Kubernetes API"
    )
    p.add_argument(
        "--pool-namespace",
        help="namespace of the InferencePool or the selected pods (default: $NAMESPACE, or default)",
    )
    p.add_argument(
        "--pool-group", choices=sorted(POOL_GROUPS), help="the InferencePool's API group (default: "
        "inference.networking.k8s.io, v1)"
    )  # fmt: skip
    p.add_argument(
        "--endpoint-selector",
        type=upstream.endpoint_selector,
        metavar="KEY=VALUE,...",
        help="no InferencePool: route to the ready pods with these labels (with --endpoint-target-ports)",
    )
    p.add_argument(
        "--endpoint-target-ports",
        type=upstream.target_ports,
        metavar="PORT,...",
        help="the selected pods' ports",
    )
    p.add_argument("--policy", choices=POLICIES, help="routing policy (default: kvmesh)")
    p.add_argument("--served-model-name", action="append", dest="served_model_names", help="accepted model")
    p.add_argument(
        "--host", help="address to listen on (default: $POD_IP; in a pod without it 0.0.0.0; else 127.0.0.1)"
    )
    p.add_argument("--grpc-port", type=int, help="ext_proc port (default 9002)")
    p.add_argument("--health-port", "--grpc-health-port", type=int, help="gRPC health port (default 9003)")
    p.add_argument("--metrics-port", type=int, help="Prometheus port (default 9090)")
    p.add_argument("--fallbacks", type=int, help="fallback endpoints after the primary (default 0)")
    p.add_argument(
        "--cert-path", help="directory with tls.crt and tls.key for ext_proc's TLS (default: self-signed)"
    )
    p.add_argument("--secure-serving", action=upstream.GoBool, help="serve ext_proc over TLS (default: on)")
    p.add_argument("--log-level", default=None, choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    ref = p.add_argument_group(
        "the reference EPP's flags",
        "accepted so that the Inference Extension's and llm-d's Helm charts start kvmesh epp unchanged",
    )
    ref.add_argument("--zap-encoder", choices=("json", "console"), help="log lines as JSON objects or text")
    ref.add_argument(
        "--zap-log-level",
        type=upstream.zap_level,
        help="debug, info, error, panic, or a verbosity (1 and up: debug)",
    )
    ref.add_argument("-v", "--v", type=int, dest="verbosity", help="log verbosity (4 and up: debug)")
    ref.add_argument(
        "--tracing", action=upstream.GoBool, help="kvmesh epp emits no OpenTelemetry traces (true: a warning)"
    )
    ref.add_argument(
        "--metrics-endpoint-auth",
        action=upstream.GoBool,
        help="/metrics is unauthenticated (true: a warning)",
    )
    ref.add_argument(
        "--ha-enable-leader-election",
        action=upstream.GoBool,
        help="every replica serves: each reads the KV events itself",
    )
    ref.add_argument(
        "--enable-cert-reload",
        action=upstream.GoBool,
        help="the certificate is read at start (true: a warning)",
    )
    ref.add_argument("--health-checking", action=upstream.GoBool, help="always on")
    for flag in upstream.OTHER_SERVER_FLAGS:
        ref.add_argument(f"--{flag.replace('_', '-')}", dest=flag, help="other servers' metrics: refused")
    for flag, why in upstream.UNUSED_FLAGS.items():
        ref.add_argument(f"--{flag}", dest=f"unused_{flag.replace('-', '_')}", metavar="VALUE", help=why)
    p.set_defaults(func=run_epp)
    return p


def load_config(args: argparse.Namespace) -> tuple[Any, bool, dict[str, Any]]:
    """The ``--config``/``--config-text`` file as an EppConfig, whether it was the reference
    EPP's ``EndpointPickerConfig`` (translated: :mod:`kvmesh.epp.upstream`), and the pods'
    KV-event ports it named (``kube.events_port``, ``kube.replay_port``)."""
    from kvmesh.epp.config import EppConfig

    if args.config and args.config_text:
        raise ConfigError("give --config-file or --config-text, not both")
    if not args.config and not args.config_text:
        return EppConfig(), False, {}
    where = args.config or "--config-text"
    try:
        text = Path(args.config).read_text() if args.config else args.config_text
        doc = yaml.safe_load(text) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read epp config {where}: {exc}") from exc
    if not upstream.is_picker_config(doc):
        return EppConfig.from_dict(doc), False, {}
    try:
        data, skipped = upstream.picker_config(doc)
    except ConfigError:
        raise
    except (TypeError, ValueError, AttributeError) as exc:  # a shape the checks did not foresee
        raise ConfigError(f"{where}: malformed {upstream.PICKER_KIND}: {exc}") from exc
    log.info(
        "%s: the reference EPP's %s, read as policy %s",
        where,
        upstream.PICKER_KIND,
        data["routing"]["policy"],
    )
    for note in skipped:
        log.info("%s: %s", where, note)
    events = data.pop("kube_events", {})
    return EppConfig.from_dict(data), True, events


def _kube(args: argparse.Namespace, base: Any, events: dict[str, Any]) -> Any:
    """Pod discovery: the flags' pool or selector over the config file's ``kube:`` (whose
    other keys, such as ``events_port``, stay), plus the KV-event ports a reference
    EndpointPickerConfig named."""
    from kvmesh.epp.config import KubeConfig

    if args.pool and args.endpoint_selector:
        raise ConfigError("give --pool-name or --endpoint-selector, not both")
    fields: dict[str, Any] = base.kube.model_dump() if base.kube is not None else {}
    # The flag, then the file's own key, then the pod's namespace (the charts' $NAMESPACE).
    in_file = (
        fields.get("namespace")
        if base.kube is not None and "namespace" in base.kube.model_fields_set
        else None
    )
    namespace = args.pool_namespace or in_file or os.environ.get("NAMESPACE") or "default"
    if args.pool:
        # The flags name the pool: its group is theirs too (the reference's default without one).
        fields.update(pool=args.pool, selector=None, target_ports=(), namespace=namespace)
        fields["group"] = args.pool_group or KubeConfig.model_fields["group"].default
    elif args.endpoint_selector:
        if not args.endpoint_target_ports:
            raise ConfigError("--endpoint-selector needs --endpoint-target-ports")
        fields.update(pool=None, selector=args.endpoint_selector, target_ports=args.endpoint_target_ports,
                      namespace=namespace)  # fmt: skip
    else:
        for flag, value in (("--pool-namespace", args.pool_namespace), ("--pool-group", args.pool_group),
                            ("--endpoint-target-ports", args.endpoint_target_ports)):  # fmt: skip
            if value:
                raise ConfigError(f"{flag} needs --pool (or --endpoint-selector)")
        if base.kube is None:
            if events:
                log.warning("kvEventsConfig: no pods are discovered, so no pod's events are read; static "
                            "endpoints name theirs (--endpoint IP:PORT,events=tcp://...)")  # fmt: skip
            return None
        fields["namespace"] = namespace
    fields.update(events)
    try:
        return KubeConfig(**fields)
    except ValidationError as exc:
        raise ConfigError(f"invalid pod discovery flags: {exc.errors()[0]['msg']}") from exc


def _default_host() -> str:
    """Where to listen when nothing says: the pod's IP if the pod spec passes it; in a pod
    without it every address (a pod's network namespace holds only its own); else loopback."""
    if os.environ.get("POD_IP"):
        return os.environ["POD_IP"]
    return "0.0.0.0" if os.environ.get("KUBERNETES_SERVICE_HOST") else "127.0.0.1"


def config_from_args(args: argparse.Namespace) -> Any:
    from kvmesh.epp.config import EppConfig
    from kvmesh.epp.scoring import endpoint_config

    refused = [f for f in upstream.OTHER_SERVER_FLAGS if getattr(args, f)]
    if refused:
        names = ", ".join("--" + f.replace("_", "-") for f in refused)
        raise ConfigError(
            f"{names}: other model servers' metrics (triton-tensorrt-llm); kvmesh epp reads vLLM's"
        )
    base, translated, events = load_config(args)
    overrides: dict[str, Any] = {}
    if translated and args.model:
        overrides["tokenizer"] = "local"  # the reference config asked for remote only for want of a model
    routing = base.routing.merged(
        model=args.model,
        policy=args.policy,
        served_model_names=tuple(args.served_model_names) if args.served_model_names else None,
        replicas=tuple(endpoint_config(spec) for spec in args.endpoint) or None,
        **overrides,
    )
    data = base.model_dump()
    data["routing"] = routing
    data["kube"] = _kube(args, base, events)
    if args.host is None and "host" not in base.model_fields_set:
        data["host"] = _default_host()
    flags = ("host", "grpc_port", "health_port", "metrics_port", "fallbacks", "cert_path", "secure_serving")
    for key in flags:
        if getattr(args, key) is not None:
            data[key] = getattr(args, key)
    cfg = EppConfig.from_dict(data)
    if not cfg.routing.replicas and cfg.kube is None:
        raise ConfigError(
            "no endpoints: give --endpoint IP:PORT (repeatable), --pool NAME, --endpoint-selector, or kube: "
            "in --config"
        )
    _accepted_flags(args)
    return cfg


def _accepted_flags(args: argparse.Namespace) -> None:
    """Say what a reference-EPP flag asked for that kvmesh epp does not do."""
    if args.tracing:
        log.warning("--tracing: kvmesh epp emits no OpenTelemetry traces; its decisions are in /metrics "
                    "and /kvmesh/state")  # fmt: skip
    if args.metrics_endpoint_auth:
        log.warning("--metrics-endpoint-auth: /metrics is served without authentication; restrict it "
                    "with a NetworkPolicy")  # fmt: skip
    if args.enable_cert_reload:
        log.warning("--enable-cert-reload: the certificate is read at start; restart to rotate it")
    for flag, why in upstream.UNUSED_FLAGS.items():
        if getattr(args, f"unused_{flag.replace('-', '_')}") is not None:
            log.warning("--%s: accepted and not used: %s", flag, why)
    if args.ha_enable_leader_election:
        log.info(
            "--ha-enable-leader-election: no leader needed; every replica reads the KV events and serves"
        )


def _log_level(args: argparse.Namespace) -> str:
    if args.log_level:
        return str(args.log_level)
    if args.zap_log_level:
        return str(args.zap_log_level)
    return "DEBUG" if args.verbosity is not None and args.verbosity >= 4 else "INFO"


def run_epp(args: argparse.Namespace) -> int:
    handler = logging.StreamHandler()
    if args.zap_encoder == "json":
        handler.setFormatter(upstream.JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=_log_level(args), handlers=[handler])
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
    if cfg.kube is None:
        where = f"{len(cfg.routing.replicas)} endpoints"
    elif cfg.kube.pool is None:
        labels = ",".join(f"{k}={v}" for k, v in sorted((cfg.kube.selector or {}).items()))
        where = f"pods {cfg.kube.namespace}/{labels}"
    else:
        where = f"pool {cfg.kube.namespace}/{cfg.kube.pool}"
    if cfg.routing.tokenizer == "remote":
        tokens = "prompts tokenized by the endpoints' /tokenize"
    else:
        tokens = f"tokenizer {cfg.routing.model}" if cfg.routing.model else "no tokenizer (--model)"
        if not cfg.routing.model and cfg.routing.policy in ("kvmesh", "cost", "prefix"):
            log.warning("no --model given: requests are routed by load and session only, not by prefix "
                        "(routing.tokenizer: remote asks the endpoints)")  # fmt: skip
    print(
        f"kvmesh epp: {cfg.routing.policy} policy over {where}, {tokens}; "
        f"ext_proc {cfg.host}:{cfg.grpc_port} "
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
