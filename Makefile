# The two commands of the README: `make demo` (set up and run the main job) and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
LAB_HOSTS ?= 3
# The prerequisites of a target are made side by side (the venv, the images and vLLM's venv are mostly waiting on
# disk); their lines may interleave.  No --output-sync: make would hold a recipe line's output until it ends, and
# the tests' progress would show only when they are all done.
MAKEFLAGS += --jobs=3

.PHONY: demo test test-extended test-fleet venv vllm docker images lab lab-down lint unit clean

venv: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -e ".[dev,bench,ray,serve]"
	@touch $@

# vLLM's CPU build in a venv of its own (3.5 GB, ~4 min): what `serve --engine vllm`'s local tests start.
# VLLM_VENV=/path reuses one made before (benchmarks/engine_vs_vllm.sh takes the same variable).
VLLM_VENV ?= .vllm-venv
vllm:
	VLLM_VENV=$(VLLM_VENV) PYTHON=$(PYTHON) bash benchmarks/vllm_cpu_env.sh

docker:
	bash scripts/ensure-docker.sh

images: docker
	PYTHON=$(PYTHON) bash scripts/build-images.sh

lab: venv images
	$(BIN)/raycluster lab up --hosts $(LAB_HOSTS)

lab-down: venv
	$(BIN)/raycluster lab down

# The main job: a 3-host lab whose hosts are unequal (CPU quotas of their Ray containers), then doctor → up →
# a short bench (the balanced split next to the even split and the whole model unsharded) → next steps → down.
# KEEP=1 keeps the cluster up for the next steps; DEMO_QUOTAS, DEMO_BENCH change the hosts and the bench's flags.
DEMO_QUOTAS ?= 1.0,0.5,0.25
KEEP ?= 0
demo: venv images
	BIN=$(BIN) LAB_HOSTS=$(LAB_HOSTS) DEMO_QUOTAS=$(DEMO_QUOTAS) KEEP=$(KEEP) bash scripts/demo.sh

lint: venv
	$(BIN)/ruff check raycluster_cli tests
	$(BIN)/ruff format --check raycluster_cli tests
	$(BIN)/mypy

unit: venv
	$(BIN)/pytest -q tests/unit tests/cli

# Everything: lint, types, unit and CLI tests, and the lab tests on a real 3-host lab.
# The lab's subnet: RAYCLUSTER_LAB_SUBNET, else 10.77.0.0/24 unless another Docker network holds it (a lab left
# by an interrupted run, say), then the first free /24 of 10.64.0.0/10.
LAB_SUBNET = $${RAYCLUSTER_LAB_SUBNET:-$$($(BIN)/python -c 'from raycluster_cli.lab.hosts import DEFAULT_SUBNET, free_subnet; print(free_subnet(DEFAULT_SUBNET))' 2>/dev/null || echo 10.77.0.0/24)}

# pytest with the lab required, on a free subnet, and vLLM's venv for `serve --engine vllm`'s tests
LAB_PYTEST = RAYCLUSTER_REQUIRE_LAB=1 RAYCLUSTER_LAB_SUBNET=$(LAB_SUBNET) RAYCLUSTER_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(BIN)/pytest -ra

test: lint images vllm
	$(LAB_PYTEST) --durations=30 -m "not fleet and not extended" --junitxml=test-results/junit.xml tests

# The tests marked `extended` (pyproject.toml says what they are): a second path to what `make test` covers, kept
# out of it so CI stays under its time; run before a release and after changing what they cover.
test-extended: venv images vllm
	$(LAB_PYTEST) --durations=30 -m "extended and not fleet" --junitxml=test-results/junit-extended.xml tests

# The fleet tests: a second lab of $(FLEET_HOSTS) hosts without the node image, beside the 3-host one.
FLEET_HOSTS ?= 30
test-fleet: venv images
	RAYCLUSTER_REQUIRE_LAB=1 RAYCLUSTER_LAB_SUBNET=$(LAB_SUBNET) RAYCLUSTER_FLEET_HOSTS=$(FLEET_HOSTS) \
	  $(BIN)/pytest -ra -m fleet --junitxml=test-results/junit-fleet.xml tests/e2e

clean:
	rm -rf $(VENV) test-results .pytest_cache .mypy_cache .ruff_cache
