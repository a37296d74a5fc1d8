# fedpers: `make run` (the main job) and `make test` (lint, types, all tests).
# Both create .venv on first use and install the pinned versions of constraints.txt.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install run test lint typecheck pytest cluster-test deploy-test clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

# FedRep against FedAvg on MNIST-1D: 100 clients x 2 classes, 10% per round, 100 rounds.
run: $(STAMP)
	$(BIN)/python -m simulations.fedrep_images --methods fedrep,fedavg --out results/main --overwrite

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# mypy reads modules from where their names say they are: .typecheck/fedpers is the
# installed layout (fedpers/ with strategies/, clients/, simulations/ inside), made of
# links to the checkout's files, so that errors name files that can be edited.
TYPECHECK := .typecheck
typecheck: $(STAMP)
	rm -rf $(TYPECHECK) && mkdir -p $(TYPECHECK)/fedpers
	for f in fedpers/*; do ln -s ../../$$f $(TYPECHECK)/fedpers/; done
	for p in strategies clients simulations; do ln -s ../../$$p $(TYPECHECK)/fedpers/$$p; done
	cd $(TYPECHECK) && ../$(BIN)/mypy --config-file ../pyproject.toml
	cd $(TYPECHECK) && ../$(BIN)/mypy --config-file ../pyproject.toml \
	    ../examples/server_momentum/fedpers_server_momentum.py

pytest: $(STAMP)
	$(BIN)/python -m pytest

test: lint typecheck pytest

# A fedpers simulation on a real two-node Ray cluster (two `ray start` on loopback),
# against the single-machine run. About 2 minutes; .ci/run runs it after `make test`.
cluster-test: $(STAMP)
	$(BIN)/python -m pytest -m cluster tests/deployment/test_ray_cluster.py

# The Docker deployment: installs Docker if needed, builds both images, brings up
# docker-compose (SuperLink, Fleet proxy, 3 SuperNodes) and checks it. As root; about
# 15 minutes from a cold cache. .ci/run runs it after `make test`.
deploy-test: $(STAMP)
	docker/deploy-test.sh

clean:
	rm -rf .flwr .ray .typecheck .mypy_cache .ruff_cache .pytest_cache
