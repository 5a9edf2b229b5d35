"""kvmesh.router.body: the client's kv_transfer_params, and max_model_len from the replicas."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmesh.errors import BodyError
from kvmesh.router import RouterConfig
from kvmesh.routing.body import RequestBodies, drop_transfer_params
from kvmesh.routing.config import ReplicaConfig
from kvmesh.routing.pool import Pool
from kvmesh.routing.tokenize import PromptTokenizer


def test_drop_transfer_params() -> None:
    body = {
        "prompt": "p",
        "kv_transfer_params": {"remote_host": "evil"},
        "vllm_xargs": {"kv_transfer_params": 1, "a": 2},
    }
    assert drop_transfer_params(body)
    assert body == {"prompt": "p", "vllm_xargs": {"a": 2}}
    assert not drop_transfer_params(body)
    assert not drop_transfer_params({"prompt": "p", "vllm_xargs": "not a dict"})


def test_max_model_len_config_first_then_the_largest_healthy_replica(tok_dir: Path) -> None:
    pool = Pool([ReplicaConfig(url="http://a:1", name="a"), ReplicaConfig(url="http://b:1", name="b")])
    bodies = RequestBodies(RouterConfig(), None, pool)
    assert bodies.limits().max_tokens is None  # nothing known: nothing refused
    for name, n, healthy in (("a", 4096, True), ("b", 32768, False)):
        pool.replicas[name].max_model_len = n
        pool.replicas[name].state.healthy = healthy
    assert bodies.limits().max_tokens == 4096
    pool.replicas["b"].state.healthy = True
    assert bodies.limits().max_tokens == 32768
    with pytest.raises(BodyError) as err:
        bodies.check_tokens(32769, chat=True)
    assert err.value.field == "messages" and err.value.status == 400
    fixed = RequestBodies(RouterConfig(max_model_len=100), PromptTokenizer.from_dir(tok_dir), pool)
    assert fixed.limits().max_tokens == 100
    assert fixed.limits().chars_per_token >= 2  # the tokenizer's longest token, with slack
