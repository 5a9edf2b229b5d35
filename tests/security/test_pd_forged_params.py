"""Finding 1 (consumer side): forged ``kv_transfer_params``. A real consumer (PdWorker, the
code vLLM's worker runs) is handed parameters that are unsigned, signed with another key,
expired, or re-addressed to a hostile server that accepts and never answers. It must
refuse each before connecting anywhere (no SSRF, no stall for the fetch timeout), count the
refusal, and load nothing; the genuine parameters of the same export still work."""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from kvmesh.core.fleetkey import TRANSFER_PARAMS, FleetKey
from kvmesh.integrations.vllm.pd import PdWorker, response_params
from tests.security.pd_peers import CS, FETCH_TIMEOUT_S, Silent, pair, prompt


def _export(prod: PdWorker, req: str, toks: list[int]) -> dict[str, Any]:
    answer = prod.export(req, toks)
    assert answer is not None
    return response_params("engine-p", [answer], key=prod.key, ttl_s=60)


def _resign(params: dict[str, Any], key: FleetKey, **ours: Any) -> dict[str, Any]:
    """``params`` with fields of the kvmesh map changed and signed again with ``key``."""
    out = copy.deepcopy(params)
    out["kvmesh"].update(ours)
    out["kvmesh"].pop("sig", None)
    signed = {k: out.get(k) for k in ("remote_host", "remote_port", "remote_engine_id")}
    signed["kvmesh"] = dict(out["kvmesh"])
    out["kvmesh"]["sig"] = key.sign_value(TRANSFER_PARAMS, signed)
    return out


def _forgeries(good: dict[str, Any], silent: int) -> dict[str, dict[str, Any]]:
    unsigned = copy.deepcopy(good)
    unsigned["kvmesh"].pop("sig", None)
    unsigned["kvmesh"].pop("expires", None)
    redirected = copy.deepcopy(good)
    redirected["remote_port"] = silent
    redirected["kvmesh"]["ports"] = [silent]
    rehosted = copy.deepcopy(redirected)
    rehosted["remote_host"] = "127.0.0.2"
    stranger = FleetKey([b"an attacker's own key, 32 bytes at least"])
    past = int(time.time()) - 5
    return {
        "unsigned, at the hostile server": {
            **unsigned,
            "remote_port": silent,
            "kvmesh": {**unsigned["kvmesh"], "ports": [silent]},
        },
        "genuine signature, port re-addressed": redirected,
        "genuine signature, host re-addressed": rehosted,
        "signed with another key": _resign(redirected, stranger),
        "another key, expired": _resign(
            {**good, "remote_port": silent}, stranger, ports=[silent], expires=past
        ),
    }


def test_forged_params_are_refused_before_any_connection(tmp_path: Path) -> None:
    silent = Silent()
    with pair(tmp_path) as (prod, cons):
        toks, kv = prompt(3 * CS)
        prod.engine.store(toks, kv)
        good = _export(prod, "p-1", toks)
        for name, forged in _forgeries(good, silent.port).items():
            t0 = time.monotonic()
            got = cons.pull(f"d-{name}", toks, forged)
            took = time.monotonic() - t0
            assert got["tokens"] == 0 and got["reason"], (name, got)
            assert took < 0.5, f"{name}: {took:.2f} s (the fetch timeout is {FETCH_TIMEOUT_S} s)"
            assert silent.accepted == 0, f"{name}: the consumer connected to the address it was given"
            assert cons.engine.lookup(toks) == 0
            assert not cons.confirm_params(forged) and silent.accepted == 0
        refused = cons.stats()["pd_fallbacks_total"]
        assert refused == {"params_unsigned": 1, "params_bad_signature": 4}, refused
        assert cons.stats()["pd_confirms_refused"] == 5
        # The genuine parameters still hand the prompt over.
        assert cons.pull("d-ok", toks, good)["reason"] is None
        assert torch.equal(cons.engine.retrieve(toks)[1], kv)
    silent.close()


def test_expired_signed_params_are_refused(tmp_path: Path) -> None:
    with pair(tmp_path) as (prod, cons):
        toks, kv = prompt(2 * CS, seed=2)
        prod.engine.store(toks, kv)
        stale = _resign(_export(prod, "p-2", toks), prod.key, expires=int(time.time()) - 1)  # type: ignore[arg-type]
        got = cons.pull("d-2", toks, stale)
        assert got["reason"] == "params_expired" and cons.engine.lookup(toks) == 0
        assert prod.stats()["pd_served_fetches"] == 0


@pytest.mark.parametrize("field", ["keys", "transfer_id", "num_tokens"])
def test_signature_covers_what_the_consumer_acts_on(tmp_path: Path, field: str) -> None:
    with pair(tmp_path) as (prod, cons):
        toks, kv = prompt(2 * CS, seed=3)
        prod.engine.store(toks, kv)
        params = _export(prod, "p-3", toks)
        ours = params["kvmesh"]
        ours[field] = (
            ours[field][:1] if field == "keys" else (ours[field] + "x" if field == "transfer_id" else 1)
        )
        assert cons.pull("d-3", toks, params)["reason"] == "params_bad_signature"
        assert prod.stats()["pd_served_fetches"] == 0
