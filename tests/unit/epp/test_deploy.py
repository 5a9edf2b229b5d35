"""deploy/: the kustomize base renders (kubectl's built-in kustomize) and every rendered
object validates: built-in kinds against the Kubernetes OpenAPI schemas of
``kubernetes-validate`` (strict: unknown fields fail), InferencePool / HTTPRoute /
ServiceMonitor / PodMonitor against schema subsets written from their upstream CRDs
(tests/unit/epp/schemas/, versions in each file's ``$comment``). Then the pieces must fit
each other (selector -> pod labels, ports, RBAC, configs that kvmesh itself parses), and
the Grafana dashboard may only query metric names the code exports.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "deploy"
SCHEMAS = Path(__file__).parent / "schemas"
CRD_SCHEMAS = {
    "InferencePool": "inferencepool-v1.json",
    "HTTPRoute": "httproute-v1.json",
    "ServiceMonitor": "monitoring-v1.json",
    "PodMonitor": "monitoring-v1.json",
}


@pytest.fixture(scope="module")
def objects() -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("no kubectl (apt-get install kubernetes-client): cannot render the kustomize base")
    out = subprocess.run(
        [kubectl, "kustomize", str(DEPLOY / "kustomize" / "base")], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def by_kind(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    got = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(got) == 1, f"{kind} {name or ''}: {len(got)} objects"
    return got[0]


def test_every_object_validates(objects: list[dict[str, Any]]) -> None:
    import kubernetes_validate

    version = kubernetes_validate.latest_version()
    kinds = {o["kind"] for o in objects}
    assert {"Deployment", "ConfigMap", "InferencePool", "Service", "StatefulSet", "HTTPRoute", "Role",
            "RoleBinding", "ServiceAccount", "ServiceMonitor"} <= kinds  # fmt: skip
    for obj in objects:
        if obj["kind"] in CRD_SCHEMAS:
            schema = json.loads((SCHEMAS / CRD_SCHEMAS[obj["kind"]]).read_text())
            jsonschema.validate(obj, schema)
        else:
            kubernetes_validate.validate(obj, version, strict=True)


def test_a_broken_object_is_caught() -> None:
    """The validators do reject: a typo'd field and a wrong type."""
    import kubernetes_validate

    svc = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"}, "spec": {"prots": []}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(svc, kubernetes_validate.latest_version(), strict=True)
    spec = {"selector": {"matchLabels": {"a": "b"}}, "targetPorts": [{"number": "8000"}],
            "endpointPickerRef": {"name": "e"}}  # fmt: skip
    pool = {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": "p"},
    }
    pool["spec"] = spec
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(pool, json.loads((SCHEMAS / "inferencepool-v1.json").read_text()))


def test_the_pieces_fit(objects: list[dict[str, Any]]) -> None:
    pool = by_kind(objects, "InferencePool")["spec"]
    workers = by_kind(objects, "Deployment", "kvmesh-vllm")["spec"]["template"]
    labels = workers["metadata"]["labels"]
    assert pool["selector"]["matchLabels"].items() <= labels.items()
    vllm = workers["spec"]["containers"][0]
    assert pool["targetPorts"][0]["number"] in [p["containerPort"] for p in vllm["ports"]]

    epp_svc = by_kind(objects, "Service", pool["endpointPickerRef"]["name"])
    assert pool["endpointPickerRef"]["port"]["number"] in [p["port"] for p in epp_svc["spec"]["ports"]]
    epp_dep = by_kind(objects, "Deployment", "kvmesh-epp")["spec"]["template"]
    assert epp_svc["spec"]["selector"].items() <= epp_dep["metadata"]["labels"].items()
    epp = epp_dep["spec"]["containers"][0]
    assert {p["containerPort"] for p in epp["ports"]} == {9002, 9003, 9090}
    assert epp["readinessProbe"]["grpc"] == {"port": 9003, "service": "readiness"}

    route = by_kind(objects, "HTTPRoute")["spec"]
    backend = route["rules"][0]["backendRefs"][0]
    assert (backend["group"], backend["kind"]) == ("inference.networking.k8s.io", "InferencePool")
    assert backend["name"] == by_kind(objects, "InferencePool")["metadata"]["name"]

    # RBAC: the EPP's service account may read the pool and watch pods.
    sa = epp_dep["spec"]["serviceAccountName"]
    binding = by_kind(objects, "RoleBinding")
    assert binding["subjects"][0]["name"] == sa
    rules = by_kind(objects, "Role", binding["roleRef"]["name"])["rules"]
    for group, resource in (("inference.networking.k8s.io", "inferencepools"), ("", "pods")):
        assert any(group in r["apiGroups"] and resource in r["resources"]
                   and {"get", "list", "watch"} <= set(r["verbs"]) for r in rules), resource  # fmt: skip

    # ServiceMonitor targets a named port that the EPP Service has.
    sm = by_kind(objects, "ServiceMonitor")["spec"]
    assert sm["selector"]["matchLabels"].items() <= epp_svc["metadata"]["labels"].items()
    assert sm["endpoints"][0]["port"] in [p["name"] for p in epp_svc["spec"]["ports"]]


def test_configs_parse_as_kvmesh_parses_them(objects: list[dict[str, Any]]) -> None:
    from kvmesh.epp.cli import config_from_args, register
    from kvmesh.epp.config import EppConfig

    data = by_kind(objects, "ConfigMap", "kvmesh-epp-config")["data"]["epp.yaml"]
    cfg = EppConfig.from_dict(yaml.safe_load(data))
    assert cfg.grpc_port == 9002 and cfg.health_port == 9003 and cfg.metrics_port == 9090
    # The container's args are a valid `kvmesh epp` command line.
    import argparse

    epp = by_kind(objects, "Deployment", "kvmesh-epp")["spec"]["template"]["spec"]["containers"][0]
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = [
        a.replace("$(POD_NAMESPACE)", "inference").replace("/etc/kvmesh/epp.yaml", "-") for a in epp["args"]
    ]
    parsed = parser.parse_args([a for a in args if not a.startswith("--config")])
    full = config_from_args(parsed)
    assert full.kube is not None and (full.kube.pool, full.kube.namespace) == ("kvmesh-pool", "inference")

    vcfg = by_kind(objects, "ConfigMap", "kvmesh-vllm-config")["data"]
    kv = json.loads(vcfg["KV_TRANSFER_CONFIG"])
    assert (
        kv["kv_connector"] == "KVMeshConnector"
        and kv["kv_connector_module_path"] == "kvmesh.integrations.vllm"
    )
    redis_svc = by_kind(objects, "Service", "kvmesh-redis")
    assert kv["kv_connector_extra_config"]["remote_url"].startswith(
        f"redis://{redis_svc['metadata']['name']}:6379"
    )
    events = json.loads(vcfg["KV_EVENTS_CONFIG"])
    pod = by_kind(objects, "Deployment", "kvmesh-vllm")["spec"]["template"]
    assert events["endpoint"] == f"tcp://*:{pod['metadata']['annotations']['kvmesh.io/kv-events-port']}"


def test_dockerfiles() -> None:
    epp = (DEPLOY / "docker" / "Dockerfile.epp").read_text()
    assert '".[epp]"' in epp and 'ENTRYPOINT ["kvmesh"]' in epp and "EXPOSE 9002 9003 9090" in epp
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {"grpcio", "xds-protos", "grpcio-health-checking"} <= {
        re.split(r"[<>=]", d)[0] for d in extras["epp"]
    }
    worker = (DEPLOY / "docker" / "Dockerfile.vllm").read_text()
    assert "vllm/vllm-openai" in worker and "import kvmesh.integrations.vllm" in worker


def exported_names() -> set[str]:
    """Every sample name kvmesh's own exporters produce (EPP, router, tiers)."""
    from prometheus_client import CollectorRegistry

    from kvmesh.epp.metrics import EppMetrics
    from kvmesh.metrics import TierMetrics, prometheus_collector
    from kvmesh.router.metrics import RouterMetrics

    names: set[str] = set()
    epp, router = EppMetrics(), RouterMetrics()
    tiers = CollectorRegistry()
    tiers.register(prometheus_collector({"cpu": TierMetrics("cpu")}))
    for reg in (epp.registry, router.registry, tiers):
        for fam in reg.collect():
            names.add(fam.name)
            for suffix in ("_total", "_bucket", "_sum", "_count", "_created"):
                names.add(fam.name + suffix)
    return names


def test_dashboard_queries_only_exported_metrics() -> None:
    dash = json.loads((DEPLOY / "grafana" / "kvmesh-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(exprs) >= 10
    ours = exported_names()
    vllm_src = _vllm_metrics_source()
    seen = set()
    for expr in exprs:
        for name in re.findall(r"\b((?:kvmesh|vllm:)[a-zA-Z0-9_:]*)", expr):
            seen.add(name)
            if name.startswith("vllm:"):
                base = re.sub(r"_(total|bucket|sum|count)$", "", name)
                if vllm_src is not None:
                    assert f'"{base}"' in vllm_src, f"vLLM exports no {base}"
            else:
                assert name in ours, f"dashboard queries {name}, which kvmesh does not export"
    # What the issue asks the dashboard to show.
    needed = {"kvmesh_hits_total", "kvmesh_epp_decisions_total", "vllm:time_to_first_token_seconds_bucket",
              "vllm:num_requests_waiting", "kvmesh_tier_bytes_used", "kvmesh_tier_up"}  # fmt: skip
    assert needed <= seen, needed - seen


def _vllm_metrics_source() -> str | None:
    """The text of vLLM's metrics modules (found, not imported: importing vllm takes seconds)."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations))) / "v1" / "metrics"
    return "".join(p.read_text(errors="replace") for p in root.glob("*.py"))
