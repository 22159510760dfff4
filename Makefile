# Two entry points: `make demo` and `make test`. Both create or update .venv/ first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# torch is installed on its own, pinned, before anything else: these machines have a CPU
# build of 2.13.0, and an unpinned torch would pull several GB of CUDA packages.
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo test lint bench clean-venv

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev,ray]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/posteriorzoo demo --out demo-output --overwrite

test: $(STAMP)
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
