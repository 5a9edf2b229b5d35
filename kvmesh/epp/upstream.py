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

So a user swaps the EPP image and keeps the chart. What kvmesh cannot honour is refused with a
message: metric names of other model servers (kvmesh reads vLLM's), several scheduling
profiles (prefill/decode handlers), a plugin it does not know.
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

_PREFIX = frozenset({"prefix-cache-scorer", "precise-prefix-cache-scorer", "prefix-cache-affinity-filter"})
_LOAD = frozenset(
    {"queue-scorer", "kv-cache-utilization-scorer", "active-request-scorer", "load-aware-scorer"}
)
_SESSION = frozenset({"session-affinity-scorer"})
_LATENCY = frozenset(
    {"latency-scorer", "predicted-latency-producer", "slo-headroom-tier-filter", "latency-slo-admitter"}
)
_RANDOM = frozenset({"random-picker", "weighted-random-picker"})
# Accepted and needing nothing from kvmesh: it picks the best-scored endpoint, reads vLLM's
# metrics itself, parses the request body itself and routes LoRA adapters in every policy.
_BUILT_IN = frozenset(
    {"max-score-picker", "single-profile-handler", "metrics-data-source", "core-metrics-extractor",
     "lora-affinity-scorer"}
)  # fmt: skip
KNOWN_PLUGINS = _PREFIX | _LOAD | _SESSION | _LATENCY | _RANDOM | _BUILT_IN

# The reference EPP's flags for other model servers' metric names (its triton-tensorrt-llm mode).
OTHER_SERVER_FLAGS = (
    "total_queued_requests_metric", "total_running_requests_metric", "kv_cache_usage_percentage_metric",
    "lora_info_metric", "cache_info_metric",
)  # fmt: skip

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
    for i, plugin in enumerate(plugins):
        if not isinstance(plugin, Mapping) or not isinstance(plugin.get("type"), str):
            raise ConfigError(f"{PICKER_KIND}: plugins[{i}] needs a type")
        types[str(plugin.get("name") or plugin["type"])] = plugin["type"]
    profiles = doc.get("schedulingProfiles") or []
    if not isinstance(profiles, Sequence) or isinstance(profiles, str):
        raise ConfigError(f"{PICKER_KIND}: schedulingProfiles must be a list")
    if len(profiles) > 1:
        names = [p.get("name") for p in profiles if isinstance(p, Mapping)]
        raise ConfigError(
            f"{PICKER_KIND}: {len(profiles)} scheduling profiles ({names}); kvmesh epp schedules one "
            "(prefill/decode profiles: kvmesh's own PD, docs/guides/pd.md)"
        )
    used = set(types.values())
    notes: list[str] = []
    if profiles:
        refs = profiles[0].get("plugins") if isinstance(profiles[0], Mapping) else None
        if not isinstance(refs, Sequence) or isinstance(refs, str):
            raise ConfigError(f"{PICKER_KIND}: schedulingProfiles[0].plugins must be a list")
        used = set()
        for ref in refs:
            name = ref.get("pluginRef") if isinstance(ref, Mapping) else None
            if name not in types:
                raise ConfigError(f"{PICKER_KIND}: pluginRef {name!r} names no plugin in plugins")
            used.add(types[name])
            if isinstance(ref, Mapping) and ref.get("weight") is not None:
                notes.append(f"{name} weight {ref['weight']}")
    unknown = sorted(t for t in set(types.values()) if t not in KNOWN_PLUGINS and not t.endswith("-parser"))
    if unknown:
        raise ConfigError(
            f"{PICKER_KIND}: kvmesh epp does not know plugin type(s) {', '.join(unknown)}; it maps "
            f"{', '.join(sorted(KNOWN_PLUGINS))} and *-parser. Or give a kvmesh EppConfig in the file "
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
    skipped = [f"scorer weights not carried over ({', '.join(notes)})"] if notes else []
    extra = sorted(set(doc) - {"apiVersion", "kind", "plugins", "schedulingProfiles", "requestHandler"})
    if extra:
        skipped.append(f"not read: {', '.join(map(str, extra))}")
    return {"routing": routing}, skipped


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
