# Two entry points: `make demo` and `make test`. Both create or update .venv/ first.
# `make test-avx2` reruns the numerical tests as on a CPU without AVX-512 (see below).
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
# pinned torch satisfies them. NumPyro 0.22 with JAX 0.10.2 (CPU) is HMC's independent
# sampler (NUTS), installed normally as well: JAX needs no torch.
ORACLE_STAMP := $(VENV)/.oracles-stamp
ORACLE_DEPS := numpy scipy tqdm packaging typing_extensions einops==0.8.2 opt-einsum==3.4.0 \
	posteriors==0.1.3 torchopt==0.7.3 optree==0.20.0 tensordict==0.15.3 \
	arviz==0.23.4 numpyro==0.22.0 jax==0.10.2 jaxlib==0.10.2
ORACLES := laplace-torch==0.3 curvlinops-for-pytorch==3.0.1 backpack-for-pytorch==1.7.1 \
	asdfghjkl==0.1a4 torchmetrics==1.9.0 lightning-utilities==0.15.3 einconv==0.1.0 \
	unfoldNd==0.2.3 linear_operator==0.6.1 torch-uncertainty==0.13.0 \
	blitz-bayesian-pytorch==0.2.8

.PHONY: demo test test-avx2 lint bench clean-venv gpu-wheels

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

# The numerical tests again, computing as on an AVX2 CPU without AVX-512 (Haswell): each
# library that picks its kernels, and so its rounding, from the CPU is restricted
# (torch's ATen, oneDNN, MKL, numba, OpenBLAS, numpy: tests/isa_driver.py prints the
# settings), and numba compiles into a fresh cache. Their tolerances come from error
# analyses meant to hold on any x86-64 CPU; this checks that they hold on a second
# instruction set. 3 to 4 minutes on 2 cores (850 tests).
NUMERICAL_TESTS := tests/test_instruction_sets.py tests/test_fast_engine.py \
	tests/test_fast_evaluation.py tests/test_vectorised_engine.py tests/test_emp_engine.py \
	tests/test_rank1_engine.py tests/test_method_laplace.py tests/test_method_emp.py \
	tests/test_method_bbb.py tests/test_method_swag.py tests/test_method_sghmc.py \
	tests/test_method_rank1.py tests/test_method_dropout.py tests/test_sghmc_whitened.py \
	tests/test_sghmc_minibatches.py tests/test_bbb_variance.py tests/test_metrics.py \
	tests/test_metrics_predictive.py tests/test_mmd_statistics.py \
	tests/test_mmd_aggregated.py tests/test_pair_sums.py tests/test_min_mass.py \
	tests/test_diagnostics.py tests/test_ess_rhat.py tests/test_canonicalize_batch.py \
	tests/test_method_sgld.py tests/test_method_svgd.py tests/test_method_ivon.py \
	tests/test_method_csgmcmc.py tests/test_laplace_structures.py \
	tests/test_symmetry_activations.py tests/test_symmetry_structure.py \
	tests/test_reference_zoo.py tests/test_report_speed_equivalence.py \
	tests/test_method_variants.py tests/test_method_registry_equivalence.py \
	tests/test_train_methods.py tests/test_train_zoo.py tests/test_studies.py \
	tests/test_mmd_distances_fast.py tests/test_resnet20_frn.py tests/test_release_layouts.py \
	tests/test_training_device.py tests/test_report_streaming.py \
	tests/test_canonicalize_collection.py tests/test_method_hmc.py tests/test_function_space.py \
	tests/test_diagnose_hmc.py tests/test_report_reference.py

test-avx2: $(STAMP) $(ORACLE_STAMP)
	cache=$$(mktemp -d) && trap 'rm -rf "$$cache"' EXIT && \
	env $$($(PY) tests/isa_driver.py --avx2-environment) NUMBA_CACHE_DIR="$$cache" \
		$(PY) -m pytest $(NUMERICAL_TESTS)

lint: $(STAMP)
	$(VENV)/bin/ruff check posteriorzoo train_zoo analysis tests benchmarks

bench: $(STAMP)
	$(PY) benchmarks/bench_zoo_store.py
	$(PY) benchmarks/bench_training.py
	$(PY) benchmarks/bench_canonicalize.py

clean-venv:
	rm -rf $(VENV)

# The wheels benchmarks/gpu_check.py needs on a GPU machine without package registries
# (its image has torch, numpy, h5py, numba, scipy; not beartype): carried there in .gpu-wheels/.
gpu-wheels: $(STAMP)
	$(PY) -m pip download --quiet --no-deps -d .gpu-wheels \
		"beartype==$$($(PY) -c 'import beartype; print(beartype.__version__)')"
