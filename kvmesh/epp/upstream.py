"""What the reference endpoint picker's deployments hand ``kvmesh epp``, read as kvmesh's own.

The Gateway API Inference Extension's ``inferencepool`` Helm chart, and llm-d-router's that
followed it, start their EPP container with one command line and mount one config file:

* ``--pool-name``, ``--pool-namespace``, ``--pool-group`` (or, with no pool,
  ``--endpoint-selector k=v,...`` and ``--endpoint-target-ports``), ``--grpc-health-port``,
  ``--zap-encoder json``, ``--config-file /config/<file>``, ``--tracing=false``, and with
  more than one replica ``--ha-enable-leader-election``; their ``flags:`` value adds
  ``--key=value`` for any other. Go booleans (``--secure-serving=false``) are accepted.
* an ``EndpointPickerConfig`` (``plugins`` and ``schedulingProfiles``): which scorers a
  request is weighed by. Its scorers choose a kvmesh policy (:func:`picker_config`); their
  weights do not carry over, as kvmesh's policies price their terms in their own units.
  llm-d's ``kvEventsConfig`` says where the pods' KV events are: on each pod's port
  (``kube.events_port``), or published to the EPP (``events_bind``, :mod:`kvmesh.events.sink`).

So a user swaps the EPP image and keeps the chart. What kvmesh cannot honour is refused with a
message: metric names of other model servers (kvmesh reads vLLM's), several scheduling
profiles (prefill/decode handlers), bodies it cannot read, a plugin it does not know.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from kvmesh.errors import ConfigError

# apiVersions of the reference EPP's config file: the Inference Extension's, then llm-d's.
PICKER_API_VERSIONS = ("inference.networking.x-k8s.io/v1alpha1", "llm-d.ai/v1alpha1")
PICKER_KIND = "EndpointPickerConfig"

# Plugin types of the reference EPP (the Inference Extension's and llm-d-router's registries).
_PREFIX = frozenset(
    {"prefix-cache-scorer", "precise-prefix-cache-scorer", "prefix-cache-affinity-filter",
     "approx-prefix-cache-producer", "precise-prefix-cache-producer"}
)  # fmt: skip
_LOAD = frozenset(
    {"queue-scorer", "kv-cache-utilization-scorer", "active-request-scorer", "load-aware-scorer",
     "running-requests-size-scorer", "token-load-scorer", "no-hit-lru-scorer", "inflight-load-producer"}
)  # fmt: skip
_SESSION = frozenset({"session-affinity-scorer", "session-affinity-filter", "session-id-producer"})
_LATENCY = frozenset(
    {"latency-scorer", "predicted-latency-scorer", "predicted-latency-producer", "slo-headroom-tier-filter",
     "latency-slo-admitter"}
)  # fmt: skip
_RANDOM = frozenset({"random-picker", "weighted-random-picker"})
# llm-d's plugins that subscribe to the pods' KV events (kvEventsConfig, with its defaults).
_PRECISE = frozenset({"precise-prefix-cache-scorer", "precise-prefix-cache-producer"})
# Accepted and needing nothing from kvmesh: it picks the best-scored endpoint, tokenizes, reads
# vLLM's metrics and the served models itself and routes LoRA adapters in every policy.
_BUILT_IN = frozenset(
    {"max-score-picker", "single-profile-handler", "metrics-data-source", "core-metrics-extractor",
     "model-server-protocol-metrics", "models-data-source", "models-data-extractor", "token-producer",
     "tokenizer", "lora-affinity-scorer"}
)  # fmt: skip
# Request parsers: kvmesh reads OpenAI JSON bodies (completions, chat) whatever the file says.
_PARSERS = frozenset({"openai-parser", "vllmhttp-parser", "passthrough-parser"})
_OTHER_BODIES = "kvmesh epp reads OpenAI JSON bodies (completions, chat)"
_REFUSED = {
    "vllmgrpc-parser": f"vLLM's gRPC protocol: {_OTHER_BODIES}",
    "anthropic-parser": f"Anthropic's Messages API: {_OTHER_BODIES}",
    "vertexai-parser": f"Vertex AI's API: {_OTHER_BODIES}",
    "sglanghttp-parser": f"SGLang's API: {_OTHER_BODIES} for vLLM",
}
KNOWN_PLUGINS = _PREFIX | _LOAD | _SESSION | _LATENCY | _RANDOM | _BUILT_IN | _PARSERS

# The reference EPP's flags for other model servers' metric names (its triton-tensorrt-llm mode).
OTHER_SERVER_FLAGS = (
    "total_queued_requests_metric", "total_running_requests_metric", "kv_cache_usage_percentage_metric",
    "lora_info_metric", "cache_info_metric",
)  # fmt: skip

# The reference EPP's other flags a chart's ``flags:`` may add: accepted with a warning, as
# what they tune is kvmesh's own business or not done by it.
UNUSED_FLAGS = {
    "enable-pprof": "kvmesh epp serves no pprof",
    "disable-endpoint-subset-filter": "the subset hint is always honoured",
    "refresh-metrics-interval": "routing.metrics_interval_s sets the scrape interval",
    "refresh-prometheus-metrics-interval": "kvmesh epp's metrics are computed when scraped",
    "metrics-staleness-threshold": "routing.cost.gauge_stale_s sets when gauges go stale",
    "model-server-metrics-scheme": "the pods' /metrics is read over http",
    "model-server-metrics-path": "the pods' /metrics is read",
    "model-server-metrics-port": "the pods' /metrics is read on their serving port",
    "model-server-metrics-https-insecure-skip-verify": "the pods' /metrics is read over http",
    "zap-devel": "--zap-encoder and --zap-log-level set the logs",
    "zap-stacktrace-level": "errors are logged with their traceback",
    "zap-time-encoding": "log times are Unix seconds",
}

_TRUE = frozenset({"1", "t", "T", "true", "TRUE", "True"})
_FALSE = frozenset({"0", "f", "F", "false", "FALSE", "False"})


def go_bool(text: str) -> bool:
    """A boolean flag's value as Go's ``strconv.ParseBool`` reads it (``--tracing=false``)."""
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {text!r} (true or false)")


class GoBool(argparse.Action):
    """``--name``, ``--name=true|false`` (Go's spelling: the charts' ``flags:`` render it so)
    and ``--no-name``."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        names = [*option_strings, *(f"--no-{s[2:]}" for s in option_strings if s.startswith("--"))]
        kwargs.update(nargs="?", type=go_bool, metavar="true|false")
        super().__init__(names, dest, **kwargs)

    def __call__(
        self, parser: argparse.ArgumentParser, ns: argparse.Namespace, values: Any, option: str | None = None
    ) -> None:
        if option is not None and option.startswith("--no-"):
            if values is not None:
                parser.error(f"{option} takes no value")
            values = False
        setattr(ns, self.dest, True if values is None else values)


def zap_level(text: str) -> str:
    """``--zap-log-level`` (controller-runtime's): a level name, or a verbosity (1 and up is
    debug output) -> a Python logging level."""
    names = {"debug": "DEBUG", "info": "INFO", "error": "ERROR", "panic": "CRITICAL"}
    if text.lower() in names:
        return names[text.lower()]
    try:
        return "DEBUG" if int(text) > 0 else "INFO"
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--zap-log-level: debug, info, error, panic or a number, got {text!r}"
        ) from None


def endpoint_selector(text: str) -> dict[str, str]:
    """``--endpoint-selector``: comma-separated ``key=value`` pairs (as the reference EPP
    takes them: no set-based expressions)."""
    labels: dict[str, str] = {}
    for part in text.split(","):
        key, eq, value = part.strip().partition("=")
        if not eq or not key.strip() or "=" in value or key.strip().endswith("!"):
            raise argparse.ArgumentTypeError(f"--endpoint-selector takes key=value pairs, got {part!r}")
        labels[key.strip()] = value.strip()
    return labels


def target_ports(text: str) -> tuple[int, ...]:
    """``--endpoint-target-ports``: comma-separated port numbers."""
    try:
        ports = tuple(int(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--endpoint-target-ports takes port numbers, got {text!r}"
        ) from None
    if not ports or any(not 0 < p < 65536 for p in ports):
        raise argparse.ArgumentTypeError(f"--endpoint-target-ports: ports 1-65535, got {text!r}")
    ports = tuple(dict.fromkeys(ports))  # the reference EPP drops repeats and takes at most 8
    if len(ports) > 8:
        raise argparse.ArgumentTypeError(f"--endpoint-target-ports: at most 8 ports, got {len(ports)}")
    return ports


def is_picker_config(doc: Any) -> bool:
    return isinstance(doc, Mapping) and doc.get("kind") == PICKER_KIND


def picker_config(doc: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """An ``EndpointPickerConfig`` as kvmesh EPP config data, and what was not carried over.

    The scheduling profile's plugins choose the policy: a latency predictor -> ``cost``
    (kvmesh's predicted TTFT); prefix and load or session -> ``kvmesh``; prefix alone ->
    ``prefix``; load alone -> ``least-loaded``; session alone -> ``kvmesh`` (its session term);
    a random picker with no scorer -> ``random``. A prefix scorer (or the cost policy) needs
    the prompt's tokens: with no ``--model`` to tokenize with, the replicas' ``/tokenize`` is
    asked (``routing.tokenizer: remote``); with none (llm-d's ``payload-agnostic.yaml``) the
    prompt is not tokenized.
    """
    version = doc.get("apiVersion")
    if version not in PICKER_API_VERSIONS:
        raise ConfigError(
            f"{PICKER_KIND} apiVersion {version!r}: kvmesh reads {', '.join(PICKER_API_VERSIONS)}"
        )
    plugins = doc.get("plugins") or []
    if not isinstance(plugins, Sequence) or isinstance(plugins, str):
        raise ConfigError(f"{PICKER_KIND}: plugins must be a list")
    types: dict[str, str] = {}  # plugin name (or type) -> type
    notes: list[str] = []
    events: dict[str, Any] = {}
    for i, plugin in enumerate(plugins):
        if not isinstance(plugin, Mapping) or not isinstance(plugin.get("type"), str):
            raise ConfigError(f"{PICKER_KIND}: plugins[{i}] needs a type")
        name = plugin.get("name") or plugin["type"]
        if not isinstance(name, str):
            raise ConfigError(f"{PICKER_KIND}: plugins[{i}].name must be a string")
        if name in types:
            raise ConfigError(f"{PICKER_KIND}: two plugins are named {name!r}")
        types[name] = plugin["type"]
        params: Mapping[str, Any] = (
            plugin["parameters"] if isinstance(plugin.get("parameters"), Mapping) else {}
        )
        if plugin["type"] == "core-metrics-extractor" and params.get("defaultEngine", "vllm") != "vllm":
            raise ConfigError(
                f"{PICKER_KIND}: core-metrics-extractor for {params['defaultEngine']!r} model servers; "
                "kvmesh epp reads vLLM's metrics"
            )
        if plugin["type"] in _PRECISE:
            found = _kv_events(params.get("kvEventsConfig"), notes, name)
            if events and found != events:
                raise ConfigError(f"{PICKER_KIND}: two kvEventsConfigs name different event ports")
            events = found
        unread = sorted(map(str, set(params) - {"kvEventsConfig"}))
        if unread and plugin["type"] not in ("metrics-data-source", "core-metrics-extractor"):
            notes.append(f"{name} parameters not read: {', '.join(unread)}")
    profiles = doc.get("schedulingProfiles") or []
    if not isinstance(profiles, Sequence) or isinstance(profiles, str):
        raise ConfigError(f"{PICKER_KIND}: schedulingProfiles must be a list")
    if len(profiles) > 1:
        names = [str(p.get("name")) for p in profiles if isinstance(p, Mapping)]
        raise ConfigError(
            f"{PICKER_KIND}: {len(profiles)} scheduling profiles ({', '.join(names)}); kvmesh epp schedules "
            "one (prefill/decode profiles: kvmesh's own PD, docs/guides/pd.md)"
        )
    used = set(types.values())
    weights: list[str] = []
    if profiles:
        refs = profiles[0].get("plugins") if isinstance(profiles[0], Mapping) else None
        if not isinstance(refs, Sequence) or isinstance(refs, str):
            raise ConfigError(f"{PICKER_KIND}: schedulingProfiles[0].plugins must be a list")
        used = set()
        for ref in refs:
            name = ref.get("pluginRef") if isinstance(ref, Mapping) else None
            if not isinstance(name, str) or name not in types:
                raise ConfigError(f"{PICKER_KIND}: pluginRef {name!r} names no plugin in plugins")
            used.add(types[name])
            if isinstance(ref, Mapping) and ref.get("weight") is not None:
                weights.append(f"{name} weight {ref['weight']}")
    refused = sorted(t for t in set(types.values()) if t in _REFUSED)
    if refused:
        raise ConfigError(f"{PICKER_KIND}: {refused[0]}: {_REFUSED[refused[0]]}")
    unknown = sorted(t for t in set(types.values()) if t not in KNOWN_PLUGINS)
    if unknown:
        raise ConfigError(
            f"{PICKER_KIND}: kvmesh epp does not know plugin type(s) {', '.join(unknown)}; it maps "
            f"{', '.join(sorted(KNOWN_PLUGINS))}. Or give a kvmesh EppConfig in the file "
            "(docs/getting-started/kubernetes.md)"
        )
    prefix, load, session = bool(used & _PREFIX), bool(used & _LOAD), bool(used & _SESSION)
    if used & _LATENCY:
        policy = "cost"
    elif prefix and (load or session):
        policy = "kvmesh"
    elif prefix:
        policy = "prefix"
    elif session:
        policy = "kvmesh"
    elif load:
        policy = "least-loaded"
    elif used & _RANDOM:
        policy = "random"
    else:
        raise ConfigError(f"{PICKER_KIND}: its profile has no scorer kvmesh maps ({sorted(used)})")
    routing: dict[str, Any] = {"policy": policy}
    if prefix or policy == "cost":
        routing["tokenizer"] = "remote"  # cli.py: local again when --model is given
    skipped = [f"scorer weights not carried over ({', '.join(weights)})"] if weights else []
    skipped += notes
    if "passthrough-parser" in types.values():
        skipped.append("passthrough-parser: bodies are still read as OpenAI JSON; others are refused (400)")
    extra = sorted(
        map(str, set(doc) - {"apiVersion", "kind", "plugins", "schedulingProfiles", "requestHandler"})
    )
    if extra:
        skipped.append(f"not read: {', '.join(extra)}")
    sink: dict[str, Any] = {k: events.pop(k) for k in ("events_bind", "events_topic") if k in events}
    return {"routing": routing, **sink, **({"kube_events": events} if events else {})}, skipped


def _kv_events(kv: Any, notes: list[str], name: str) -> dict[str, Any]:
    """llm-d's ``kvEventsConfig`` over its defaults (``discoverPods: true``, ``socketPort``
    5557, no replay): the EPP subscribes to each pod's publisher on ``socketPort`` (plus the
    pod's rank) and its replay socket on ``replaySocketPort``, as kvmesh does
    (``kube.events_port``/``replay_port``). A ``zmqEndpoint`` is bound for pods that publish
    to the EPP instead (``events_bind``, with ``topicFilter``: kvmesh's bound sink,
    :mod:`kvmesh.events.sink`), alone with ``discoverPods: false``."""
    kv = kv if kv is not None else {}
    if not isinstance(kv, Mapping):
        raise ConfigError(f"{PICKER_KIND}: {name}: kvEventsConfig must be a mapping")
    sink: dict[str, Any] = {}
    bind = kv.get("zmqEndpoint") or None  # "" is unset, as llm-d's omitempty reads it
    if bind is not None or kv.get("discoverPods", True) is False:
        if not isinstance(bind, str) or not bind.startswith("tcp://"):
            raise ConfigError(
                f"{PICKER_KIND}: {name}: kvEventsConfig.zmqEndpoint must be tcp://HOST:PORT for the pods to "
                f"publish to (needed with discoverPods: false), got {bind!r}"
            )
        topic = kv.get("topicFilter", "kv@")
        if not isinstance(topic, str):
            raise ConfigError(f"{PICKER_KIND}: {name}: kvEventsConfig.topicFilter must be a string")
        notes.append(f"{name} kvEventsConfig: the pods may publish to {bind} (topics kv@<ip:port>@<model>)")
        sink = {"events_bind": bind, "events_topic": topic}
    if kv.get("discoverPods", True) is False:
        return sink
    if "podDiscoveryConfig" in kv and kv["podDiscoveryConfig"] is None:
        notes.append(f"{name} podDiscoveryConfig: null: no pod is subscribed to")
        return sink
    found = kv.get("podDiscoveryConfig") or {}
    if not isinstance(found, Mapping):
        raise ConfigError(f"{PICKER_KIND}: {name}: kvEventsConfig.podDiscoveryConfig must be a mapping")
    out: dict[str, int] = {}
    for key, field, default in (("socketPort", "events_port", 5557), ("replaySocketPort", "replay_port", 0)):
        port = found.get(key, default)
        low = 1 if field == "events_port" else -(1 << 31)  # a replay port of 0 or less: none, as llm-d
        if isinstance(port, bool) or not isinstance(port, int) or not low <= port <= 65535:
            raise ConfigError(
                f"{PICKER_KIND}: {name}: podDiscoveryConfig.{key} must be a port number, got {port!r}"
            )
        if port > 0:
            out[field] = port
    notes.append(f"{name} kvEventsConfig: each pod's KV events on its port {out['events_port']}")
    return {**out, **sink}


class JsonFormatter(logging.Formatter):
    """One JSON object a line (``--zap-encoder json``), the keys zap's production encoder uses."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "level": record.levelname.lower(),
            "ts": record.created,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            out["error"] = self.formatException(record.exc_info)
        return json.dumps(out)
