# Portico: two commands on a fresh machine — `make run` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
PORTICO := $(VENV)/bin/portico
TORCH_VERSION ?= 2.13.0
PYTEST_ARGS ?=

.PHONY: run install dev test test-slow test-gpu gpu-kit lint typecheck bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# torch first and pinned, so pip takes the local CPU build instead of a multi-GB CUDA one
	$(PIP) install --quiet torch==$(TORCH_VERSION)
	$(PIP) install --quiet -e .
	touch $@

install: $(VENV)/.installed

$(VENV)/.dev-installed: $(VENV)/.installed
	$(PIP) install --quiet -e '.[dev]'
	touch $@

dev: $(VENV)/.dev-installed

## make run: gateway + one engine serving the default model, embedded Redis
## (engine defaults: fair policy, 64 running slots shared by plan weight — a tenant over its
## share hands a slot back — and 192-token prefill steps while tenants contend; see
## docs/configuration.md, "Slot share")
run: install
	$(PORTICO) models pull smollm2-135m
	$(PORTICO) serve

## make test: the suite but the long end-to-end runs marked `slow` (kept under 15 min on 2 cores)
test: dev
	$(PORTICO) models pull smollm2-135m
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

## make test-slow: only the tests marked `slow` (CI runs it after `make test`; both gate)
test-slow: dev
	$(PORTICO) models pull smollm2-135m
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS)

## make test-gpu: only the tests marked `gpu` (the CUDA path: kernels, engine steps, two engines
## on one card); each is skipped where torch sees no CUDA device. Then `portico bench gpu`.
test-gpu: dev
	$(PY) -m pytest -q -m gpu $(PYTEST_ARGS)

## make gpu-kit: what a session lent a CUDA machine carries there (.whl/: the wheels its image
## lacks; .gpu-kit/: the default model's tokenizer and config), for load/gpu_session.sh
gpu-kit: dev
	$(PORTICO) models pull smollm2-135m
	$(PY) -m load.gpu_kit

lint: dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: dev
	$(VENV)/bin/mypy gateway engine portico

bench: dev
	$(PORTICO) models pull smollm2-135m
	@if [ -f load/standard.py ]; then $(PY) -m load.standard; else echo "no benchmarks yet"; fi

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache *.egg-info
