"""The connector's prefill/decode halves (pd.py) without vLLM: two real engines holding one
fleet key, the producer's transfer server on loopback, a shared fs tier for the fallback;
and the scheduler side's handshake over fake ranks (they record calls; no RPC socket).
Forged parameters and other attacks are in tests/security/."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvmesh.core.engine import CacheEngine
from kvmesh.core.fleetkey import FleetKey
from kvmesh.core.keys import KVLayout
from kvmesh.errors import ConfigError
from kvmesh.harness.connector import fleet_key_file
from kvmesh.integrations.vllm.options import ConnectorOptions
from kvmesh.integrations.vllm.pd import PdWorker, pd_mode, remote_prefill, response_params, wants_export
from kvmesh.integrations.vllm.pd_params import verify_params
from kvmesh.integrations.vllm.scheduler import SchedulerSide
from tests.waiting import eventually

LAYOUT = KVLayout(2, 2, 8, torch.float32)
CS = 128
BS = 128


def options(**extra: Any) -> ConnectorOptions:
    base = {
        "chunk_size": CS,
        "max_local_cpu_size": 0.01,
        "admin_enabled": False,
        "fleet_key_file": fleet_key_file(),
    }
    return ConnectorOptions.from_extra_config({**base, **extra}, environ={})


def engine(opts: ConnectorOptions, model: str = "m") -> CacheEngine:
    return CacheEngine(opts.cache, layout=LAYOUT, model_id=model)


def prompt(n: int, seed: int = 1) -> tuple[list[int], torch.Tensor]:
    toks = list(range(seed * 1000, seed * 1000 + n))
    kv = torch.randn(LAYOUT.shape(n), generator=torch.Generator().manual_seed(seed))
    return toks, kv


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[PdWorker, PdWorker]]:
    shared = f"fs://{tmp_path / 'shared'}"
    popts = options(remote_url=shared, pd_pin_timeout_s=30)
    copts = options(remote_url=shared, pd_fetch_timeout_s=1.0)
    prod = PdWorker(engine(popts), popts, produce=True, port=0)
    cons = PdWorker(engine(copts), copts, produce=False, port=0)
    yield prod, cons
    for w in (prod, cons):
        w.close()
        w.engine.close()


def handshake(prod: PdWorker, req: str, toks: list[int]) -> dict[str, Any]:
    answer = prod.export(req, toks)
    assert answer is not None
    return response_params("engine-p", [answer], key=prod.key, ttl_s=30)


def test_export_pins_then_pull_loads_and_unpins(pair: tuple[PdWorker, PdWorker]) -> None:
    prod, cons = pair
    toks, kv = prompt(4 * CS)
    prod.engine.store(toks, kv)
    params = handshake(prod, "p-1", toks)
    assert params["do_remote_prefill"] and params["remote_port"] == prod.server.port  # type: ignore[union-attr]
    ours = params["kvmesh"]
    assert ours["num_tokens"] == 4 * CS and len(ours["keys"]) == 4 and ours["sig"] and ours["expires"]
    assert len(ours["transfer_id"]) >= 32 and ours["transfer_id"] != "p-1"  # not vLLM's request id
    assert prod.stats()["pd_pinned_requests"] == 1 and prod.engine.cpu.pinned_count() == 4
    got = cons.pull("d-1", toks, params)
    assert got["reason"] is None and got["tokens"] == 4 * CS
    n, out = cons.engine.retrieve(toks)
    assert n == 4 * CS and torch.equal(out, kv)
    assert prod.stats()["pd_pinned_requests"] == 0 and prod.stats()["pd_pins_confirmed"] == 1
    assert cons.stats()["pd_pull_chunks"] == 4 and cons.stats()["pd_fallbacks_total"] == {}


def test_dead_producer_falls_back_to_the_shared_tier(pair: tuple[PdWorker, PdWorker]) -> None:
    prod, cons = pair
    toks, kv = prompt(3 * CS, seed=2)
    prod.engine.store(toks, kv)
    assert prod.engine.wait_for_writes(10)  # the shared copy has landed
    params = handshake(prod, "p-2", toks)
    prod.server.close()  # type: ignore[union-attr]  # the producer is gone
    got = cons.pull("d-2", toks, params)
    assert got["reason"] == "producer_unreachable" and got["tokens"] == 0
    st = cons.stats()
    assert st["pd_fallbacks_total"] == {"producer_unreachable": 1}
    assert st["pd_fallback_outcomes"] == {"shared": 1}
    n, out = cons.engine.retrieve(toks)  # what the scheduler's lookup + load then read
    assert n == 3 * CS and torch.equal(out, kv)


def test_nothing_anywhere_is_a_recompute(pair: tuple[PdWorker, PdWorker]) -> None:
    prod, cons = pair
    toks, kv = prompt(2 * CS, seed=3)
    prod.engine.store(toks, kv)
    prod.engine.wait_for_writes(10)
    prod.engine.clear("remote", force=True)
    params = handshake(prod, "p-3", toks)
    prod.server.close()  # type: ignore[union-attr]
    assert cons.pull("d-3", toks, params)["reason"] == "producer_unreachable"
    assert cons.stats()["pd_fallback_outcomes"] == {"recompute": 1}
    assert cons.engine.lookup(toks) == 0


def test_pd_modes_need_a_key_or_the_opt_in() -> None:
    keyless = options(fleet_key_file=None)
    for role in ("kv_producer", "kv_consumer"):
        with pytest.raises(ConfigError, match=r"fleet_key_file .* pd_allow_insecure: true"):
            pd_mode(keyless, role)
    assert pd_mode(keyless, "kv_both") == "off"
    assert pd_mode(options(fleet_key_file=None, pd_allow_insecure=True), "kv_producer") == "insecure"
    assert pd_mode(options(), "kv_consumer") == "signed"
    off = PdWorker(engine(keyless), keyless, produce=True, port=0)  # kv_both without a key
    try:
        assert off.server is None and off.export("r", list(range(CS))) is None
        params = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 1, "kvmesh": {}}
        assert off.pull("d", list(range(CS)), params)["reason"] == "pd_off"
    finally:
        off.close()
        off.engine.close()


def test_insecure_opt_in_hands_over_unsigned(tmp_path: Path) -> None:
    opts = options(fleet_key_file=None, pd_allow_insecure=True)
    prod = PdWorker(engine(opts), opts, produce=True, port=0)
    cons = PdWorker(engine(opts), opts, produce=False, port=0)
    try:
        toks, kv = prompt(2 * CS)
        prod.engine.store(toks, kv)
        params = handshake(prod, "p", toks)
        assert "sig" not in params["kvmesh"]
        assert cons.pull("d", toks, params)["reason"] is None and torch.equal(
            cons.engine.retrieve(toks)[1], kv
        )
    finally:
        for w in (prod, cons):
            w.close()
            w.engine.close()


def test_params_signature_covers_address_keys_and_expiry() -> None:
    key = FleetKey([b"k" * 32])
    ans = {
        "transfer_id": "t" * 32,
        "keys": ["a", "b"],
        "num_tokens": 256,
        "model_fingerprint": "f",
        "host": "h",
        "port": 9,
    }
    good = response_params("e", [ans], key=key, ttl_s=60, now=1000.0)
    assert verify_params(good, key, now=1001.0).host == "h"  # type: ignore[union-attr]
    assert verify_params(good, key, now=1061.0) == "params_expired"
    assert verify_params(good, FleetKey([b"z" * 32]), now=1001.0) == "params_bad_signature"
    unsigned = response_params("e", [ans])
    assert verify_params(unsigned, key) == "params_unsigned"
    assert verify_params(unsigned, None).transfer_id == "t" * 32  # type: ignore[union-attr]
    for change in (
        {"remote_host": "evil"},
        {"remote_port": 1},
        {"kvmesh": {**good["kvmesh"], "ports": [1]}},
        {"kvmesh": {**good["kvmesh"], "keys": ["a"]}},
        {"kvmesh": {**good["kvmesh"], "transfer_id": "x" * 32}},
        {"kvmesh": {**good["kvmesh"], "expires": good["kvmesh"]["expires"] + 3600}},
    ):
        assert verify_params({**good, **change}, key, now=1001.0) == "params_bad_signature", change
    extra = {**good, "remote_prefill_cached_tokens": 128}  # vLLM's own addition is not covered
    assert verify_params(extra, key, now=1001.0).ports == (9,)  # type: ignore[union-attr]
    assert verify_params({**unsigned, "remote_host": 5}, None) == "params_malformed"
    assert verify_params({"kvmesh": "x"}, key) == "params_malformed"


def test_other_model_keys_are_refused_and_the_producer_unpinned(tmp_path: Path) -> None:
    popts, copts = options(), options()
    prod = PdWorker(engine(popts, "weights-a"), popts, produce=True, port=0)
    cons = PdWorker(engine(copts, "weights-b"), copts, produce=False, port=0)
    try:
        toks, kv = prompt(2 * CS)
        prod.engine.store(toks, kv)
        got = cons.pull("d", toks, handshake(prod, "p", toks))
        assert got["reason"] == "key_mismatch" and cons.engine.lookup(toks) == 0
        assert prod.stats()["pd_pinned_requests"] == 0
    finally:
        for w in (prod, cons):
            w.close()
            w.engine.close()


def test_consumer_serves_no_export() -> None:
    opts = options()
    cons = PdWorker(engine(opts), opts, produce=False, port=0)
    try:
        assert cons.export("r", list(range(CS))) is None and cons.server is None
    finally:
        cons.close()
        cons.engine.close()


# -- the scheduler side's handshake ------------------------------------------------------
class PdRank:
    def __init__(self, export: Any = None) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.answer = export

    def call(self, op: str, **args: Any) -> Any:
        self.calls.append((op, args))
        if op == "pd_export":
            return None if self.answer is None else {**self.answer, "transfer_id": args["transfer_id"]}
        if op == "lookup":
            return len(args["tokens"])
        return {"tokens": 0, "reason": None}


def req(req_id: str, n: int, params: dict[str, Any] | None) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=req_id,
        prompt_token_ids=list(range(n)),
        block_hashes=[],
        lora_request=None,
        mm_features=None,
        cache_salt=None,
        prompt_embeds=None,
        kv_transfer_params=params,
    )


def test_prefill_half_exports_vllm_style_params() -> None:
    answer = {"keys": ["k"], "num_tokens": 256, "model_fingerprint": "f", "host": "h", "port": 9}
    rank = PdRank(answer)
    key = FleetKey([b"k" * 32])
    s = SchedulerSide(CS, BS, [rank], pd_ranks=[rank], engine_id="eng", pd_key=key, pd_ttl_s=30)
    assert s.export(req("a", 300, None)) is None  # not a prefill half
    params = s.export(req("r", 300, {"do_remote_decode": True}))
    assert params is not None
    op, args = rank.calls[-1]
    assert op == "pd_export" and args["req"] == "r" and args["tokens"] == list(range(256))  # whole chunks
    tid = args["transfer_id"]
    assert len(tid) >= 32 and tid != "r"
    ours = params.pop("kvmesh")
    assert params == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_host": "h",
        "remote_port": 9,
        "remote_engine_id": "eng",
    }
    sig, expires = ours.pop("sig"), ours.pop("expires")
    assert ours == {
        "v": 1,
        "transfer_id": tid,
        "keys": ["k"],
        "num_tokens": 256,
        "model_fingerprint": "f",
        "ports": [9],
    }
    assert time.time() + 25 < expires <= time.time() + 31
    assert (
        verify_params({**params, "kvmesh": {**ours, "sig": sig, "expires": expires}}, key).transfer_id == tid
    )  # type: ignore[union-attr]
    assert (
        SchedulerSide(CS, BS, [PdRank(None)], pd_ranks=[PdRank(None)]).export(
            req("r", 300, {"do_remote_decode": True})
        )
        is None
    )
    assert wants_export(req("x", 1, {"do_remote_decode": True})) and not wants_export(req("x", 1, None))


def test_decode_half_pulls_once_then_looks_up() -> None:
    rank = PdRank()
    s = SchedulerSide(CS, BS, [rank], pd_ranks=[rank], pd_async=False)
    params = {"do_remote_prefill": True, "remote_host": "h", "remote_port": 1, "kvmesh": {"keys": []}}
    r = req("d", 300, params)
    assert remote_prefill(r) is not None and remote_prefill(req("n", 1, {"do_remote_prefill": True})) is None
    assert s.lookup(r, 0) == 256
    assert [op for op, _ in rank.calls] == ["pd_pull", "lookup"]
    assert rank.calls[0][1]["tokens"] == list(range(256))
    s.lookup(r, 0)  # looked up again (preempted): no second pull
    assert [op for op, _ in rank.calls].count("pd_pull") == 1
    s2 = SchedulerSide(CS, BS, [rank], pd_ranks=[rank])
    rank.calls.clear()
    assert s2.lookup(req("e", 300, params), 256) == 0  # vLLM's own cache has it: confirm only
    assert [op for op, _ in rank.calls] == ["pd_confirm"]


class SlowRank(PdRank):
    """A pull that runs for ``steps`` status calls."""

    def __init__(self, steps: int) -> None:
        super().__init__()
        self.steps = steps

    def call(self, op: str, **args: Any) -> Any:
        if op == "pd_pull_start":
            self.calls.append((op, args))
            return True
        if op == "pd_pull_done":
            self.calls.append((op, args))
            self.steps -= 1
            return self.steps <= 0
        return super().call(op, **args)


def test_async_pull_answers_not_yet_until_done() -> None:
    rank = SlowRank(steps=2)
    s = SchedulerSide(CS, BS, [rank], pd_ranks=[rank], pd_async=True)
    params = {"do_remote_prefill": True, "remote_host": "h", "remote_port": 1, "kvmesh": {"keys": ["k"]}}
    r = req("d", 300, params)
    assert s.lookup(r, 0) is None  # started: vLLM skips the request this step
    assert s.lookup(r, 0) is None  # still running
    assert s.lookup(r, 0) == 256  # done: the usual lookup
    assert [op for op, _ in rank.calls] == ["pd_pull_start", "pd_pull_done", "pd_pull_done", "lookup"]
    assert s.lookup(r, 0) == 256 and [op for op, _ in rank.calls].count("pd_pull_start") == 1


def test_async_pull_stops_waiting_after_its_budget() -> None:
    rank = SlowRank(steps=10**6)
    s = SchedulerSide(CS, BS, [rank], pd_ranks=[rank], pd_wait_s=0.05, pd_async=True)
    params = {"do_remote_prefill": True, "remote_host": "h", "remote_port": 1, "kvmesh": {"keys": ["k"]}}
    r = req("d", 300, params)
    assert s.lookup(r, 0) is None
    time.sleep(0.1)
    assert s.lookup(r, 0) == 256


def test_worker_background_pull(pair: tuple[PdWorker, PdWorker]) -> None:
    prod, cons = pair
    toks, kv = prompt(2 * CS, seed=5)
    prod.engine.store(toks, kv)
    params = handshake(prod, "p-5", toks)
    assert cons.pull_start("d-5", toks, params) and cons.pull_start("d-5", toks, params)  # once
    eventually(lambda: cons.pull_done("d-5"), 5)
    assert cons.engine.lookup(toks) == 2 * CS and cons.stats()["pd_pulls"] == 1
    assert cons.pull_done("unknown")


def test_decode_half_finished_before_its_lookup_releases_the_producer() -> None:
    rank = PdRank()
    s = SchedulerSide(CS, BS, [rank], pd_ranks=[rank], pd_async=False)
    params = {"do_remote_prefill": True, "remote_host": "h", "remote_port": 1, "kvmesh": {"keys": []}}
    s.finished(req("gone", 300, params))  # e.g. vLLM's notify_kv_transfer_request_rejected
    assert [op for op, _ in rank.calls] == ["pd_confirm"]
    rank.calls.clear()
    r = req("d", 300, params)
    s.lookup(r, 0)
    s.finished(r)  # pulled already (the pull confirmed): nothing more
    assert [op for op, _ in rank.calls] == ["pd_pull", "lookup"]
