"""Fuzzing the router's OpenAI request parsing: the tokenizer's reading of completion and chat
bodies, and whole requests over real loopback HTTP to a router in front of two fake vLLM
servers. Whatever arrives, the router answers: a prompt it cannot read routes by load (the
replica gives the real error) or is a 4xx naming the field; never a 500, never a crash."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvmesh.errors import TokenizeError
from kvmesh.router import RouterConfig
from kvmesh.router.server import Router
from kvmesh.router.testing import FakeVLLM, write_test_tokenizer
from kvmesh.routing.config import ReplicaConfig
from kvmesh.routing.tokenize import PromptTokenizer

FUZZ = settings(
    deadline=None,
    max_examples=200,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
HTTP_FUZZ = settings(FUZZ, max_examples=60)

JSON = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**70), 2**70),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=20),
    ),
    lambda kids: st.one_of(
        st.lists(kids, max_size=4), st.dictionaries(st.text(max_size=10), kids, max_size=4)
    ),
    max_leaves=20,
)
RESERVED = ["messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token", "x"]
CONTENT = st.one_of(
    st.none(),
    st.text(max_size=40),
    st.lists(
        st.one_of(
            st.fixed_dictionaries({"type": st.just("text"), "text": st.one_of(st.text(max_size=20), JSON)}),
            st.fixed_dictionaries({"type": st.sampled_from(["image_url", "text", 3]), "image_url": JSON}),
            JSON,
        ),
        max_size=3,
    ),
    JSON,
)
MESSAGE = st.one_of(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant", "tool"]), "content": CONTENT},
        optional={"name": JSON, "tool_calls": JSON},
    ),
    st.fixed_dictionaries({"role": JSON, "content": CONTENT}),
    JSON,
)
BODY = st.fixed_dictionaries(
    {},
    optional={
        "model": st.one_of(st.just("tiny"), JSON),
        "prompt": st.one_of(
            st.text(max_size=60),
            st.lists(st.text(max_size=20), max_size=3),
            st.lists(st.integers(-5, 2**33), max_size=8),
            JSON,
        ),
        "messages": st.one_of(st.lists(MESSAGE, max_size=4), JSON),
        "add_special_tokens": JSON,
        "add_generation_prompt": JSON,
        "continue_final_message": JSON,
        "chat_template_kwargs": st.one_of(st.dictionaries(st.sampled_from(RESERVED), JSON, max_size=3), JSON),
        "tools": JSON,
        "stream": st.one_of(st.booleans(), JSON),
        "max_tokens": JSON,
        "cache_salt": JSON,
    },
)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_test_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tokenizer(tok_dir: Path) -> PromptTokenizer:
    return PromptTokenizer.from_dir(tok_dir)


@FUZZ
@given(body=BODY)
@example(body={"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"messages": []}})
@example(
    body={
        "messages": [{"role": "user", "content": "hi"}],
        "chat_template_kwargs": {"add_generation_prompt": 1},
    }
)
def test_tokenizer_reads_any_body_or_raises_tokenize_error(
    tokenizer: PromptTokenizer, body: dict[str, Any]
) -> None:
    for fn in (tokenizer.completion, tokenizer.chat):
        try:
            ids = fn(body)
        except TokenizeError:
            continue
        assert isinstance(ids, np.ndarray) and ids.dtype == np.uint32


@pytest.fixture(scope="module")
def router(tok_dir: Path) -> Iterator[Router]:
    fakes = [FakeVLLM(n).start() for n in ("a", "b")]
    cfg = RouterConfig(
        model=str(tok_dir),
        replicas=tuple(ReplicaConfig(url=f.url, name=f.name) for f in fakes),
        port=0,
        health_interval_s=0.2,
        max_body_bytes=1 << 16,
        replica_header=True,  # tells a replica's answer from the router's own refusal
    )
    r = Router(cfg).start()
    try:
        with httpx.Client(timeout=10) as c:
            for _ in range(50):
                if c.get(r.url + "/health").status_code == 200:
                    break
                import time

                time.sleep(0.1)
        yield r
    finally:
        r.stop()
        for f in fakes:
            f.stop()


def _check(resp: httpx.Response) -> None:
    assert resp.status_code < 500, resp.text
    if resp.status_code >= 400 and "x-kvmesh-replica" not in resp.headers:
        err = resp.json()["error"]  # the router's own rejection: OpenAI's shape, naming the field
        assert err["param"], err
        assert err["code"] == resp.status_code


@HTTP_FUZZ
@given(body=BODY, chat=st.booleans())
@example(body={"model": ["tiny"]}, chat=False)
@example(body={"model": {"a": 1}, "prompt": "x"}, chat=True)
def test_router_answers_any_json_body_without_a_500(router: Router, body: dict[str, Any], chat: bool) -> None:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    _check(httpx.post(router.url + path, json=body, timeout=10))


@HTTP_FUZZ
@given(raw=st.one_of(st.binary(max_size=200), JSON.map(lambda v: __import__("json").dumps(v).encode())))
@example(raw=b"x" * (1 << 17))  # over max_body_bytes
def test_router_answers_any_bytes_without_a_500(router: Router, raw: bytes) -> None:
    resp = httpx.post(
        router.url + "/v1/completions", content=raw, headers={"Content-Type": "application/json"}
    )
    _check(resp)
