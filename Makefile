# Two entry points: `make demo` and `make test`. Both create or update .venv/ first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# torch is installed on its own, pinned, before anything else: these machines have a CPU
# build of 2.13.0, and an unpinned torch would pull several GB of CUDA packages.
TORCH_SPEC ?= torch==2.13.0
# Test oracles (laplace-torch 0.3 and its curvature backends; torch-uncertainty 0.13 for FPR95,
# whose metric module the tests load from its file; BLiTZ 0.2.8 for BBB's layers), pinned
# and installed without their declared dependencies: a plain install would pull
# torchvision (no working CPU build
# next to torch 2.13.0; torchmetrics imports it whenever it is present, then fails) and a
# CUDA torch. Only tests import them (pytest.importorskip); the package never does.
# posteriors 0.1.3 (SGHMC's oracle) and ArviZ 0.23.4 (the diagnostics' oracle) are the
# exceptions: they and their pinned dependencies install normally (ORACLE_DEPS), as the
# pinned torch satisfies them.
ORACLE_STAMP := $(VENV)/.oracles-stamp
ORACLE_DEPS := numpy scipy tqdm packaging typing_extensions einops==0.8.2 opt-einsum==3.4.0 \
	posteriors==0.1.3 torchopt==0.7.3 optree==0.20.0 tensordict==0.15.3 \
	arviz==0.23.4
ORACLES := laplace-torch==0.3 curvlinops-for-pytorch==3.0.1 backpack-for-pytorch==1.7.1 \
	asdfghjkl==0.1a4 torchmetrics==1.9.0 lightning-utilities==0.15.3 einconv==0.1.0 \
	unfoldNd==0.2.3 linear_operator==0.6.1 torch-uncertainty==0.13.0 \
	blitz-bayesian-pytorch==0.2.8

.PHONY: demo test lint bench clean-venv

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev,ray]"
	touch $(STAMP)

$(ORACLE_STAMP): Makefile $(STAMP)
	$(PY) -m pip install --quiet $(ORACLE_DEPS)
	$(PY) -m pip install --quiet --no-deps $(ORACLES)
	touch $(ORACLE_STAMP)

demo: $(STAMP)
	$(VENV)/bin/posteriorzoo demo --out demo-output --overwrite

test: $(STAMP) $(ORACLE_STAMP)
	$(VENV)/bin/ruff check posteriorzoo train_zoo analysis tests benchmarks
	$(PY) -m pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check posteriorzoo train_zoo analysis tests benchmarks

bench: $(STAMP)
	$(PY) benchmarks/bench_zoo_store.py
	$(PY) benchmarks/bench_training.py
	$(PY) benchmarks/bench_canonicalize.py

clean-venv:
	rm -rf $(VENV)
