# The two commands a user needs: `make run` and `make test` (`make lint` before a commit).
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test lint e2e container bench venv clean system-packages instructions-check lower-bounds

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	$(PY) -m pip install -q -e '.[test,bench,otel,lint]'
	@touch $(STAMP)

venv: $(STAMP)

# `make run PORT=9000 SIM='prefill=1,decode=1'` overrides either.
PORT ?= 8000
SIM ?= encode=2,prefill=1,decode=2,itl_ms=15,ttft_ms=20,kv_events=1,bidirectional=1

## Start the proxy on 127.0.0.1:$(PORT) in front of an embedded simulated cluster ($(SIM)).
run: $(STAMP)
	$(PY) -m epd_proxy serve --port $(PORT) --simulate '$(SIM)'

## Programs the tests run as real servers (dnsmasq, redis-server) or checkers (promtool), installed when missing and root.
system-packages:
	@bash scripts/ensure-system-packages.sh

## The test suite (simulator-backed, real sockets).
test: $(STAMP) system-packages
	$(PY) -m pytest -q

## Lint (ruff: pyflakes, pycodestyle, import order, bugbear, absolute imports), type check (mypy on src/)
## and the layering rule (tests/test_layers.py: no upward import, no import cycle); config in pyproject.toml.
lint: $(STAMP)
	$(PY) -m ruff check src tests scripts
	$(PY) -m mypy
	$(PY) -m pytest -q -p no:cacheprovider tests/test_layers.py tests/test_named_modules.py tests/test_module_size.py

## End-to-end: the container image built and run (podman), then real vLLM instances (installs a
## cached vLLM CPU environment). Both run; the target fails if either does.
e2e: $(STAMP)
	@status=0; bash e2e/container.sh || status=1; bash e2e/run.sh || status=1; exit $$status

## The container image from the Dockerfile, built and run in front of a simulated cluster (podman).
container: $(STAMP)
	bash e2e/container.sh

## The hot path's guard: instructions per request (callgrind) of a fixed request mix against
## scripts/instructions-baseline.json; fails past its margin (docs/benchmarks.md, "The guard").
instructions-check: $(STAMP) system-packages
	PY=$(PY) $(PY) scripts/instructions_guard.py

## The declared lower bounds tested: every runtime dependency at exactly its `>=` bound in
## .venv-lower, and the suites that exercise them (scripts/lower_bounds.py).
lower-bounds: system-packages
	$(PYTHON) scripts/lower_bounds.py

## The benchmark; see docs/benchmarks.md.
bench: $(STAMP)
	$(PY) -m epd_proxy bench --compare

clean:
	rm -rf $(VENV) .venv-lower build dist src/*.egg-info .pytest_cache
