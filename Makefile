# The README's first two commands: `make run` and `make test`. Everything else is a helper.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
DEMO := .openjev/demo-model
PROTOS := protos/openjev/v1/decision.proto protos/openjev/worker/v1/worker.proto

.PHONY: run test venv test-deps demo-model protos docs bench soak gpu-test clean proto-check proto-release

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed pyproject.toml
	$(PY) -m pip install -q -e '.[test]'
	touch $@

venv: $(VENV)/.installed
test-deps: $(VENV)/.installed-test

demo-model: $(VENV)/.installed
	$(PY) -m openjev.demo_model --out $(DEMO)

# Start a worker and a frontend on loopback, answer the contract example, stop both.
run: demo-model
	$(PY) -m openjev.demo_run --model $(DEMO) --request examples/contract_example.json

# Generated code is never edited by hand: this regenerates it (tests check it is current).
protos: $(VENV)/.installed-test
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. $(PROTOS)

docs: $(VENV)/.installed-test
	$(VENV)/bin/mkdocs build --strict --quiet --site-dir site

test: $(VENV)/.installed-test demo-model proto-check
	$(VENV)/bin/mkdocs build --strict --quiet --site-dir site
	$(VENV)/bin/pytest -q

# The benchmark on this machine (CPU, demo model); on a GPU see docs/benchmarks/index.md.
bench: demo-model $(VENV)/.installed-test
	$(PY) -m openjev.bench.main --model $(DEMO) --workload docs/benchmarks/workload.jsonl \
		--out docs/benchmarks/cpu-demo --per-group 2 --blocks 2 --arms off,auto,shared,transformers \
		--sweep 1,4 --sweep-seconds 10

# N clients against a worker + frontend on loopback for a bounded time (docs/reliability.md).
soak: demo-model
	$(PY) -m openjev.soak --model $(DEMO) --clients 8 --duration 60

gpu-test:
	PYTHONPATH=. python3 -m pytest -q -m gpu tests

clean:
	rm -rf $(VENV) .openjev site

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
