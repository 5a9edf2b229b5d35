"""Finding 9 (deploy/): the shared Redis tier of the Kubernetes deployment admits only kvmesh.

The rendered ``deploy/`` (kubectl's kustomize) is run for real: the Redis container's own
start script, with ``redis-server`` for the image's ``valkey-server`` (same protocol and
flags), on a loopback port. A hostile pod connects without credentials, with the default
user, and with a wrong password; the workers' ``KVMESH_REMOTE_URL`` (the Secret's password
expanded as Kubernetes does) must work through kvmesh's own Redis client. (The
NetworkPolicy that keeps other pods away in the first place is checked in
tests/unit/epp/test_deploy.py.)

Before: Redis ran with no password, so any pod on the cluster network could read every
prompt's chunks and plant its own.
"""

from __future__ import annotations

import functools
import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from kvmesh.harness.ports import free_port
from kvmesh.tiers.redis_wire import make_client

BASE = Path(__file__).resolve().parents[2] / "deploy" / "kustomize" / "base"


@functools.cache
def rendered() -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    assert kubectl is not None, "kubectl is needed to render deploy/ (apt-get install kubernetes-client)"
    out = subprocess.run([kubectl, "kustomize", str(BASE)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def pod_spec(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    obj = next(o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name)
    spec: dict[str, Any] = obj["spec"]["template"]["spec"]
    return spec


def start_script(port: int) -> list[str]:
    """The Redis container's command line, on a loopback port, with redis-server."""
    redis_server = shutil.which("redis-server")
    assert redis_server is not None, "redis-server is needed (apt-get install redis-server)"
    c = pod_spec(rendered(), "StatefulSet", "kvmesh-redis")["containers"][0]
    script = c["args"][0].replace(
        "exec valkey-server", f"exec {redis_server} --port {port} --bind 127.0.0.1 --dir {os.getcwd()}"
    )
    return [*c["command"], script]


@pytest.fixture
def deployed_redis(tmp_path: Path) -> Iterator[tuple[int, str]]:
    port, password = free_port(), secrets.token_hex(32)
    proc = subprocess.Popen(
        start_script(port), env={**os.environ, "REDIS_PASSWORD": password}, cwd=tmp_path,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis(port=port, socket_timeout=1).ping()
            except redis.AuthenticationError:
                break  # up, and asking for credentials
            except redis.ConnectionError:
                assert proc.poll() is None, proc.communicate()[1]
                assert time.monotonic() < deadline, "the deployment's Redis did not start"
                time.sleep(0.1)
                continue
            break  # up and answering anyone: the test below fails
        yield port, password
    finally:
        proc.kill()
        proc.wait(10)


def test_only_the_workers_password_gets_in(deployed_redis: tuple[int, str]) -> None:
    port, password = deployed_redis
    for client in (
        redis.Redis(port=port),  # no credentials
        redis.Redis(port=port, password=password),  # the right password, as the disabled default user
        redis.Redis(port=port, username="kvmesh", password="x" * 64),
    ):
        with pytest.raises((redis.AuthenticationError, redis.ResponseError)):
            client.set("planted", b"forged KV")
        client.close()
    env = {
        e["name"]: e.get("value")
        for e in pod_spec(rendered(), "Deployment", "kvmesh-vllm")["containers"][0]["env"]
    }
    url = (
        env["KVMESH_REMOTE_URL"]
        .replace("$(REDIS_PASSWORD)", password)
        .replace("kvmesh-redis:6379", f"127.0.0.1:{port}")
    )
    worker = make_client(url, timeout_s=2.0)
    assert worker.set("chunk", b"kv") and worker.get("chunk") == b"kv"
    worker.close()


def test_redis_refuses_to_start_with_a_weak_password(tmp_path: Path) -> None:
    for weak in ("", "hunter2"):
        out = subprocess.run(
            start_script(free_port()), env={**os.environ, "REDIS_PASSWORD": weak}, cwd=tmp_path,
            capture_output=True, text=True, timeout=10,
        )  # fmt: skip
        assert out.returncode != 0 and "32+" in out.stderr, (weak, out.returncode, out.stderr)
