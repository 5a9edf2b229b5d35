"""The pure parts of ``kvmesh bench ttft``: prompts, statistics, specs, targets, the report.

The vLLM runs themselves are exercised by ``kvmesh bench ttft --quick``; here the worker is
replaced by canned rows so the orchestration, JSON and plot are checked in milliseconds.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from kvmesh.bench import ttft, ttft_spec
from kvmesh.config import CacheConfig


# -- prompts -----------------------------------------------------------------------------------
def test_prompt_is_deterministic_and_exact_length() -> None:
    a = ttft_spec.make_prompt(500, 3, vocab=4096, seed=0)
    assert a == ttft_spec.make_prompt(500, 3, vocab=4096, seed=0)
    assert len(a) == 500
    assert a[0] == 1
    assert all(6 <= t < 4096 for t in a[1:])


def test_prompts_differ_from_the_second_token() -> None:
    prompts = [ttft_spec.make_prompt(n, k, 4096) for n in (500, 1000, 2000) for k in ("warmup", 0, 1, 2)]
    prompts.append(ttft_spec.make_prompt(500, 0, 4096, seed=1))
    heads = {tuple(p[1:8]) for p in prompts}
    assert len(heads) == len(prompts)  # no two prompts share even the first block


def test_prompt_does_not_depend_on_pythonhashseed() -> None:
    import subprocess
    import sys

    code = "from kvmesh.bench.ttft_spec import make_prompt; print(make_prompt(50, 'warmup', 4096)[:10])"
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in ("1", "2")
    }
    assert len(outs) == 1


@pytest.mark.parametrize(("length", "vocab"), [(1, 4096), (10, 7)])
def test_prompt_rejects_bad_arguments(length: int, vocab: int) -> None:
    with pytest.raises(ValueError):
        ttft_spec.make_prompt(length, 0, vocab)


# -- statistics --------------------------------------------------------------------------------
def test_logprob_diff() -> None:
    a = [{5: -0.1, 7: -2.0}, {3: -0.5, 4: -1.0}]
    b = [{5: -0.1 + 3e-5, 7: -2.0}, {3: -0.5, 4: -1.0 - 1e-6}]
    diff, mismatches = ttft_spec.logprob_diff(a, b)
    assert diff == pytest.approx(3e-5)
    assert mismatches == 0


def test_logprob_diff_counts_different_token_sets() -> None:
    diff, mismatches = ttft_spec.logprob_diff([{1: -0.1, 2: -0.2}], [{1: -0.1, 3: -0.2}])
    assert mismatches == 1
    assert diff == 0.0
    with pytest.raises(ValueError, match="steps"):
        ttft_spec.logprob_diff([{1: 0.0}], [])


def _worker_row(n: int, reload: list[float], diff: float = 1e-5, mismatches: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": n,
        "cold_s": [1.0] * len(reload),
        "reload_s": reload,
        "cached_tokens": [n - n % 256] * len(reload),
        "max_logprob_diff": diff,
        "top5_mismatches": mismatches,
        "page_cache_dropped": True,
    }


def test_summarize() -> None:
    r = ttft_spec.summarize("kvmesh_cpu", _worker_row(2000, [0.3, 0.1, 0.2, 0.5, 0.4]))
    assert r["setup"] == "kvmesh_cpu"
    assert r["prompt_tokens"] == 2000
    assert r["ttft_s_median"] == 0.3
    assert r["ttft_s_p90"] == pytest.approx(0.46)
    assert r["runs"] == [0.3, 0.1, 0.2, 0.5, 0.4]
    assert r["cold_s_median"] == 1.0
    assert r["logprobs_ok"] is True
    assert ttft_spec.summarize("x", _worker_row(500, [0.1], diff=2e-4))["logprobs_ok"] is False
    assert ttft_spec.summarize("x", _worker_row(500, [0.1], mismatches=1))["logprobs_ok"] is False


def _result(setup: str, n: int, median: float | None) -> dict[str, Any]:
    return {"setup": setup, "prompt_tokens": n, "ttft_s_median": median, "ttft_s_p90": median}


def test_targets() -> None:
    results = [
        _result("recompute", 2000, 1.2),
        _result("example_connector", 2000, 0.16),
        _result("lmcache_mp", 2000, 0.20),
        _result("kvmesh_cpu", 2000, 0.12),
        _result("kvmesh_disk", 2000, 0.2),
        _result("kvmesh_cpu", 500, 9.0),  # another length: ignored
    ]
    t = ttft_spec.compute_targets(results)
    assert t["prompt_tokens"] == 2000
    assert t["kvmesh_cpu/recompute"] == {"value": 0.1, "target": "<= 0.5", "met": True}
    assert t["kvmesh_cpu/min(example_connector,lmcache_mp)"]["value"] == 0.75  # vs the faster peer
    assert t["kvmesh_cpu/min(example_connector,lmcache_mp)"]["met"] is True
    assert t["kvmesh_disk/example_connector"]["value"] == 1.25
    assert t["kvmesh_disk/example_connector"]["met"] is False


def test_targets_with_missing_setups() -> None:
    results = [_result("recompute", 2000, 1.0), _result("example_connector", 2000, 0.2)]
    results += ttft_spec.unavailable("kvmesh_cpu", [2000], "not available: boom")
    t = ttft_spec.compute_targets(results)
    cpu = t["kvmesh_cpu/recompute"]
    assert cpu["value"] is None and cpu["met"] is None and cpu["missing"] == ["kvmesh_cpu"]
    peers = t["kvmesh_cpu/min(example_connector,lmcache_mp)"]
    assert peers["missing"] == ["kvmesh_cpu", "lmcache_mp"]


def test_unavailable_rows() -> None:
    rows = ttft_spec.unavailable("lmcache_mp", [500, 2000], "not available: RuntimeError: x")
    assert [r["prompt_tokens"] for r in rows] == [500, 2000]
    assert all(r["ttft_s_median"] is None and r["error"] == "not available: RuntimeError: x" for r in rows)


# -- setup specs -------------------------------------------------------------------------------
def test_specs_share_the_fairness_settings(tmp_path: Path) -> None:
    specs = [
        ttft_spec.build_spec(
            s, "/m", [500], 5, str(tmp_path), lmcache_port=5555, redis_url="redis://127.0.0.1:1"
        )
        for s in ttft_spec.SETUPS
    ]
    for spec in specs:
        assert spec.llm_args == ttft_spec.FAIR_LLM_ARGS
        assert spec.llm_args["disable_hybrid_kv_cache_manager"] is True
        assert spec.llm_args["enable_prefix_caching"] is True
        assert spec.drop_page_cache is True
        assert spec.settle_s == specs[0].settle_s
        json.dumps(asdict(spec))  # the worker gets it as JSON
    assert ttft_spec.FAIR_ENV["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"
    assert ttft_spec.FAIR_ENV["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert ttft_spec.FAIR_ENV["LMCACHE_TRACK_USAGE"] == "false"


def test_spec_connectors(tmp_path: Path) -> None:
    w = str(tmp_path)
    assert ttft_spec.build_spec("recompute", "/m", [500], 5, w).kv_connector is None
    ex = ttft_spec.build_spec("example_connector", "/m", [500], 5, w)
    assert ex.kv_connector == "ExampleConnector"
    assert ex.kv_connector_extra_config["shared_storage_path"].startswith(w)
    lm = ttft_spec.build_spec("lmcache_mp", "/m", [500], 5, w, lmcache_port=6000)
    assert lm.kv_connector == "LMCacheMPConnector"
    assert lm.kv_connector_extra_config == {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": 6000}
    cpu = ttft_spec.build_spec("kvmesh_cpu", "/m", [500], 5, w)
    disk = ttft_spec.build_spec("kvmesh_disk", "/m", [500], 5, w)
    red = ttft_spec.build_spec("kvmesh_redis", "/m", [500], 5, w, redis_url="redis://127.0.0.1:7")
    for spec in (cpu, disk, red):
        assert spec.kv_connector == "KVMeshConnector"
        assert spec.kv_connector_module_path == "kvmesh.integrations.vllm"
        assert spec.kvmesh_wait_writes is True
        CacheConfig.from_dict(spec.kv_connector_extra_config)  # valid kvmesh config keys
    assert cpu.kvmesh_clear_cpu is False
    assert disk.kvmesh_clear_cpu is True and disk.kv_connector_extra_config["local_disk"].startswith(w)
    assert disk.kv_connector_extra_config["write_mode"] == "through"
    assert (
        red.kvmesh_clear_cpu is True and red.kv_connector_extra_config["remote_url"] == "redis://127.0.0.1:7"
    )
    assert "local_disk" not in red.kv_connector_extra_config
    small = ttft_spec.build_spec("kvmesh_disk", "/m", [500], 5, w, kvmesh_overrides={"chunk_size": 128})
    assert small.kv_connector_extra_config["chunk_size"] == 128
    assert small.kv_connector_extra_config["local_disk"] == disk.kv_connector_extra_config["local_disk"]


def test_spec_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown setup"):
        ttft_spec.build_spec("vllm_magic", "/m", [500], 5, str(tmp_path))
    with pytest.raises(ValueError, match="lmcache server"):
        ttft_spec.build_spec("lmcache_mp", "/m", [500], 5, str(tmp_path))
    with pytest.raises(ValueError, match="Redis"):
        ttft_spec.build_spec("kvmesh_redis", "/m", [500], 5, str(tmp_path))


def test_env_puts_extra_path_first() -> None:
    env = ttft.worker_env("/peers", {"PYTHONPATH": "/a", "X": "1"})
    assert env["PYTHONPATH"] == os.pathsep.join(["/peers", "/a"])
    assert env["X"] == "1" and env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"
    assert "PYTHONPATH" not in ttft.worker_env(None, {})


def test_root_cause_is_the_first_exception_line() -> None:
    log = "\n".join(
        [
            "INFO 11-30 08:27:20 [core.py:1] starting",
            "(Worker pid=781) ERROR 11-30 08:27:25 [mp.py:871] Traceback (most recent call last):",
            "(Worker pid=781) ERROR 11-30 08:27:25 [mp.py:871] kvmesh.errors.ConfigError: "
            "unknown kv_connector_extra_config key(s) 'bogus_key'",
            "(EngineCore pid=710) ERROR 11-30 08:27:25 [core.py:1510] RuntimeError: Worker failed: 'x'",
            "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
        ]
    )
    assert ttft.root_cause(log) == (
        "kvmesh.errors.ConfigError: unknown kv_connector_extra_config key(s) 'bogus_key'"
    )
    assert ttft.root_cause("all fine\nno errors here") is None


# -- orchestration with canned workers -----------------------------------------------------------
def test_run_writes_json_table_and_plot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(ttft, "ensure_model", lambda model_dir, preset: str(model_dir))
    speed = {"recompute": 1.0, "example_connector": 0.2, "lmcache_mp": 0.25, "kvmesh_cpu": 0.15}

    def fake_setup(
        setup: str,
        model_dir: str,
        lengths: list[int],
        trials: int,
        base_dir: str,
        timeout: float,
        overrides: dict[str, Any] | None,
    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        assert overrides == {"chunk_size": 128}
        assert trials == 3  # quick
        if setup not in speed:
            err = "not available: ModuleNotFoundError: No module named 'x'"
            return ttft_spec.unavailable(setup, lengths, err), {"error": err}
        rows = [
            ttft_spec.summarize(setup, _worker_row(n, [speed[setup] * n / 2000] * trials)) for n in lengths
        ]
        return rows, {"engine_start_s": 1.0}

    monkeypatch.setattr(ttft, "run_setup", fake_setup)
    out = ttft.run(
        quick=True,
        json_path=str(tmp_path / "ttft.json"),
        plot_path=str(tmp_path / "ttft.png"),
        model_dir=str(tmp_path / "model"),
        setups=["recompute", "example_connector", "lmcache_mp", "kvmesh_cpu", "kvmesh_disk"],
        lengths=[2000, 500, 1000],
        kvmesh_overrides={"chunk_size": 128},
    )
    saved = json.loads((tmp_path / "ttft.json").read_text())
    assert saved["targets"] == out["targets"]
    assert saved["targets"]["kvmesh_cpu/recompute"]["value"] == 0.15
    assert saved["targets"]["kvmesh_cpu/min(example_connector,lmcache_mp)"]["value"] == 0.75
    assert saved["targets"]["kvmesh_disk/example_connector"]["value"] is None
    assert {r["setup"] for r in saved["results"]} == set(speed) | {"kvmesh_disk"}
    assert [r["prompt_tokens"] for r in saved["results"] if r["setup"] == "recompute"] == [500, 1000, 2000]
    assert saved["env"]["quick"] is True and saved["env"]["trials"] == 3
    assert saved["setups"]["kvmesh_disk"]["error"].startswith("not available: ")
    assert (tmp_path / "ttft.png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert "ttft_ms_median" in printed and "kvmesh_cpu/recompute" in printed


def test_run_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unknown setup"):
        ttft.run(setups=["recompute", "nope"])
    with pytest.raises(ValueError, match="prompt lengths"):
        ttft.run(setups=["recompute"], lengths=[5000])


def test_kvmesh_setups_are_skipped_with_the_import_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(ttft, "kvmesh_connector_error", lambda: "ModuleNotFoundError: No module named 'x'")
    rows, notes = ttft.run_setup("kvmesh_cpu", "/m", [500, 2000], 3, str(tmp_path), 10.0)
    assert notes["error"] == "not available: ModuleNotFoundError: No module named 'x'"
    assert [r["prompt_tokens"] for r in rows] == [500, 2000]
    assert list(tmp_path.iterdir()) == []  # nothing started


def test_worker_usage() -> None:
    from kvmesh.bench import ttft_worker

    assert ttft_worker.main([]) == 2
