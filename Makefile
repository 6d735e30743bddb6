# megatron-sat developer targets.  `make venv` builds .venv and .venv/transformers4 (fast on re-runs: stamp files),
# `make test` runs the linter (`make lint`, ruff, a second) and the whole test suite (what CI runs), `make test-fast`
# the linter and the tests not marked slow (the edit-run loop), `make slurm` installs the local Slurm the Slurm tests
# start (Debian, root; nothing when installed), `make demo` runs the demo recipe, `make clean` removes build outputs.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV ?= .venv
VPY := $(VENV)/bin/python
PIP := $(VPY) -m pip
STAMP := $(VENV)/.megatron-sat-stamp
# transformers 4.x installed aside (not importable from the venv): tests/test_conversion.py loads every arch's export
# with it in a subprocess that puts this folder first on sys.path.  --no-deps with the exact versions it needs (the
# venv's tokenizers and huggingface-hub are 5.x's), so no torch is pulled.
T4 := $(VENV)/transformers4
T4_STAMP := $(T4)/.megatron-sat-stamp
T4_PACKAGES := transformers==4.57.1 tokenizers==0.22.1 huggingface-hub==0.36.0
MCORE_VERSION ?= 0.19.2
PYTEST_ARGS ?=
TEST_TIMEOUT ?= 900
# pytest-xdist workers, whole test files per worker (a module's fixtures run once), for the tests not marked slurm;
# TEST_WORKERS=0 runs them in one process.  The tests marked slurm (jobs signalled, suspended, killed and timed) run
# one at a time after them: beside a second worker, the chaos run's first checkpoint saves outlasted its 24 s hang
# timeout and a two-node job missed its USR1 (CI, two workers), so they keep the machine to themselves.
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadfile

# constraints.txt pins torch to the CPU build on local disk; PIP_CONSTRAINT (unlike -c) is also seen by pip's
# build-isolation environments.  The machine-wide constraint file, if any, is kept as well.
SYS_CONSTRAINT := $(wildcard /etc/xdg/pip/constraints.txt)
export PIP_CONSTRAINT := $(strip $(CURDIR)/constraints.txt $(SYS_CONSTRAINT))
export PIP_DISABLE_PIP_VERSION_CHECK := 1
export PIP_NO_INPUT := 1
export DS_BUILD_OPS := 0
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.torch_extensions

.PHONY: venv test test-fast lint slurm demo clean gpu-wheels

venv: $(STAMP) $(T4_STAMP)

# 1. create (or reuse) the venv; 2. the CPU torch (pinned by PIP_CONSTRAINT); 3. docker/install.sh, the same script
#    the container runs: megatron-core and this package (editable, extras dev) without touching that torch.
$(STAMP): pyproject.toml setup.py constraints.txt Makefile docker/install.sh
	@test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q torch==2.13.0
	PYTHON=$(VPY) MSAT_EXTRAS=dev MSAT_EDITABLE=1 bash docker/install.sh
	@touch $(STAMP)

$(T4_STAMP): $(STAMP)
	rm -rf $(T4)
	$(PIP) install -q --no-deps --target $(T4) $(T4_PACKAGES)
	@test ! -e $(T4)/torch || { echo "make venv: $(T4) holds a torch: only $(T4_PACKAGES) belong there" >&2; exit 1; }
	@touch $(T4_STAMP)

lint: venv
	$(VPY) -m ruff check .

test: venv lint
	$(VPY) -m pytest -q -ra -p no:cacheprovider $(XDIST) --timeout=$(TEST_TIMEOUT) --durations=15 -m "not slurm" tests $(PYTEST_ARGS)
	$(VPY) -m pytest -q -ra -p no:cacheprovider --timeout=$(TEST_TIMEOUT) --durations=15 -m slurm tests $(PYTEST_ARGS)

# everything but the tests marked slow (multi-process, Slurm, faults, conversion, trainer runs): a few minutes
test-fast: venv lint
	$(VPY) -m pytest -q -ra -p no:cacheprovider $(XDIST) --timeout=$(TEST_TIMEOUT) --durations=10 -m "not slow" tests $(PYTEST_ARGS)

# Debian's Slurm 22.05 and munge for tests/slurm_cluster.py, and slurmdbd + MariaDB for its accounting cluster
# (sacct). Idempotent: apt-get runs only when a binary is missing. The tests never install anything.
SLURM_PACKAGES := slurmctld slurmd slurm-client munge slurmdbd mariadb-server mariadb-client
SLURM_BINARIES := slurmctld slurmd sbatch munged slurmdbd mariadbd mariadb
APT := apt-get -q -o DPkg::Lock::Timeout=300
slurm:
	@missing=; for b in $(SLURM_BINARIES); do PATH="$$PATH:/usr/sbin:/sbin" command -v $$b >/dev/null || missing="$$missing $$b"; done; \
	if [ -z "$$missing" ]; then echo "make slurm: Slurm, munge, slurmdbd and MariaDB are installed"; exit 0; fi; \
	if [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then \
	  echo "make slurm:$$missing missing; installing $(SLURM_PACKAGES) needs root and apt-get (Debian)" >&2; exit 2; fi; \
	echo "make slurm:$$missing missing: apt-get install $(SLURM_PACKAGES)"; \
	export DEBIAN_FRONTEND=noninteractive; \
	$(APT) update && $(APT) install -y --no-install-recommends $(SLURM_PACKAGES)

demo: venv
	$(VPY) -m megatron_sat.train --recipe demo

# wheels for tools/gpu_check.sh on a GPU machine without internet (Python 3.12 there; carried as .whl/)
gpu-wheels:
	python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 -d .whl megatron-core==$(MCORE_VERSION) psutil xxhash tqdm

clean:
	rm -rf build dist *.egg-info .eggs .pytest_cache .torch_extensions
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -print0 | xargs -0 rm -rf
