"""The processes of ``kvmesh bench ttft`` seen from the parent: a setup's worker (started,
driven one command at a time, its log kept), its environment, why it failed, and the record
of the machine the run was on."""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import queue
import re
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from kvmesh.bench.common.peers import lmcache_pythonpath, with_pythonpath
from kvmesh.bench.runner import REPO_ROOT
from kvmesh.bench.ttft.spec import FAIR_ENV, FAIR_LLM_ARGS
from kvmesh.bench.ttft.worker import PREFIX
from kvmesh.errors import ProcessError
from kvmesh.harness.processes import log_tail, own_tmp, stop_process, track_tmp


def worker_env(extra_path: str | None, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a worker or peer: ``base`` (default: this process's) with the
    fairness settings, ``extra_path`` first on PYTHONPATH. A ``VLLM_CPU_KVCACHE_SPACE`` from
    the caller goes: it would override every setup's ``kv_cache_memory_bytes``."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    return with_pythonpath(extra_path, {**env, **FAIR_ENV})


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
    """The run's software and model (the host, commit, date and load average are the
    runner's provenance, beside this in the JSON)."""
    model_cfg: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        cfg = json.loads(Path(model_dir, "config.json").read_text())
        keys = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "vocab_size")  # fmt: skip
        model_cfg = {k: cfg.get(k) for k in keys}
    peers = lmcache_pythonpath()
    return {
        "vllm": _version("vllm-cpu") or _version("vllm"),
        "torch": _version("torch"),
        "lmcache": _version("lmcache", peers) if peers else (_version("lmcache") if peers == "" else None),
        "lmcache_path": peers,
        "model_dir": model_dir,
        "model": model_cfg,
        "quick": quick,
        "trials": trials,
        "warmup_cycles_per_length": 1,
        "fair_env": {k: v for k, v in FAIR_ENV.items() if k.startswith(("VLLM_", "HF_"))},
        "fair_llm_args": FAIR_LLM_ARGS,
    }


def mem_available_gib() -> float | None:
    """MemAvailable from /proc/meminfo in GiB (None where there is none)."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        line = next(
            ln for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemAvailable:")
        )
        return int(line.split()[1]) / 2**20
    return None


def parse_answer(text: str) -> dict[str, Any]:
    """The JSON object of one protocol line. Text that another process wrote onto the same
    line after it is left out; a line without an object answers ``{"error"}`` (the reader
    thread never dies on it, which would leave every later answer waiting out its timeout)."""
    try:
        obj, _ = json.JSONDecoder().raw_decode(text)
    except ValueError as exc:
        return {"error": f"unreadable answer ({exc}): {text[:200]!r}"}
    return obj if isinstance(obj, dict) else {"error": f"answer is not an object: {text[:200]!r}"}


# -- one worker ----------------------------------------------------------------------------------
class Worker:
    """One setup's :mod:`kvmesh.bench.ttft.worker` process: started, then driven one command
    at a time. Its output goes to a log file; protocol lines go to :meth:`call` as well."""

    def __init__(
        self,
        setup: str,
        spec_path: str,
        log_path: str,
        extra_path: str | None,
        module: str = "kvmesh.bench.ttft.worker",  # bench stall's worker speaks the same protocol
    ) -> None:
        self.setup, self.log_path = setup, log_path
        env, tmp = own_tmp(worker_env(extra_path), prefix="kvmesh-vllm-")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, spec_path],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            start_new_session=True,  # vLLM's engine and worker processes join our group
            cwd=str(REPO_ROOT),
        )
        track_tmp(self.proc, tmp)  # vLLM's sockets: removed at stop_process
        self._answers: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True)
        self._reader.start()

    def _read(self, stream: IO[str] | None) -> None:
        with open(self.log_path, "w") as log:
            for line in stream or ():
                log.write(line)
                log.flush()
                if line.startswith(PREFIX):
                    self._answers.put(parse_answer(line[len(PREFIX) :]))
                elif line.startswith("[ttft]"):
                    print("  " + line[len("[ttft] ") :].rstrip(), flush=True)
        self._answers.put(None)  # the worker is gone

    def answer(self, timeout: float) -> dict[str, Any]:
        """The worker's next answer; ProcessError naming the log's root cause if it died or
        ran past ``timeout``."""
        try:
            got = self._answers.get(timeout=timeout)
        except queue.Empty:
            raise ProcessError(f"the {self.setup} worker gave no answer within {timeout:.0f} s") from None
        if got is None:
            self._answers.put(None)
            text = Path(self.log_path).read_text(errors="replace") if os.path.exists(self.log_path) else ""
            why = root_cause(text) or log_tail(self.log_path)
            raise ProcessError(f"the {self.setup} worker exited with {self.proc.wait()}: {why}")
        return got

    def call(self, timeout: float, **cmd: Any) -> dict[str, Any]:
        if self.proc.stdin is None or self.proc.poll() is not None:
            raise ProcessError(f"the {self.setup} worker is not running (log: {self.log_path})")
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.answer(timeout)

    def stop(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            if self.proc.stdin is not None and self.proc.poll() is None:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        stop_process(self.proc, timeout=10)  # whatever vLLM left behind in our process group
        self._reader.join(timeout=5)
