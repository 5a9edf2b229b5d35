"""Kubernetes discovery of an InferencePool's pods, without a kube-apiserver.

No API server runs here, so the responses in tests/unit/epp/kube/ are written by hand in
the API server's wire format (a ``PodList``, an ``InferencePool`` v1 object, watch
streams of newline-delimited ``{"type", "object"}`` events, a ``410 Expired`` ERROR event),
not recorded from a live cluster. They are served by a local aiohttp server on a real
socket, so the list/watch/resume/relist loop runs over HTTP as it would against a cluster.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from kvmesh.epp.config import KubeConfig
from kvmesh.epp.discovery import KubeDiscovery, PodTracker, pod_endpoints, pool_selector
from kvmesh.errors import ConfigError
from kvmesh.routing.config import ReplicaConfig
from tests.waiting import wait_for

KUBE = Path(__file__).parent / "kube"


def load(name: str) -> Any:
    return json.loads((KUBE / name).read_text())


def events(name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (KUBE / name).read_text().splitlines() if line.strip()]


class Sink:
    """Records what discovery adds and removes (stands in for the EndpointPicker)."""

    def __init__(self) -> None:
        self.synced = False
        self.live: dict[str, ReplicaConfig] = {}
        self.log: list[tuple[str, str]] = []

    def add_endpoint(self, cfg: ReplicaConfig) -> None:
        self.live[cfg.key] = cfg
        self.log.append(("add", cfg.key))

    def remove_endpoint(self, name: str) -> None:
        self.live.pop(name, None)
        self.log.append(("remove", name))


def test_pool_selector_and_pod_endpoints() -> None:
    labels, ports = pool_selector(load("pool.json"))
    assert labels == {"app": "kvmesh-vllm"} and ports == [8000]
    with pytest.raises(ConfigError, match="targetPorts"):
        pool_selector({"metadata": {"name": "p"}, "spec": {"selector": {"matchLabels": {"a": "b"}}}})
    ready, pending = load("pods-list.json")["items"]
    (ep,) = pod_endpoints(ready, ports)
    assert (ep.key, ep.url, ep.events) == ("10.0.0.11:8000", "http://10.0.0.11:8000", "tcp://10.0.0.11:5557")
    assert pod_endpoints(pending, ports) == []


def test_tracker_follows_readiness_and_deletion() -> None:
    sink = Sink()
    tracker = PodTracker(sink, [8000])
    tracker.replace(load("pods-list.json")["items"])
    assert sink.synced and sorted(sink.live) == ["10.0.0.11:8000"]
    seen = []
    for ev in events("pods-watch-1.ndjson"):
        if ev["type"] != "BOOKMARK":
            tracker.apply(ev["type"], ev["object"])
        seen.append(sorted(sink.live))
    assert seen == [
        ["10.0.0.11:8000"],  # w-b has an IP but is not ready
        ["10.0.0.11:8000", "10.0.0.12:8000"],  # w-b ready
        ["10.0.0.11:8000", "10.0.0.12:8000"],  # bookmark
        ["10.0.0.11:8000", "10.0.0.12:8000", "10.0.0.13:8000"],  # w-c added ready
        ["10.0.0.12:8000", "10.0.0.13:8000"],  # w-a not ready
        ["10.0.0.12:8000"],  # w-c being deleted
        ["10.0.0.12:8000"],  # w-c deleted: nothing more to do
    ]
    assert sink.live["10.0.0.12:8000"].events == "tcp://10.0.0.12:5557"
    # A relist drops what it does not contain and adds what is new.
    tracker.replace(load("pods-list-2.json")["items"])
    assert sorted(sink.live) == ["10.0.0.12:8000", "10.0.0.14:8000"]
    assert sink.log.count(("add", "10.0.0.12:8000")) == 1  # unchanged pods are not re-added


def test_reused_pod_ip_is_not_dropped_by_the_old_pods_deletion() -> None:
    sink = Sink()
    tracker = PodTracker(sink, [8000])
    old, new = (load("pods-list.json")["items"][0] for _ in range(2))
    new = json.loads(json.dumps(new))
    new["metadata"]["uid"], new["metadata"]["name"] = "uid-new", "w-new"
    tracker.apply("ADDED", old)
    tracker.apply("ADDED", new)  # same IP, a new pod (the old one's DELETED comes late)
    tracker.apply("DELETED", old)
    assert list(sink.live) == ["10.0.0.11:8000"]


class FakeApiServer:
    """Serves the files above: the pool, list 1, watch 1, watch 2 (410), list 2, then a quiet watch."""

    def __init__(self) -> None:
        self.lists = [load("pods-list.json"), load("pods-list-2.json")]
        self.watches = [events("pods-watch-1.ndjson"), events("pods-watch-2.ndjson")]
        self.requests: list[dict[str, str]] = []
        self.auth: set[str | None] = set()
        self.quiet = asyncio.Event()
        self.closing = asyncio.Event()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/apis/inference.networking.k8s.io/v1/namespaces/inference/inferencepools/kvmesh-pool",
                           self.pool)  # fmt: skip
        app.router.add_get("/api/v1/namespaces/inference/pods", self.pods)
        return app

    async def pool(self, request: web.Request) -> web.StreamResponse:
        self.auth.add(request.headers.get("Authorization"))
        return web.json_response(load("pool.json"))

    async def pods(self, request: web.Request) -> web.StreamResponse:
        self.auth.add(request.headers.get("Authorization"))
        q = dict(request.query)
        self.requests.append(q)
        assert q["labelSelector"] == "app=kvmesh-vllm"
        if q.get("watch") != "1":
            return web.json_response(self.lists.pop(0))
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        if not self.watches:
            self.quiet.set()
            await self.closing.wait()  # a watch with nothing to say, until the test ends
        for ev in self.watches.pop(0):
            await resp.write(json.dumps(ev).encode() + b"\n")
            await asyncio.sleep(0.01)
        await resp.write_eof()
        return resp


def test_list_watch_resume_and_relist_over_http(tmp_path: Path) -> None:
    async def main() -> tuple[Sink, FakeApiServer, KubeDiscovery]:
        api = FakeApiServer()
        runner = web.AppRunner(api.app())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        (tmp_path / "token").write_text("secret-token\n")
        cfg = KubeConfig(pool="kvmesh-pool", namespace="inference", api_server=f"http://127.0.0.1:{port}",
                         token_path=str(tmp_path / "token"))  # fmt: skip
        disc, sink = KubeDiscovery(cfg), Sink()
        await disc.start(sink)
        try:
            await asyncio.wait_for(api.quiet.wait(), 10)
        finally:
            await disc.stop()
            api.closing.set()
            await runner.cleanup()
        return sink, api, disc

    sink, api, disc = asyncio.run(main())
    assert sorted(sink.live) == ["10.0.0.12:8000", "10.0.0.14:8000"]  # after the 410 relist
    assert disc.lists == 2 and sink.synced
    watches = [r for r in api.requests if r.get("watch") == "1"]
    assert [w["resourceVersion"] for w in watches] == ["200", "209", "310"]  # resumed, then relisted
    assert all(w["allowWatchBookmarks"] == "true" for w in watches)
    assert api.auth == {"Bearer secret-token"}
    assert ("remove", "10.0.0.11:8000") in sink.log


def test_discovered_pods_become_routable_endpoints_of_a_running_epp(tmp_path: Path) -> None:
    """PodTracker feeding a running EndpointPicker: a ready pod (a FakeVLLM on loopback) is
    health-checked and routed to; once its pod is deleted it is gone and readiness drops."""

    from kvmesh.epp.config import EppConfig
    from kvmesh.epp.server import EppThread
    from kvmesh.router.testing import FakeVLLM
    from kvmesh.routing.config import RoutingConfig

    fake = FakeVLLM("d0").start()
    port = int(fake.url.rsplit(":", 1)[1])
    pod = json.loads(json.dumps(load("pods-list.json")["items"][0]))
    pod["status"]["podIP"] = "127.0.0.1"
    pod["metadata"]["annotations"] = {}
    cfg = EppConfig(routing=RoutingConfig(health_interval_s=0.2), host="127.0.0.1", grpc_port=0,
                    health_port=0, metrics_port=0)  # fmt: skip
    epp = EppThread(cfg).start()
    try:
        picker = epp.picker
        tracker = PodTracker(picker, [port])
        epp.call(lambda: tracker.replace([pod]))
        wait_for(lambda: epp.call(picker.ready), 10, "the discovered endpoint never became healthy")
        got = asyncio.run_coroutine_threadsafe(picker.decide(b'{"prompt": "hi"}'), epp._loop).result(5)  # type: ignore[arg-type]
        assert got.ranked == [f"127.0.0.1:{port}"]  # type: ignore[union-attr]
        epp.call(lambda: tracker.apply("DELETED", pod))
        assert epp.call(picker.endpoints) == [] and not epp.call(picker.ready)
    finally:
        epp.stop()
        fake.stop()
