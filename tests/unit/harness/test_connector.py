"""The prefill/decode connector configs the harness builds are ones vLLM and kvmesh accept."""

from __future__ import annotations

import pytest

from kvmesh.errors import ConfigError
from kvmesh.harness.connector import consumer_config, pd_config, producer_config
from kvmesh.integrations.vllm.options import ConnectorOptions


def test_producer_and_consumer_configs() -> None:
    p = producer_config(kv_ip="127.0.0.1", pd_pin_timeout_s=5)
    assert (p["kv_role"], p["kv_port"], p["kv_load_failure_policy"]) == ("kv_producer", 0, "recompute")
    opts = ConnectorOptions.from_extra_config(p["kv_connector_extra_config"], environ={})
    assert (opts.kv_ip, opts.pd_pin_timeout_s) == ("127.0.0.1", 5.0)
    c = consumer_config("redis://h:1", pd_fetch_timeout_s=2)
    assert c["kv_role"] == "kv_consumer" and c["kv_connector_extra_config"]["remote_url"] == "redis://h:1"
    assert (
        ConnectorOptions.from_extra_config(c["kv_connector_extra_config"], environ={}).pd_fetch_timeout_s
        == 2.0
    )
    with pytest.raises(ConfigError, match="kv_role"):
        pd_config("prefill")
    with pytest.raises(ConfigError, match="pd_pin_timeout_s must be positive"):
        ConnectorOptions.from_extra_config({"pd_pin_timeout_s": 0}, environ={})


def test_vllm_accepts_the_config() -> None:
    kv = pytest.importorskip("vllm.config")
    cfg = kv.KVTransferConfig(**producer_config(kv_port=0))
    assert cfg.is_kv_producer and not cfg.is_kv_consumer and cfg.kv_port == 0
    assert kv.KVTransferConfig(**consumer_config()).is_kv_consumer
