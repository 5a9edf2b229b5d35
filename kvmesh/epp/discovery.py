"""Endpoint discovery from Kubernetes: the ready pods an ``InferencePool`` selects.

The pool (``inference.networking.k8s.io/v1``) gives ``spec.selector.matchLabels`` and
``spec.targetPorts[].number`` (``inference.networking.x-k8s.io/v1alpha2``: ``spec.selector``
and ``spec.targetPortNumber``); every ready pod matching the selector is one endpoint per
target port, ``podIP:port``. Without a pool, ``kube.selector`` and ``kube.target_ports``
name the pods directly (the reference EPP's ``--endpoint-selector``). Plain HTTP against
the API server with aiohttp, already a kvmesh dependency: the ``kubernetes`` client does not
fit vLLM's environment (it upgrades python-dateutil 2.9 -> 4.0), and lightkube would add six
packages for two GETs and a watch. List the pods, then watch from the list's
``resourceVersion``; a watch that ends is resumed from the last version seen, a ``410 Gone``
lists again, and every ``resync_s`` the pool itself is read again (its selector or port may
have changed).

A pod is ready when it has an IP, is not being deleted, is ``Running`` and its ``Ready``
condition is ``True``. Its KV-event endpoints come from annotations (docs/getting-started/kubernetes.md):

* ``kvmesh.io/kv-events-port: "5557"``  -> ``tcp://podIP:5557`` (vLLM's ``--kv-events-config``
  endpoint ``tcp://*:5557``); ``kvmesh.io/kv-events: tcp://...`` gives the whole endpoint;
* ``kvmesh.io/kv-replay-port`` / ``kvmesh.io/kv-replay`` likewise for the replay socket.

Without them the pod is routed by load and session only (and by REMOTE blocks the index
learns from other pods). :class:`PodTracker` is the pure part (tested with API responses in
the server's wire format); :class:`KubeDiscovery` adds the HTTP list/watch loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import ssl
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import aiohttp

from kvmesh.errors import ConfigError, UpstreamError
from kvmesh.routing.config import ReplicaConfig

from .config import POOL_GROUPS, KubeConfig

log = logging.getLogger(__name__)

EVENTS_ANNOTATION = "kvmesh.io/kv-events"
EVENTS_PORT_ANNOTATION = "kvmesh.io/kv-events-port"
REPLAY_ANNOTATION = "kvmesh.io/kv-replay"
REPLAY_PORT_ANNOTATION = "kvmesh.io/kv-replay-port"
POOL_API = "/apis/{group}/{version}/namespaces/{ns}/inferencepools/{name}"
PODS_API = "/api/v1/namespaces/{ns}/pods"


class EndpointSink(Protocol):
    """What discovery feeds (the :class:`~kvmesh.epp.scoring.EndpointPicker`)."""

    synced: bool

    def add_endpoint(self, cfg: ReplicaConfig) -> None: ...

    def remove_endpoint(self, name: str) -> None: ...


def pool_selector(pool: Mapping[str, Any]) -> tuple[dict[str, str], list[int]]:
    """(labels, target ports) of an InferencePool object; ConfigError if it has none.

    v1 has ``spec.selector.matchLabels`` and ``spec.targetPorts[].number``; v1alpha2 (the
    ``inference.networking.x-k8s.io`` group) a plain label map ``spec.selector`` and one
    ``spec.targetPortNumber``."""
    spec = pool.get("spec") or {}
    name = (pool.get("metadata") or {}).get("name", "?")
    if str(pool.get("apiVersion", "")).endswith("/v1alpha2"):
        labels = spec.get("selector") or {}
        number = spec.get("targetPortNumber")
        ports = [number] if number is not None else []
        need = "spec.selector and spec.targetPortNumber"
    else:
        labels = (spec.get("selector") or {}).get("matchLabels") or {}
        ports = [p["number"] for p in spec.get("targetPorts") or [] if isinstance(p, dict) and "number" in p]
        need = "spec.selector.matchLabels and spec.targetPorts"
    if not isinstance(labels, Mapping) or not labels or not ports:
        raise ConfigError(f"InferencePool {name}: {need} are required")
    if any(isinstance(p, bool) or not isinstance(p, int) or not 0 < p < 65536 for p in ports):
        raise ConfigError(f"InferencePool {name}: target ports must be numbers 1-65535, got {ports}")
    return {str(k): str(v) for k, v in labels.items()}, [int(p) for p in ports]


def pod_ready(pod: Mapping[str, Any]) -> bool:
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    if meta.get("deletionTimestamp") or not status.get("podIP") or status.get("phase") != "Running":
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


def _socket(host: str, annotations: Mapping[str, str], whole: str, port: str) -> str | None:
    if annotations.get(whole):
        return annotations[whole].replace("[$(POD_IP)]", host).replace("$(POD_IP)", host)
    if annotations.get(port):
        return f"tcp://{host}:{int(annotations[port])}"
    return None


_ANNOTATIONS = (EVENTS_ANNOTATION, EVENTS_PORT_ANNOTATION, REPLAY_ANNOTATION, REPLAY_PORT_ANNOTATION)


def pod_endpoints(
    pod: Mapping[str, Any],
    ports: Iterable[int],
    events_port: int | None = None,
    replay_port: int | None = None,
) -> list[ReplicaConfig]:
    """The endpoints of a ready pod (none if it is not ready). Their KV-event sockets: the
    pod's kvmesh.io annotations; a pod with none of them, ``events_port``/``replay_port`` on
    its IP (``kube.events_port``), plus i for its i-th target port, as vLLM offsets a data-
    parallel rank's sockets and llm-d dials them."""
    if not pod_ready(pod):
        return []
    ip = str(pod["status"]["podIP"])
    ann = (pod.get("metadata") or {}).get("annotations") or {}
    host = f"[{ip}]" if ":" in ip else ip
    annotated = any(ann.get(key) for key in _ANNOTATIONS)
    events = replay = None
    if annotated:  # one socket for the pod, whichever port
        try:
            events = _socket(host, ann, EVENTS_ANNOTATION, EVENTS_PORT_ANNOTATION)
            replay = _socket(host, ann, REPLAY_ANNOTATION, REPLAY_PORT_ANNOTATION)
        except ValueError:
            name = (pod.get("metadata") or {}).get("name")
            log.warning("pod %s: bad kvmesh.io port annotation; routing it without KV events", name)
            events = replay = None
    out = []
    for rank, port in enumerate(ports):
        if not annotated:
            events = f"tcp://{host}:{events_port + rank}" if events_port else None
            replay = f"tcp://{host}:{replay_port + rank}" if replay_port else None
        out.append(
            ReplicaConfig(url=f"http://{host}:{port}", name=f"{host}:{port}", events=events, replay=replay)
        )
    return out


class PodTracker:
    """Pod events in, endpoint additions and removals out (idempotent, order-safe)."""

    def __init__(
        self,
        sink: EndpointSink,
        ports: Iterable[int],
        events_port: int | None = None,
        replay_port: int | None = None,
    ) -> None:
        self.sink = sink
        self.ports = list(ports)
        self._events = (events_port, replay_port)
        self.by_pod: dict[str, list[ReplicaConfig]] = {}  # pod uid/name -> its endpoints

    @staticmethod
    def _key(pod: Mapping[str, Any]) -> str:
        meta = pod.get("metadata") or {}
        return str(meta.get("uid") or meta.get("name"))

    def apply(self, kind: str, pod: Mapping[str, Any]) -> None:
        """One watch event: ``ADDED``, ``MODIFIED`` or ``DELETED``."""
        key = self._key(pod)
        new = [] if kind == "DELETED" else pod_endpoints(pod, self.ports, *self._events)
        old = self.by_pod.get(key, [])
        for cfg in old:
            if cfg not in new and not self._claimed(cfg.key, key):
                self.sink.remove_endpoint(cfg.key)
        for cfg in new:
            if cfg not in old:
                self.sink.add_endpoint(cfg)
        if new:
            self.by_pod[key] = new
        else:
            self.by_pod.pop(key, None)

    def _claimed(self, name: str, but: str) -> bool:
        """Whether a pod other than ``but`` has endpoint ``name`` (a reused pod IP)."""
        return any(c.key == name for k, cfgs in self.by_pod.items() if k != but for c in cfgs)

    def replace(self, pods: Iterable[Mapping[str, Any]]) -> None:
        """A fresh list: whatever is not in it is gone."""
        pods = list(pods)
        seen = {self._key(p) for p in pods}
        for key in [k for k in self.by_pod if k not in seen]:
            for cfg in self.by_pod.pop(key):
                if not self._claimed(cfg.key, key):
                    self.sink.remove_endpoint(cfg.key)
        for pod in pods:
            self.apply("MODIFIED", pod)
        self.sink.synced = True

    def endpoints(self) -> list[str]:
        return sorted(cfg.key for cfgs in self.by_pod.values() for cfg in cfgs)


class KubeDiscovery:
    """List + watch the pool's pods on the picker's loop; see the module docstring."""

    def __init__(self, config: KubeConfig) -> None:
        self.config = config
        self.tracker: PodTracker | None = None
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None
        self.api = config.api_server or _in_cluster_api()
        self.lists = 0  # full lists done (tests, /kvmesh/state)

    def _headers(self) -> dict[str, str]:
        try:
            with open(self.config.token_path) as f:  # re-read: projected tokens rotate
                return {"Authorization": f"Bearer {f.read().strip()}"}
        except OSError:
            return {}

    def _ssl(self) -> ssl.SSLContext | bool:
        if not self.api.startswith("https://"):
            return False
        if os.path.exists(self.config.ca_path):
            return ssl.create_default_context(cafile=self.config.ca_path)
        return True

    async def start(self, sink: EndpointSink) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=5))
        self._sink = sink
        self._task = asyncio.create_task(self._run(), name="kvmesh-epp-discovery")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._session is not None:
            await self._session.close()

    async def _get(self, path: str, params: Mapping[str, str] | None = None) -> Any:
        assert self._session is not None
        async with self._session.get(
            self.api + path, params=params, headers=self._headers(), ssl=self._ssl(),
            timeout=aiohttp.ClientTimeout(total=30),
        ) as resp:  # fmt: skip
            if resp.status != 200:
                raise UpstreamError(f"GET {path} answered {resp.status}: {(await resp.text())[:200]}")
            return await resp.json(content_type=None)

    async def _run(self) -> None:
        delay = 0.5
        while True:
            try:
                await self._list_and_watch()
                delay = 0.5
            except asyncio.CancelledError:
                raise
            except (aiohttp.ClientError, TimeoutError, UpstreamError, ConfigError, ValueError) as exc:
                log.warning("InferencePool discovery: %s; retrying in %.1f s", exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)

    async def _list_and_watch(self) -> None:
        cfg = self.config
        if cfg.pool is None:  # standalone: the pods the selector names, no pool to read
            labels, ports = dict(cfg.selector or {}), list(cfg.target_ports)
        else:
            path = POOL_API.format(
                group=cfg.group, version=POOL_GROUPS[cfg.group], ns=cfg.namespace, name=cfg.pool
            )
            labels, ports = pool_selector(await self._get(path))
        if self.tracker is None or self.tracker.ports != ports:
            if self.tracker is not None:
                self.tracker.replace([])  # the port changed: every endpoint name changes
            self.tracker = PodTracker(self._sink, ports, cfg.events_port, cfg.replay_port)
        selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        listed = await self._get(PODS_API.format(ns=cfg.namespace), {"labelSelector": selector})
        self.tracker.replace(listed.get("items") or [])
        self.lists += 1
        version = str((listed.get("metadata") or {}).get("resourceVersion", ""))
        deadline = asyncio.get_running_loop().time() + cfg.resync_s
        while asyncio.get_running_loop().time() < deadline:
            version = await self._watch(selector, version, deadline)
            if not version:
                return  # 410 Gone or the like: list again

    async def _watch(self, selector: str, version: str, deadline: float) -> str:
        """One watch request; the last resourceVersion seen ('' = list again)."""
        assert self._session is not None and self.tracker is not None
        left = max(1, int(deadline - asyncio.get_running_loop().time()))
        params = {"labelSelector": selector, "watch": "1", "resourceVersion": version,
                  "allowWatchBookmarks": "true", "timeoutSeconds": str(left)}  # fmt: skip
        path = PODS_API.format(ns=self.config.namespace)
        async with self._session.get(
            self.api + path, params=params, headers=self._headers(), ssl=self._ssl()
        ) as resp:
            if resp.status == 410:
                return ""
            if resp.status != 200:
                raise UpstreamError(f"watch {path} answered {resp.status}")
            async for line in resp.content:
                if not line.strip():
                    continue
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    return "" if obj.get("code") == 410 else version
                version = str((obj.get("metadata") or {}).get("resourceVersion", version))
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    self.tracker.apply(kind, obj)
        return version


def _in_cluster_api() -> str:
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        raise ConfigError("kube.api_server: not in a cluster (no KUBERNETES_SERVICE_HOST); give the API URL")
    host = f"[{host}]" if ":" in host else host
    return f"https://{host}:{port}"
