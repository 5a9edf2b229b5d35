"""kvmesh.bodylimits and kvmesh.bodyworker: JSON depth and value bounds, prompt bounds, and
the worker process that checks large bodies (a real subprocess over its pipes)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.bodylimits import PromptLimits, check_prompt, check_shape, decode_json, decode_request
from kvmesh.bodyworker import BodyChecker
from kvmesh.errors import BodyError

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**60), 2**60) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner, max_size=4),
    max_leaves=40,
)


def depth(v: Any) -> int:
    """Containers nested in ``v`` (the reference the walk is checked against)."""
    if isinstance(v, dict):
        return 1 + max(map(depth, v.values()), default=0)
    if isinstance(v, list):
        return 1 + max(map(depth, v), default=0)
    return 0


def values(v: Any) -> int:
    if isinstance(v, dict):
        return len(v) + sum(map(values, v.values()))
    if isinstance(v, list):
        return len(v) + sum(map(values, v))
    return 0


@settings(max_examples=300, deadline=None)
@given(JSON, st.integers(1, 8), st.integers(0, 60))
def test_check_shape_is_exactly_depth_and_count(value: Any, max_depth: int, max_values: int) -> None:
    ok = depth(value) <= max_depth and values(value) <= max_values
    try:
        check_shape(value, max_depth, max_values)
    except BodyError as exc:
        assert not ok and exc.status == 400 and exc.field == "body"
    else:
        assert ok


@pytest.mark.parametrize("n", [65, 1000, 100_000])
def test_deep_json_is_a_400_naming_the_body(n: int) -> None:
    with pytest.raises(BodyError) as err:
        decode_json(b"[" * n + b"]" * n)
    assert (err.value.status, err.value.field) == (400, "body") and "64 levels" in err.value.message
    assert decode_json(b"[" * 64 + b"]" * 64) == decode_json(b"[" * 64 + b"]" * 64)  # 64 is fine


def test_invalid_json_status_is_the_callers() -> None:
    with pytest.raises(BodyError) as err:
        decode_json(b"{nope", invalid_status=422)
    assert err.value.status == 422 and "not valid JSON" in err.value.message


LIMITS = PromptLimits(max_tokens=100, chars_per_token=4)


@pytest.mark.parametrize(
    ("body", "chat", "field"),
    [
        ({"prompt": list(range(101))}, False, "prompt"),
        ({"prompt": [[1], list(range(101))]}, False, "prompt"),  # a batch: every prompt counts
        ({"prompt": "x" * 401}, False, "prompt"),
        ({"prompt": ["ok", "x" * 401]}, False, "prompt"),
        ({"messages": [{"role": "user", "content": "x" * 401}]}, True, "messages"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "x" * 201}] * 2}]},
            True,
            "messages",
        ),
    ],
)
def test_prompts_that_cannot_fit_are_refused(body: dict[str, Any], chat: bool, field: str) -> None:
    with pytest.raises(BodyError) as err:
        check_prompt(body, chat, LIMITS)
    assert (err.value.status, err.value.field) == (400, field) and "100 tokens" in err.value.message


def test_prompts_that_may_fit_pass() -> None:
    for body, chat in (
        ({"prompt": list(range(100))}, False),
        ({"prompt": "x" * 400}, False),
        ({"messages": [{"role": "user", "content": "x" * 400}]}, True),
        ({"prompt": list(range(10_000))}, True),  # a chat body's prompt field is not the prompt
    ):
        check_prompt(body, chat, LIMITS)
    check_prompt({"prompt": list(range(10**5))}, False, PromptLimits())  # max_model_len unknown


def test_decode_request_refuses_non_objects() -> None:
    with pytest.raises(BodyError, match="JSON object"):
        decode_request(b"[1, 2]", False, LIMITS)


def test_worker_checks_large_bodies_and_recovers_when_it_dies() -> None:
    async def run() -> None:
        checker = BodyChecker(offload_bytes=1024, timeout_s=20)
        try:
            big_ok = json.dumps({"prompt": "y" * 2000, "x": list(range(50))}).encode()
            assert (await checker.decode(big_ok, False, PromptLimits(max_tokens=1000)))["x"][-1] == 49
            too_long = json.dumps({"prompt": list(range(5000))}).encode()
            with pytest.raises(BodyError) as err:
                await checker.decode(too_long, False, PromptLimits(max_tokens=1000))
            assert (err.value.status, err.value.field) == (400, "prompt")
            deep = b'{"prompt": "a", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}"
            with pytest.raises(BodyError, match="nested"):
                await checker.decode(deep, False, LIMITS)
            roomy = PromptLimits(max_tokens=1000)
            first = checker._proc
            assert first is not None
            first.kill()  # a dead worker (killed, out of memory) is replaced before the next body
            await first.wait()
            assert await checker.decode(big_ok, False, roomy)
            hung = checker._proc
            assert hung is not None and hung.pid != first.pid
            os.kill(hung.pid, signal.SIGSTOP)  # a hung one costs one 503 at its deadline
            checker.timeout_s = 1.0
            with pytest.raises(BodyError) as err:
                await checker.decode(big_ok, False, roomy)
            assert err.value.status == 503
            assert await checker.decode(big_ok, False, roomy)
            assert checker._proc is not None and checker._proc.pid not in (first.pid, hung.pid)
        finally:
            await checker.close()
        assert checker._proc is None

    asyncio.run(run())
