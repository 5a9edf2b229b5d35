"""The peer launchers' command lines and environments (pure: nothing is started)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvmesh.bench.common import peers
from kvmesh.bench.common.peers import lmcache_server_command, vllm_router_command, with_pythonpath
from kvmesh.errors import ProcessError


def test_vllm_router_command_follows_the_peers_recipe() -> None:
    urls = ["http://127.0.0.1:8100", "http://127.0.0.1:8101"]
    events = {urls[0]: "tcp://127.0.0.1:5600", urls[1]: "tcp://127.0.0.1:5601"}
    cmd = vllm_router_command("vr", 8190, urls, "kv_aware", events)
    text = " ".join(cmd)
    assert cmd[0] == "vr"
    assert "--host 127.0.0.1 --port 8190" in text
    assert f"--worker-urls {urls[0]} {urls[1]} --policy kv_aware" in text
    assert f"--kv-event-source {urls[0]}=tcp://127.0.0.1:5600" in text
    assert f"--kv-event-source {urls[1]}=tcp://127.0.0.1:5601" in text
    assert "--kv-event-block-size 128 --kv-event-model tiny" in text
    # other policies do not read events
    assert "--kv-event-source" not in vllm_router_command("vr", 1, urls, "cache_aware", events)
    with pytest.raises(ValueError, match="missing"):
        vllm_router_command("vr", 1, urls, "kv_aware", {urls[0]: "tcp://x:1"})
    with pytest.raises(ValueError, match="unknown vllm-router policy"):
        vllm_router_command("vr", 1, urls, "kvmesh")
    with pytest.raises(ValueError, match="at least one worker"):
        vllm_router_command("vr", 1, [], "round_robin")


def test_lmcache_server_command_is_loopback_with_auto_transfer_mode() -> None:
    cmd = lmcache_server_command("py", 5555, 18080, "shm1")
    text = " ".join(cmd)
    assert text.startswith("py -m lmcache.cli.main server --host 127.0.0.1 --port 5555")
    assert "--http-host 127.0.0.1 --http-port 18080" in text
    assert "--supported-transfer-mode auto" in text
    assert "--chunk-size 128 --eviction-policy LRU" in text  # kvmesh's shipped chunk size
    assert "--l1-size-gb 1 " in text and "--l1-size-gb 2 " in " ".join(
        lmcache_server_command("p", 1, 2, "s", 2)
    )
    assert cmd[-2:] == ["--shm-name", "shm1"]


def test_lmcache_servers_of_one_process_get_their_own_ports_and_shared_memory() -> None:
    a, b = peers.LMCacheServer("/p"), peers.LMCacheServer("/p")
    assert len({a.port, a.http_port, b.port, b.http_port}) == 4
    shm = [s.args[s.args.index("--shm-name") + 1] for s in (a, b)]
    assert shm[0] != shm[1]
    assert a.env["PYTHONPATH"].split(":")[0] == "/p" and a.env["LMCACHE_TRACK_USAGE"] == "false"
    assert a.connector() == {
        "kv_connector": "LMCacheMPConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": a.port},
    }


def test_with_pythonpath_prepends() -> None:
    assert with_pythonpath("/p", {"PYTHONPATH": "/q"})["PYTHONPATH"] == "/p:/q"
    assert with_pythonpath("/p", {})["PYTHONPATH"] == "/p"
    assert "PYTHONPATH" not in with_pythonpath("", {})


def test_lmcache_pythonpath_prefers_the_peers_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "lmcache").mkdir()
    (tmp_path / "lmcache" / "__init__.py").write_text("")
    monkeypatch.setenv(peers.PEERS_DIR_ENV, str(tmp_path))
    assert peers.lmcache_pythonpath() == str(tmp_path)
    assert peers.require_lmcache() == str(tmp_path)
    monkeypatch.setenv(peers.PEERS_DIR_ENV, str(tmp_path / "nothing"))
    monkeypatch.setattr(peers.importlib.util, "find_spec", lambda name: None)
    assert peers.lmcache_pythonpath() is None
    with pytest.raises(ProcessError, match=r"install_peers\.sh"):
        peers.require_lmcache()


def test_missing_vllm_router_says_how_to_install_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(peers.VLLM_ROUTER_ENV, str(tmp_path / "no-such-binary"))
    with pytest.raises(FileNotFoundError, match=r"install_peers\.sh"):
        peers.vllm_router_binary()
    binary = tmp_path / "vllm-router"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    monkeypatch.setenv(peers.VLLM_ROUTER_ENV, str(binary))
    assert peers.vllm_router_binary() == str(binary)


def test_lmcache_server_command_chunk_size_and_l2_adapters() -> None:
    cmd = lmcache_server_command("p", 1, 2, "s", 1.0, 128, [{"type": "resp", "host": "127.0.0.1", "port": 7}])
    text = " ".join(cmd)
    assert "--chunk-size 128 " in text
    i = cmd.index("--l2-adapter")
    assert json.loads(cmd[i + 1]) == {"type": "resp", "host": "127.0.0.1", "port": 7}
    assert "--l2-adapter" not in lmcache_server_command("p", 1, 2, "s")
    server = peers.LMCacheServer("/p", chunk_size=128)
    assert server.args[server.args.index("--chunk-size") + 1] == "128"
    assert server.http_url == f"http://127.0.0.1:{server.http_port}"
