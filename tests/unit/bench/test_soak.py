"""The soak's verdicts: each way a request can end is classified, and the timeline maths.

The server here is a small aiohttp app on a real loopback socket that misbehaves on purpose
(fault injection: a 503 with Retry-After, a 500, a cut stream, a stall), so every outcome
class is exercised without starting vLLM.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator

import httpx
import pytest
from aiohttp import web

from kvmesh.bench.soak.bench import schedule
from kvmesh.bench.soak.load import Client, Prompt, Record, chat_load, summarize, timeline
from kvmesh.bench.soak.verdict import hit_slack, recovery_s


async def _chat(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    mode = body["messages"][1]["content"]
    if mode == "drop":  # closed before any answer: what a router closing keep-alives does
        assert request.transport is not None
        request.transport.close()
        return web.Response()
    if mode == "busy":
        return web.json_response({"error": "no replica"}, status=503, headers={"Retry-After": "1"})
    if mode == "broken":
        return web.json_response({"error": "boom"}, status=500)
    if mode == "stall":
        await asyncio.sleep(2.5)  # past the 1 s deadline the test gives it
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    text = "bad" if mode == "lie" else "hello"
    chunk = {"choices": [{"delta": {"content": text}}]}
    await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
    if mode == "broke":
        error = {"error": {"message": "replica r broke off the stream", "code": 502}}
        await resp.write(f"data: {json.dumps(error)}\n\n".encode())
        return resp
    if mode == "cut":
        assert request.transport is not None
        request.transport.close()
        return resp
    usage = {"usage": {"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": 75}}}
    await resp.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
    return resp


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    import threading

    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", _chat)
    runner = web.AppRunner(app, shutdown_timeout=5.0)
    loop.run_until_complete(runner.setup())
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    site = web.SockSite(runner, sock)
    loop.run_until_complete(site.start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def _classify(url: str, mode: str, deadline_s: float = 2.0) -> Record:
    client = Client(url, "tiny", max_tokens=4, deadline_s=deadline_s)

    async def go() -> Record:
        async with httpx.AsyncClient() as http:
            record, _ = await client.one(http, Prompt(mode, "system", mode))
            return record

    return asyncio.run(go())


@pytest.mark.parametrize(
    ("mode", "outcome"),
    [
        ("ok", "correct"),
        ("busy", "retryable"),
        ("broken", "error"),
        ("cut", "interrupted"),
        ("drop", "router_down"),
        ("broke", "broken_stream"),
        ("stall", "hang"),
    ],
)
def test_every_ending_is_classified(server_url: str, mode: str, outcome: str) -> None:
    record = _classify(server_url, mode, deadline_s=1.0)
    assert record.outcome == outcome, record.detail
    if outcome == "correct":
        assert (record.prompt_tokens, record.cached_tokens) == (100, 75)
    if outcome == "hang":
        assert 0.9 <= record.end - record.start < 5.0


def test_a_refused_connection_is_router_down() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    assert _classify(f"http://127.0.0.1:{port}", "ok").outcome == "router_down"


def test_an_answer_that_differs_from_its_reference_is_wrong(server_url: str) -> None:
    records: list[Record] = []
    pool = [Prompt("ok", "s", "ok"), Prompt("lie", "s", "lie")]
    client = Client(server_url, "tiny", max_tokens=4, deadline_s=2.0)
    asyncio.run(
        chat_load(
            client,
            pool,
            {"ok": "hello", "lie": "hello"},
            2,
            should_stop=lambda t: t >= 0.5,
            on_record=records.append,
        )
    )
    by = summarize(records)
    assert by["correct"] > 0 and by["wrong"] > 0
    assert {r.prompt for r in records if r.outcome == "wrong"} == {"lie"}
    assert by["examples"] and by["examples"][0]["outcome"] == "wrong"


def _rec(end: float, outcome: str = "correct", cached: int = 90) -> Record:
    return Record("p", end - 0.1, end, outcome, 100, cached)  # type: ignore[arg-type]


def test_recovery_is_the_first_clean_window_at_the_old_hit_rate() -> None:
    records = [_rec(t / 2) for t in range(0, 20)]  # 0..9.5 s: baseline 0.9
    records += [_rec(10 + t / 2, "interrupted") for t in range(4)]  # the fault's tail
    records += [_rec(12 + t / 2, cached=10) for t in range(6)]  # cold caches: low hit rate
    records += [_rec(15 + t / 2) for t in range(40)]  # back to normal from 15 s
    # A window of 10 answers may sit two standard errors (2 x sqrt(0.9 x 0.1 / 10) = 0.19)
    # below 0.9 x 0.9: [13.5, 18.5) has three cold answers, seven warm: 0.66 >= 0.62; from
    # 13.0 four cold: 0.58.
    assert recovery_s(records, fault_end=10.0, baseline=0.9, window_s=5.0) == pytest.approx(3.5)
    assert hit_slack(0.9, 10) == pytest.approx(0.19, abs=0.001)
    assert recovery_s(records[:30], fault_end=10.0, baseline=0.9, window_s=5.0) is None


def test_timeline_bins_and_schedule() -> None:
    bins = timeline([_rec(0.5), _rec(1.5, "hang"), _rec(6.0)], duration=10.0, bin_s=5.0)
    assert [b["completed_per_s"] for b in bins] == [0.2, 0.2, 0.0]
    assert [b["failed"] for b in bins] == [1, 0, 0]
    assert bins[0]["hit_rate"] == pytest.approx(0.9) and bins[2]["hit_rate"] is None
    plan = schedule(100.0, ("a", "b", "c"))
    assert [name for _, name in plan] == ["a", "b", "c"]
    assert plan[0][0] == pytest.approx(15.0) and plan[-1][0] == pytest.approx(70.0)
    assert schedule(100.0, ()) == []
