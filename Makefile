# The two commands of the README: `make demo` (set up and run the main job) and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
LAB_HOSTS ?= 3

.PHONY: demo test test-fleet venv docker images lab lab-down lint unit clean

venv: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -e ".[dev,bench,ray]"
	@touch $@

docker:
	bash scripts/ensure-docker.sh

images: docker
	PYTHON=$(PYTHON) bash scripts/build-images.sh

lab: venv images
	$(BIN)/raycluster lab up --hosts $(LAB_HOSTS)

lab-down: venv
	$(BIN)/raycluster lab down

# The main job: a 3-host lab whose hosts are unequal (CPU quotas of their Ray containers), then
# doctor → up → bench → down against it. The bench's own report shows what balancing buys there:
# the balanced split next to the even split and the whole model unsharded on one node.
DEMO_QUOTAS ?= 1.0,0.5,0.25
demo: venv images
	@inv=$$($(BIN)/raycluster lab up --hosts $(LAB_HOSTS) --cpu-quotas $(DEMO_QUOTAS) --json | $(BIN)/python -c 'import json,sys; print(json.load(sys.stdin)["inventory"])'); \
	set -e; \
	echo "== raycluster doctor -i $$inv"; $(BIN)/raycluster doctor -i $$inv; \
	echo "== raycluster up -i $$inv"; $(BIN)/raycluster up -i $$inv; \
	echo "== raycluster bench -i $$inv --check-output"; $(BIN)/raycluster bench -i $$inv --check-output; \
	echo "== raycluster down -i $$inv"; $(BIN)/raycluster down -i $$inv

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

test: lint images
	RAYCLUSTER_REQUIRE_LAB=1 RAYCLUSTER_LAB_SUBNET=$(LAB_SUBNET) $(BIN)/pytest -ra -m "not fleet" --junitxml=test-results/junit.xml tests

# The fleet tests: a second lab of $(FLEET_HOSTS) hosts without the node image, beside the 3-host one.
FLEET_HOSTS ?= 30
test-fleet: venv images
	RAYCLUSTER_REQUIRE_LAB=1 RAYCLUSTER_LAB_SUBNET=$(LAB_SUBNET) RAYCLUSTER_FLEET_HOSTS=$(FLEET_HOSTS) \
	  $(BIN)/pytest -ra -m fleet --junitxml=test-results/junit-fleet.xml tests/e2e

clean:
	rm -rf $(VENV) test-results .pytest_cache .mypy_cache .ruff_cache
