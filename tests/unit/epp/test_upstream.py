"""``kvmesh epp`` started by the reference EPP's Helm charts: their command lines and config files.

The command lines below are what ``helm template`` rendered (helm 3.17.3) from the Gateway API
Inference Extension's ``inferencepool`` chart (branch release-1.3, EPP v1.3.1) and from
llm-d-router's ``llm-d-router-gateway`` and ``llm-d-router-standalone`` charts (main,
``ebab687``, 22 August 2026), with only the config path changed to the test's file. The
charts themselves are not here (no network in CI; their code stays theirs), so the renders are
recorded, as the API server's answers are in test_discovery.py. The last test runs discovery
over HTTP against a v1alpha2 pool, as the first chart's x-k8s.io mode deploys it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.epp import upstream
from kvmesh.epp.cli import config_from_args, register
from kvmesh.epp.config import KubeConfig
from kvmesh.epp.discovery import pool_selector
from kvmesh.epp.scoring import endpoint_config
from kvmesh.errors import ConfigError
from tests.waiting import wait_for

# The inferencepool chart's default-plugins.yaml (release-1.3).
GIE_DEFAULT = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
    weight: 2
  - pluginRef: kv-cache-utilization-scorer
    weight: 2
  - pluginRef: prefix-cache-scorer
    weight: 3
"""
# llm-d-router's default-plugins.yaml and payload-agnostic.yaml.
LLMD_DEFAULT = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
- type: metrics-data-source
  parameters: {scheme: "http", path: "/metrics", insecureSkipVerify: true}
- type: core-metrics-extractor
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: queue-scorer, weight: 2}
  - {pluginRef: kv-cache-utilization-scorer, weight: 2}
  - {pluginRef: prefix-cache-scorer, weight: 3}
"""
LLMD_AGNOSTIC = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: passthrough-parser
- type: active-request-scorer
- type: session-affinity-scorer
requestHandler:
  parsers:
  - pluginRef: passthrough-parser
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: active-request-scorer, weight: 1}
  - {pluginRef: session-affinity-scorer, weight: 1}
"""


def gie_args(conf: Path, group: str = "inference.networking.k8s.io", ha: bool = False) -> list[str]:
    return ["--pool-name", "demo", "--pool-namespace", "inference", "--pool-group", group,
            "--zap-encoder", "json", "--config-file", str(conf), *(["--ha-enable-leader-election"] * ha),
            "--v", "1", "--tracing=false"]  # fmt: skip


def llmd_args(conf: Path) -> list[str]:
    return ["--pool-name", "demo", "--pool-namespace", "inference", "--pool-group",
            "inference.networking.k8s.io", "--zap-encoder", "json", "--config-file", str(conf),
            "--grpc-health-port", "9003", "--tracing=false"]  # fmt: skip


def llmd_standalone_args(conf: Path) -> list[str]:
    return ["--endpoint-selector", "app=vllm", "--endpoint-target-ports", "8000", "--zap-encoder", "json",
            "--config-file", str(conf), "--ha-enable-leader-election", "--grpc-health-port", "9003",
            "--secure-serving=false", "--tracing=false"]  # fmt: skip


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["epp", *argv])


def written(tmp_path: Path, text: str, name: str = "default-plugins.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.fixture
def in_pod(monkeypatch: pytest.MonkeyPatch) -> None:
    """The environment the charts' pod gives the container (NAMESPACE from the downward API)."""
    monkeypatch.setenv("NAMESPACE", "inference")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.delenv("POD_IP", raising=False)


@pytest.mark.usefixtures("in_pod")
def test_the_inference_extension_chart_starts_kvmesh_epp(tmp_path: Path) -> None:
    cfg = config_from_args(parse(*gie_args(written(tmp_path, GIE_DEFAULT))))
    assert cfg.kube == KubeConfig(pool="demo", namespace="inference")
    assert cfg.routing.policy == "kvmesh" and cfg.routing.tokenizer == "remote"  # no model dir in the chart
    assert (cfg.grpc_port, cfg.health_port, cfg.metrics_port) == (9002, 9003, 9090)  # its probes and ports
    assert cfg.host == "0.0.0.0" and cfg.secure_serving  # reachable from the gateway; TLS as the reference's
    alpha = config_from_args(
        parse(*gie_args(written(tmp_path, GIE_DEFAULT), "inference.networking.x-k8s.io", True))
    )
    assert alpha.kube is not None and alpha.kube.group == "inference.networking.x-k8s.io"


@pytest.mark.usefixtures("in_pod")
def test_the_llm_d_router_charts_start_kvmesh_epp(tmp_path: Path) -> None:
    gateway = config_from_args(parse(*llmd_args(written(tmp_path, LLMD_DEFAULT))))
    assert gateway.kube is not None and gateway.kube.pool == "demo" and gateway.routing.policy == "kvmesh"
    alone = config_from_args(parse(*llmd_standalone_args(written(tmp_path, LLMD_DEFAULT))))
    assert alone.kube == KubeConfig(selector={"app": "vllm"}, target_ports=(8000,), namespace="inference")
    assert not alone.secure_serving  # --secure-serving=false, Go's spelling
    agnostic = config_from_args(parse(*llmd_args(written(tmp_path, LLMD_AGNOSTIC, "payload-agnostic.yaml"))))
    assert agnostic.routing.policy == "kvmesh" and agnostic.routing.tokenizer == "local"  # never tokenized


@pytest.mark.usefixtures("in_pod")
def test_flags_the_chart_adds_still_win(tmp_path: Path) -> None:
    """Its ``flags:`` value (llm-d renders ``--key=value``, the inferencepool chart ``--key
    value``): a tokenizer directory, a policy, a host."""
    args = gie_args(written(tmp_path, GIE_DEFAULT))
    cfg = config_from_args(parse(*args, "--model=/models/llama", "--policy", "cost", "--host=10.1.2.3"))
    assert cfg.routing.model == "/models/llama" and cfg.routing.tokenizer == "local"
    assert cfg.routing.policy == "cost" and cfg.host == "10.1.2.3"


def test_where_it_listens(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for var in ("POD_IP", "KUBERNETES_SERVICE_HOST"):
        monkeypatch.delenv(var, raising=False)
    assert config_from_args(parse("--endpoint", "10.0.0.5:8000")).host == "127.0.0.1"  # not in a pod
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    assert config_from_args(parse("--endpoint", "10.0.0.5:8000")).host == "0.0.0.0"
    monkeypatch.setenv("POD_IP", "10.4.0.7")
    assert config_from_args(parse("--endpoint", "10.0.0.5:8000")).host == "10.4.0.7"
    conf = written(tmp_path, "host: 127.0.0.2\n", "epp.yaml")  # a config file's host stands
    assert config_from_args(parse("--config", str(conf), "--endpoint", "10.0.0.5:8000")).host == "127.0.0.2"


@pytest.mark.parametrize(
    ("scorers", "policy", "tokenizer"),
    [
        (["queue-scorer", "prefix-cache-scorer"], "kvmesh", "remote"),
        (["precise-prefix-cache-scorer", "load-aware-scorer"], "kvmesh", "remote"),
        (["prefix-cache-scorer"], "prefix", "remote"),
        (["queue-scorer", "kv-cache-utilization-scorer"], "least-loaded", "local"),
        (["session-affinity-scorer"], "kvmesh", "local"),
        (["latency-scorer", "predicted-latency-producer", "prefix-cache-affinity-filter"], "cost", "remote"),
        (["predicted-latency-scorer"], "cost", "remote"),  # the inferencepool chart's latency predictor
        (["running-requests-size-scorer", "session-affinity-filter"], "kvmesh", "local"),
        (["random-picker"], "random", "local"),
    ],
)
def test_scorers_choose_the_policy(scorers: list[str], policy: str, tokenizer: str) -> None:
    doc = {"apiVersion": "llm-d.ai/v1alpha1", "kind": "EndpointPickerConfig",
           "plugins": [{"type": s} for s in [*scorers, "max-score-picker"]]}  # fmt: skip
    data, _ = upstream.picker_config(doc)  # no profiles: every plugin is in the default one
    assert data["routing"]["policy"] == policy
    assert data["routing"].get("tokenizer", "local") == tokenizer


def test_only_the_profiles_plugins_count() -> None:
    doc = {"apiVersion": "llm-d.ai/v1alpha1", "kind": "EndpointPickerConfig",
           "plugins": [{"type": "prefix-cache-scorer"}, {"name": "q", "type": "queue-scorer"}],
           "schedulingProfiles": [{"name": "default", "plugins": [{"pluginRef": "q"}]}],
           "featureGates": ["x"]}  # fmt: skip
    data, notes = upstream.picker_config(doc)
    assert data["routing"]["policy"] == "least-loaded" and notes == ["not read: featureGates"]


QUEUE = [{"type": "queue-scorer"}]


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"apiVersion": "v9"}, "apiVersion 'v9'"),
        ({"plugins": [{"type": "pd-profile-handler"}, *QUEUE]}, "does not know plugin type.*pd-profile"),
        ({"plugins": QUEUE, "schedulingProfiles": [{"name": "prefill", "plugins": []}, {"name": "decode"}]},
         "2 scheduling profiles"),
        ({"plugins": QUEUE, "schedulingProfiles": [{"name": "d", "plugins": [{"pluginRef": "nope"}]}]},
         "pluginRef 'nope'"),
        ({"plugins": ["queue-scorer"]}, r"plugins\[0\] needs a type"),
        ({"plugins": {"type": "x"}}, "plugins must be a list"),
        ({"plugins": [{"type": "max-score-picker"}]}, "no scorer kvmesh maps"),
        ({"plugins": [{"type": "vllmgrpc-parser"}, *QUEUE]}, "vllmgrpc-parser: vLLM's gRPC protocol"),
        ({"plugins": [{"type": "core-metrics-extractor", "parameters": {"defaultEngine": "triton"}}, *QUEUE]},
         "'triton' model servers"),
        ({"plugins": [{"type": "queue-scorer"}, {"type": "prefix-cache-scorer", "name": "queue-scorer"}]},
         "two plugins are named 'queue-scorer'"),
        ({"plugins": QUEUE, "schedulingProfiles": [{"plugins": [{"pluginRef": ["queue-scorer"]}]}]},
         r"pluginRef \['queue-scorer'\] names no plugin"),
        ({"plugins": [{"type": "queue-scorer", "name": 7}]}, r"plugins\[0\]\.name must be a string"),
    ],
)  # fmt: skip
def test_picker_configs_kvmesh_cannot_honour_are_refused(doc: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        upstream.picker_config({"apiVersion": "llm-d.ai/v1alpha1", "kind": "EndpointPickerConfig", **doc})


@pytest.mark.usefixtures("in_pod")
def test_bad_flags_are_clear_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    conf = written(tmp_path, GIE_DEFAULT)
    # The inferencepool chart's triton-tensorrt-llm mode: other metric names kvmesh does not read.
    triton = ["--total-queued-requests-metric", "nv_trt_llm_request_metrics{request_type=waiting}"]
    with pytest.raises(ConfigError, match=r"--total-queued-requests-metric.*vLLM's"):
        config_from_args(parse(*gie_args(conf), *triton))
    with pytest.raises(ConfigError, match="not both"):
        config_from_args(
            parse("--pool-name", "p", "--endpoint-selector", "app=v", "--endpoint-target-ports", "80")
        )
    with pytest.raises(ConfigError, match="needs --endpoint-target-ports"):
        config_from_args(parse("--endpoint-selector", "app=v"))
    with pytest.raises(ConfigError, match="--pool-group needs --pool"):
        config_from_args(parse("--endpoint", "10.0.0.5:8000", "--pool-group", "inference.networking.k8s.io"))
    with pytest.raises(ConfigError, match="not Kubernetes label"):
        config_from_args(parse("--endpoint-selector", "app=a b", "--endpoint-target-ports", "80"))
    with pytest.raises(ConfigError, match="--config-file or --config-text"):
        config_from_args(parse("--config-file", str(conf), "--config-text", GIE_DEFAULT, "--pool-name", "p"))
    with pytest.raises(ConfigError, match="cannot read epp config"):
        config_from_args(parse("--config-file", str(tmp_path / "missing.yaml"), "--pool-name", "p"))
    with pytest.raises(ConfigError, match="not a Kubernetes object name"):
        config_from_args(parse("--pool-name", "p?watch=1"))  # it goes into the API path
    with pytest.raises(ConfigError, match="not a Kubernetes namespace name"):
        config_from_args(parse("--pool-name", "p", "--pool-namespace", "../kube-system"))
    mixed = written(tmp_path, "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins: "
                    "[{type: queue-scorer}]\n1: 2\nnull: 3\n", "mixed.yaml")  # fmt: skip
    assert (
        config_from_args(parse("--config-file", str(mixed), "--pool-name", "p")).routing.policy
        == "least-loaded"
    )
    bad_flags = (["--secure-serving=maybe"], ["--endpoint-selector", "app!=x"],
                 ["--endpoint-target-ports", "0"], ["--endpoint-target-ports", "http"],
                 ["--pool-group", "example.com"], ["--zap-log-level", "loud"],
                 ["--endpoint-target-ports", "1,2,3,4,5,6,7,8,9"])  # fmt: skip
    for bad in bad_flags:
        with pytest.raises(SystemExit):
            parse(*bad)
    assert "not a boolean: 'maybe'" in capsys.readouterr().err


@pytest.mark.usefixtures("in_pod")
def test_config_text_and_go_booleans() -> None:
    cfg = config_from_args(
        parse("--config-text", GIE_DEFAULT, "--pool-name", "p", "--secure-serving", "--tracing")
    )
    assert cfg.routing.policy == "kvmesh" and cfg.secure_serving
    assert not config_from_args(parse("--pool-name", "p", "--no-secure-serving")).secure_serving
    assert not config_from_args(parse("--pool-name", "p", "--secure-serving=F")).secure_serving
    # The inferencepool chart renders flags: as two tokens. Go would take "false" for a stray
    # argument and keep TLS on; kvmesh reads what was meant.
    assert not config_from_args(parse("--pool-name", "p", "--secure-serving", "false")).secure_serving


def test_small_flags_read_as_the_reference_reads_them() -> None:
    args = parse("--endpoint-selector", "app=v", "--endpoint-target-ports", "8000,8001,8000",
                 "--zap-log-level", "2")  # fmt: skip
    assert args.endpoint_target_ports == (8000, 8001) and args.zap_log_level == "DEBUG"
    assert parse("--zap-log-level", "panic").zap_log_level == "CRITICAL"


def test_warnings_for_what_kvmesh_epp_does_not_do(in_pod: None, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="kvmesh.epp"):
        config_from_args(
            parse("--pool-name", "p", "--tracing=true", "--metrics-endpoint-auth", "--enable-cert-reload",
                  "--refresh-metrics-interval=50ms", "--enable-pprof=true")
        )  # fmt: skip
    said = caplog.text
    assert "no OpenTelemetry traces" in said and "without authentication" in said and "read at start" in said
    assert "--refresh-metrics-interval: accepted and not used" in said and "--enable-pprof" in said


def test_json_log_lines() -> None:
    record = logging.LogRecord("kvmesh.epp", logging.WARNING, __file__, 1, "pool %s down", ("p",), None)
    line = json.loads(upstream.JsonFormatter().format(record))
    assert line["level"] == "warning" and line["msg"] == "pool p down" and line["logger"] == "kvmesh.epp"


def alpha_pool(port: int) -> dict[str, Any]:
    """An InferencePool as the x-k8s.io group's v1alpha2 has it."""
    spec = {"selector": {"app": "vllm"}, "targetPortNumber": port}
    return {"apiVersion": "inference.networking.x-k8s.io/v1alpha2", "kind": "InferencePool",
            "metadata": {"name": "demo"}, "spec": spec}  # fmt: skip


def test_v1alpha2_pool_objects() -> None:
    pool = alpha_pool(8000)
    assert pool_selector(pool) == ({"app": "vllm"}, [8000])
    for spec in ({"selector": {"app": "vllm"}}, {"targetPortNumber": 8000},
                 {"selector": {"app": "vllm"}, "targetPortNumber": "8000"},
                 {"selector": {"app": "vllm"}, "targetPortNumber": 70000}):  # fmt: skip
        with pytest.raises(ConfigError, match="InferencePool demo"):
            pool_selector({**pool, "spec": spec})


def test_a_v1alpha2_pool_discovered_over_http_is_served(tmp_path: Path) -> None:
    """The x-k8s.io chart's command line, its pool read from a local API server (aiohttp on a
    real socket, answers written in the API's wire format) and a ready pod that is a FakeVLLM:
    the health service the chart's probes ask turns SERVING and requests are routed to it."""
    from kvmesh.epp.discovery import KubeDiscovery
    from kvmesh.epp.server import EppThread
    from kvmesh.router.testing import FakeVLLM

    fake = FakeVLLM("d0").start()
    port = int(fake.url.rsplit(":", 1)[1])
    pool = alpha_pool(port)
    pod = {"metadata": {"name": "w0", "uid": "u0", "resourceVersion": "5"},
           "status": {"podIP": "127.0.0.1", "phase": "Running",
                      "conditions": [{"type": "Ready", "status": "True"}]}}  # fmt: skip
    seen: list[str] = []

    async def pool_get(request: web.Request) -> web.StreamResponse:
        seen.append(request.path)
        return web.json_response(pool)

    async def pods(request: web.Request) -> web.StreamResponse:
        assert request.query["labelSelector"] == "app=vllm"
        if request.query.get("watch") == "1":
            await asyncio.sleep(30)  # nothing changes
            return web.json_response({})
        return web.json_response({"kind": "PodList", "metadata": {"resourceVersion": "5"}, "items": [pod]})

    app = web.Application()
    app.router.add_get(
        "/apis/inference.networking.x-k8s.io/v1alpha2/namespaces/inference/inferencepools/demo", pool_get
    )
    app.router.add_get("/api/v1/namespaces/inference/pods", pods)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app, handler_cancellation=True)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    api_port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    api = threading.Thread(target=loop.run_forever, daemon=True)
    api.start()
    conf = written(tmp_path, GIE_DEFAULT)
    args = gie_args(conf, "inference.networking.x-k8s.io", ha=True)
    cfg = config_from_args(parse(*args, "--host=127.0.0.1", "--grpc-port=0", "--grpc-health-port=0",
                                 "--metrics-port=0"))  # fmt: skip
    assert cfg.kube is not None
    kube = cfg.kube.model_copy(update={"api_server": f"http://127.0.0.1:{api_port}",
                                       "token_path": str(tmp_path / "none")})  # fmt: skip
    cfg = cfg.model_copy(update={"kube": kube, "routing": cfg.routing.merged(health_interval_s=0.2)})
    epp = EppThread(cfg, discovery=KubeDiscovery(kube)).start()
    try:
        server = epp.server
        assert server is not None
        with grpc.insecure_channel(f"127.0.0.1:{server.health_port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)

            def serving(svc: str) -> bool:
                got = stub.Check(health_pb2.HealthCheckRequest(service=svc), timeout=5)
                return bool(got.status == health_pb2.HealthCheckResponse.SERVING)

            wait_for(lambda: serving("readiness") and serving("inference-extension"), 15,
                     "the discovered pod never made the EPP ready")  # fmt: skip
            assert serving("liveness")
        got = asyncio.run_coroutine_threadsafe(epp.picker.decide(b'{"prompt": "hi"}'), epp._loop).result(5)  # type: ignore[arg-type]
        assert got.ranked == [f"127.0.0.1:{port}"]  # type: ignore[union-attr]
        # No model directory in the chart: the prompt was tokenized by the pod's /tokenize
        # (the FakeVLLM's: one id a byte).
        assert len(got.request.tokens) == len("hi")  # type: ignore[union-attr]
        assert seen and seen[0].startswith("/apis/inference.networking.x-k8s.io/v1alpha2/")
    finally:
        epp.stop()
        fake.stop()
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        api.join(10)
        loop.close()


def test_an_ipv6_pod_ip_is_bound() -> None:
    """``--host=$(POD_IP)`` in an IPv6 cluster: gRPC needs the address in brackets (it took
    ``fd00::7:9002`` for a host name before)."""
    import socket

    from kvmesh.epp.config import EppConfig
    from kvmesh.epp.server import EppThread

    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError as exc:
        pytest.skip(f"this host has no IPv6 loopback: {exc}")
    cfg = EppConfig(host="[::1]", grpc_port=0, health_port=0, metrics_port=0, secure_serving=False)
    epp = EppThread(cfg).start()
    try:
        server = epp.server
        assert server is not None
        with grpc.insecure_channel(f"[::1]:{server.health_port}") as ch:
            got = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service="liveness"), timeout=5
            )
        assert got.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        epp.stop()


def test_the_epps_tokenize_budget_fits_envoys_timeout() -> None:
    from kvmesh.epp.config import EppConfig
    from kvmesh.epp.scoring import EPP_TOKENIZE_TIMEOUT_S, EndpointPicker
    from kvmesh.routing.config import RoutingConfig

    picker = EndpointPicker(EppConfig(routing=RoutingConfig(tokenizer="remote")))
    assert picker.core.config.tokenize_timeout_s == EPP_TOKENIZE_TIMEOUT_S < 0.2  # Envoy's default
    mine = EndpointPicker(EppConfig(routing=RoutingConfig(tokenizer="remote", tokenize_timeout_s=0.05)))
    assert mine.core.config.tokenize_timeout_s == 0.05


def test_a_slow_tokenize_costs_its_budget_not_the_gateways_timeout() -> None:
    """tokenizer: remote, and the pod's /tokenize hangs: the decision comes after
    ``tokenize_timeout_s`` (routed by load and session), well inside Envoy's 200 ms default
    ext_proc message timeout (it took the router's 3 s budget before)."""
    import time

    from kvmesh.epp.config import EppConfig
    from kvmesh.epp.server import EppThread
    from kvmesh.router.testing import FakeVLLM
    from kvmesh.routing.config import RoutingConfig

    fake = FakeVLLM("slow").start()
    fake.tokenize_delay_s = 2.0
    routing = RoutingConfig(tokenizer="remote", health_interval_s=0.2, tokenize_timeout_s=0.1)
    cfg = EppConfig(routing=routing, host="127.0.0.1", grpc_port=0, health_port=0, metrics_port=0,
                    secure_serving=False)  # fmt: skip
    epp = EppThread(cfg).start()
    try:
        port = int(fake.url.rsplit(":", 1)[1])
        epp.call(lambda: epp.picker.add_endpoint(endpoint_config(f"127.0.0.1:{port}")))
        wait_for(lambda: epp.call(epp.picker.ready), 10, "the endpoint never became healthy")
        started = time.monotonic()
        got = asyncio.run_coroutine_threadsafe(epp.picker.decide(b'{"prompt": "hi"}'), epp._loop).result(5)  # type: ignore[arg-type]
        took = time.monotonic() - started
        assert got.ranked == [f"127.0.0.1:{port}"] and len(got.request.tokens) == 0  # type: ignore[union-attr]
        assert took < 1.0, took
    finally:
        epp.stop()
        fake.stop()


# llm-d's precise prefix-cache routing: the EPP subscribes to each pod's KV-event publisher
# (its scorer's README and test/perf/config/router-configs/precise-prefix.yaml).
LLMD_PRECISE = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: precise-prefix-cache-scorer
  parameters:
    tokenProcessorConfig: {blockSize: 64}
    kvEventsConfig: {discoverPods: true, podDiscoveryConfig: {socketPort: 5557, replaySocketPort: 5558}}
- type: queue-scorer
"""


@pytest.mark.usefixtures("in_pod")
def test_llm_d_precise_prefix_config_names_the_pods_event_ports(tmp_path: Path) -> None:
    cfg = config_from_args(parse(*llmd_args(written(tmp_path, LLMD_PRECISE))))
    assert cfg.kube is not None and (cfg.kube.events_port, cfg.kube.replay_port) == (5557, 5558)
    assert cfg.routing.policy == "kvmesh"
    pods = "{discoverPods: true, podDiscoveryConfig: {socketPort: 5557, replaySocketPort: 5558}}"
    # llm-d's defaults: discoverPods true, socketPort 5557, no replay (pool.go's DefaultConfig).
    central = LLMD_PRECISE.replace(pods, "{zmqEndpoint: 'tcp://0.0.0.0:5557'}")
    got = config_from_args(parse(*llmd_args(written(tmp_path, central, "central.yaml"))))
    assert got.kube is not None and (got.kube.events_port, got.kube.replay_port) == (5557, None)
    bare = LLMD_PRECISE.replace(f"    kvEventsConfig: {pods}\n", "")
    got = config_from_args(parse(*llmd_args(written(tmp_path, bare, "bare.yaml"))))
    assert got.kube is not None and got.kube.events_port == 5557
    # llm-d's central layout: the pods publish to the EPP, which binds (kvmesh.events.sink).
    off = LLMD_PRECISE.replace(pods, "{discoverPods: false, zmqEndpoint: 'tcp://*:5557', topicFilter: 'kv@'}")
    sink = config_from_args(parse(*llmd_args(written(tmp_path, off, "off.yaml"))))
    assert (sink.events_bind, sink.events_topic) == ("tcp://*:5557", "kv@")
    assert sink.kube is not None and sink.kube.events_port is None  # no pod is subscribed to
    bad_bind = LLMD_PRECISE.replace(pods, "{discoverPods: false}")
    with pytest.raises(ConfigError, match=r"zmqEndpoint must be tcp://HOST:PORT.*discoverPods: false"):
        config_from_args(parse(*llmd_args(written(tmp_path, bad_bind, "bad-bind.yaml"))))
    no_replay = LLMD_PRECISE.replace("replaySocketPort: 5558", "replaySocketPort: -1")
    got = config_from_args(parse(*llmd_args(written(tmp_path, no_replay, "no-replay.yaml"))))
    assert got.kube is not None and got.kube.replay_port is None
    none = LLMD_PRECISE.replace(pods, "{podDiscoveryConfig: null}")
    got = config_from_args(parse(*llmd_args(written(tmp_path, none, "none.yaml"))))
    assert got.kube is not None and got.kube.events_port is None
    bad = LLMD_PRECISE.replace("socketPort: 5557", "socketPort: '5557'")
    with pytest.raises(ConfigError, match="socketPort must be a port number"):
        config_from_args(parse(*llmd_args(written(tmp_path, bad, "bad.yaml"))))


@pytest.mark.usefixtures("in_pod")
def test_the_namespace_and_group_under_the_flags(tmp_path: Path) -> None:
    """The flag, then the file's own namespace, then the pod's ($NAMESPACE, "inference" here);
    a pool named by the flags takes their group, not the file's (which named another pool)."""
    conf = written(
        tmp_path, "kube: {pool: old, namespace: filens, group: inference.networking.x-k8s.io}\n", "k.yaml"
    )
    cfg = config_from_args(parse("--config", str(conf), "--pool-name", "demo"))
    assert (
        cfg.kube is not None
        and cfg.kube.namespace == "filens"
        and cfg.kube.group == "inference.networking.k8s.io"
    )
    flag = config_from_args(parse("--config", str(conf), "--pool-name", "demo", "--pool-namespace", "flagns"))
    assert flag.kube is not None and flag.kube.namespace == "flagns"
    plain = written(tmp_path, "kube: {pool: old}\n", "plain.yaml")
    env = config_from_args(parse("--config", str(plain), "--pool-name", "demo"))
    assert env.kube is not None and env.kube.namespace == "inference"
    alone = config_from_args(parse("--config", str(plain)))  # no flags: the file's pool, the pod's namespace
    assert alone.kube is not None and (alone.kube.pool, alone.kube.namespace) == ("old", "inference")


@pytest.mark.usefixtures("in_pod")
def test_a_kvmesh_config_files_kube_keys_stay_under_the_flags(tmp_path: Path) -> None:
    conf = written(tmp_path, "kube: {pool: other, events_port: 5557, resync_s: 60}\n", "epp.yaml")
    cfg = config_from_args(parse("--config", str(conf), "--pool-name", "demo"))
    assert cfg.kube is not None and (cfg.kube.pool, cfg.kube.events_port, cfg.kube.resync_s) == (
        "demo",
        5557,
        60,
    )
    alone = config_from_args(
        parse("--config", str(conf), "--endpoint-selector", "app=v", "--endpoint-target-ports", "80")
    )
    assert alone.kube is not None and alone.kube.pool is None and alone.kube.events_port == 5557


def test_pods_without_annotations_take_the_configured_event_ports() -> None:
    from kvmesh.epp.discovery import pod_endpoints

    pod = {"metadata": {"name": "w0"},
           "status": {"podIP": "10.0.0.9", "phase": "Running",
                      "conditions": [{"type": "Ready", "status": "True"}]}}  # fmt: skip
    (plain,) = pod_endpoints(pod, [8000])
    assert plain.events is None  # annotations only, as before
    (ep,) = pod_endpoints(pod, [8000], 5557, 5558)
    assert (ep.events, ep.replay) == ("tcp://10.0.0.9:5557", "tcp://10.0.0.9:5558")
    annotated = {**pod, "metadata": {"name": "w1", "annotations": {"kvmesh.io/kv-events-port": "6000"}}}
    (ann,) = pod_endpoints(annotated, [8000], 5557, 5558)
    assert (ann.events, ann.replay) == ("tcp://10.0.0.9:6000", None)  # the pod's own annotations, whole
    # One socket per data-parallel rank, the i-th target port's at the port plus i (vLLM and llm-d).
    ranks = pod_endpoints(pod, [8000, 8001], 5557, 5600)
    assert [(e.events, e.replay) for e in ranks] == [
        ("tcp://10.0.0.9:5557", "tcp://10.0.0.9:5600"),
        ("tcp://10.0.0.9:5558", "tcp://10.0.0.9:5601"),
    ]
    v6 = {**pod, "status": {**pod["status"], "podIP": "fd00::9"}}  # type: ignore[dict-item]
    (six,) = pod_endpoints(v6, [8000], 5557)
    assert six.events == "tcp://[fd00::9]:5557" and six.key == "[fd00::9]:8000"
    for written_as in ("tcp://$(POD_IP):5557", "tcp://[$(POD_IP)]:5557"):
        whole = {**v6, "metadata": {"name": "w2", "annotations": {"kvmesh.io/kv-events": written_as}}}
        assert pod_endpoints(whole, [8000])[0].events == "tcp://[fd00::9]:5557"


@pytest.mark.vllm
def test_pods_publishing_to_the_epp_fill_its_index(tmp_path: Path) -> None:
    """llm-d's central layout end to end in one process: the config's discoverPods: false
    binds the EPP's sink, vLLM's own publisher (as a pod with topic kv@$(POD_IP)@<model>)
    connects to it, and its blocks are indexed under the pod's endpoint; once the endpoint is
    removed, its batches are not applied (they would register it again)."""
    kv = pytest.importorskip("vllm.distributed.kv_events")
    from kvmesh.epp.server import EppThread
    from kvmesh.router.testing import FakeVLLM

    central = LLMD_PRECISE.replace(
        "{discoverPods: true, podDiscoveryConfig: {socketPort: 5557, replaySocketPort: 5558}}",
        "{discoverPods: false, zmqEndpoint: 'tcp://127.0.0.1:0'}",
    )
    args = ["--config-file", str(written(tmp_path, central)), "--host=127.0.0.1", "--grpc-port=0",
            "--grpc-health-port=0", "--metrics-port=0", "--no-secure-serving"]  # fmt: skip
    fake = FakeVLLM("pod").start()
    port = int(fake.url.rsplit(":", 1)[1])
    cfg = config_from_args(parse(*args, "--endpoint", f"127.0.0.1:{port}"))
    epp = EppThread(cfg).start()
    picker = epp.picker
    assert picker.sink is not None
    vpub = kv.ZmqEventPublisher(
        data_parallel_rank=0, endpoint=picker.sink.endpoint, topic="kv@127.0.0.1@qwen3"
    )

    def stored(i: int) -> Any:
        ev = kv.BlockStored(block_hashes=[1000 + i], parent_block_hash=None, token_ids=[i, i], block_size=2,
                            lora_id=None, medium=None, lora_name=None)  # fmt: skip
        return kv.KVEventBatch(ts=float(i), events=[ev])

    try:
        i = 0
        deadline = time.monotonic() + 20
        while not picker.index.stats()["blocks"] and time.monotonic() < deadline:
            vpub.publish(stored(i))
            i += 1
            time.sleep(0.02)
        assert picker.index.replicas() == [f"127.0.0.1:{port}"]
        assert picker.describe()["event_sink"]["batches"] >= 1
        epp.call(lambda: picker.remove_endpoint(f"127.0.0.1:{port}"))
        applied = picker.describe()["event_sink"]["batches"]
        for j in range(i, i + 20):
            vpub.publish(stored(j))
        wait_for(lambda: picker.describe()["event_sink"]["unknown_pod"] > 0, 10, "later batches never came")
        assert picker.index.replicas() == [] and picker.describe()["event_sink"]["batches"] == applied
    finally:
        vpub.shutdown()
        epp.stop()
        fake.stop()


def test_a_topics_pod_names_an_endpoint_or_an_ip() -> None:
    """llm-d matches a topic's pod-id against the endpoint's ip:port (an IPv6 one unbracketed);
    a bare IP names every endpoint at that pod."""
    from kvmesh.epp.config import EppConfig
    from kvmesh.epp.scoring import EndpointPicker

    picker = EndpointPicker(EppConfig())
    for spec in ("10.0.0.1:8000", "10.0.0.1:8001", "[fd00::5]:8000"):
        picker.add_endpoint(endpoint_config(spec))
    assert picker._at_pod("10.0.0.1:8001") == ("10.0.0.1:8001",)
    assert picker._at_pod("10.0.0.1") == ("10.0.0.1:8000", "10.0.0.1:8001")
    assert picker._at_pod("fd00::5:8000") == picker._at_pod("[fd00::5]:8000") == ("[fd00::5]:8000",)
    assert picker._at_pod("fd00::5") == ("[fd00::5]:8000",)
    assert picker._at_pod("10.0.0.1:9999") == () and picker._at_pod("pod-name-7") == ()
    picker.remove_endpoint("10.0.0.1:8000")
    assert picker._at_pod("10.0.0.1") == ("10.0.0.1:8001",)
