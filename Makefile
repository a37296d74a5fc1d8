# fedpers: `make run` (the main job), `make test` (lint, types, every test but the
# multi-machine ones: cluster-test, netns-test, deploy-test, which .ci/run adds) and
# `make check` (the inner loop: lint, types, and the tests that start no Flower process
# and run no script's --quick form; about 3 minutes on 2 cores).
# All create .venv on first use and install the pinned versions of constraints.txt.
#
# pytest runs on $(WORKERS) xdist workers (`make test WORKERS=0`: in one process). Tests
# that must not overlap, or that share a module's set-up, carry @pytest.mark.xdist_group
# and --dist loadgroup keeps each group on one worker: "netns" (network namespaces and
# the firewall: tests/deployment), "linear" (one run of simulations.fedrep_linear for
# three tests), "script-helps" (every script's --help, run once for tests/test_docs.py),
# "wheel" (the wheels and their venv, built once for tests/test_wheel.py). Files with a
# Flower test are handed out first (tests/conftest.py).
# Every simulation has its own FLWR_HOME and ports, and each worker its own Ray head
# (tests/simulations/conftest.py), so the rest may run side by side.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

WORKERS ?= 2
XDIST    = -n $(WORKERS) --dist loadgroup

.PHONY: install run test check lint typecheck pytest twin-test cluster-test netns-test deploy-test clean

# The installed files are compiled afterwards on both cores (compileall -j 0: 24 s)
# instead of one file at a time by pip (45 s of a fresh venv's 125 s). They must be
# compiled before anything runs: where PYTHONDONTWRITEBYTECODE is set (as on this
# machine) no process writes a .pyc, and every process then compiled torch afresh
# (make test's workers took 829 s against 574 s). Like pip, it goes on past a file
# this Python cannot compile (torch ships one in 3.12 syntax).
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-compile \
	    -c constraints.txt -e ".[dev]"
	-$(BIN)/python -m compileall -q -j 0 $(VENV)/lib > /dev/null
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
# links to the checkout's files, so that errors name files that can be edited. The links
# are made afresh; mypy's cache (.typecheck/.mypy_cache) is kept, so that a second run
# checks only what changed (`make clean` empties it).
TYPECHECK := .typecheck
typecheck: $(STAMP)
	rm -rf $(TYPECHECK)/fedpers && mkdir -p $(TYPECHECK)/fedpers
	for f in fedpers/*; do ln -s ../../$$f $(TYPECHECK)/fedpers/; done
	for p in strategies clients simulations; do ln -s ../../$$p $(TYPECHECK)/fedpers/$$p; done
	cd $(TYPECHECK) && ../$(BIN)/mypy --config-file ../pyproject.toml
	cd $(TYPECHECK) && ../$(BIN)/mypy --config-file ../pyproject.toml \
	    ../examples/server_momentum/fedpers_server_momentum.py

# FEDPERS_FLOWER_TWINS=0: the tests marked twin run in process here (the scripts'
# tests whose first run also goes through a real `flwr run`, tests/simulations/
# conftest.py; the scale benchmark's quick form on the batched engine alone) or are
# skipped (the extension example through `flwr run`, run in process by another test);
# `make twin-test` runs them through Flower.
pytest: $(STAMP)
	FEDPERS_FLOWER_TWINS=0 $(BIN)/python -m pytest $(XDIST) -m "not netns and not cluster and not docker and not network"

test: lint typecheck pytest

# Markers: flower (real Flower processes; one script of each path through Flower sends its
# first run through flwr run too), script (a script's --quick form without a Flower
# process: in process on Flower's encoding, on the batched engine, or as processes it
# interrupts), package (the wheel built and installed into a fresh venv: 35 s on one
# worker), long (a run of many rounds, or several runs, in process: 5-17 s each; the
# 20-round attacker tests, the audited private runs), netns, cluster and docker (their
# own targets below; left out by pyproject's addopts).
check: lint typecheck
	$(BIN)/python -m pytest $(XDIST) -m "not flower and not script and not package and not long and not cluster and not docker"

# A fedpers simulation on a real two-node Ray cluster (two `ray start` on loopback),
# against the single-machine run. About 2 minutes; .ci/run runs it after `make test`.
cluster-test: $(STAMP)
	$(BIN)/python -m pytest -m cluster tests/deployment/test_ray_cluster.py

# The multi-node deployment tests (marker netns): a real SuperLink and three
# fedpers-supernode processes, each in a network namespace of its own (TLS, node
# authentication, a node killed and brought back, a late node, distributed DP), the
# documented by-hand deployment, and the host-state checks. As root; about 4 minutes, on
# one process: they time real rounds, which other work beside them slowed past their
# limits. They left `make test` (about 1,800 processor-seconds on 2 cores, against its
# 12 minutes; docs/benchmarks.md#tests); .ci/run runs them after it.
netns-test: $(STAMP)
	$(BIN)/python -m pytest -m netns

# The tests marked twin through real `flwr run`s on Ray: the scripts' tests whose first
# run must equal its in-process twin (the linear family, FedGMM's unseen clients,
# Sheaf-FRL's relayed pilots, client-side privacy), the scale benchmark's quick form on
# Flower's engine, the extension example through `flwr run`. About 3 minutes; .ci/run
# runs it after `make test`, which runs them in process (or skips the last).
twin-test: $(STAMP)
	FEDPERS_FLOWER_TWINS=1 $(BIN)/python -m pytest $(XDIST) -m twin

# The Docker deployment: installs Docker if needed, builds both images, brings up
# docker-compose (SuperLink, Fleet proxy, 3 SuperNodes) and checks it. As root; about
# 15 minutes from a cold cache. .ci/run runs it after `make test`.
deploy-test: $(STAMP)
	docker/deploy-test.sh

clean:
	rm -rf .flwr .ray .typecheck .mypy_cache .ruff_cache .pytest_cache
