# pdorch — the two commands a new user needs: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: venv demo test lint check bench clean proto

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,ucx,engine,chaos,operator,gateway,migrate]'
	touch $(STAMP)

lint: venv
	$(VENV)/bin/ruff check orchestrator transport tests
	$(VENV)/bin/ruff format --check orchestrator transport tests
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

test: lint
	$(VENV)/bin/pytest $(PYTEST_ARGS)

# The inner loop (well under a minute): lint, the pure unit tests and the store and
# transport contract suites; `make test` runs everything.
check: lint
	$(VENV)/bin/pytest -q tests/unit tests/contract -m "not slow" $(PYTEST_ARGS)

# The main job: for now, the transport benchmark on both backends, side by side with
# ucx_perftest (see README).
demo: venv
	$(VENV)/bin/pdorch demo

bench: venv
	$(VENV)/bin/pdorch bench transport --backend ucx --size 64MiB --iters 10
	$(VENV)/bin/pdorch bench transport --backend tcp --size 64MiB --iters 10

# Regenerate the committed gRPC code from proto/ (a test fails if it is stale).
proto: venv
	$(PY) proto/generate.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
