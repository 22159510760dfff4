"""Trains one small checkpoint with both engines and saves what their callbacks saw.

Usage: ``python isa_driver.py OUT.npz`` trains checkpoint 0 of :func:`spec` (OptuNet on
digits, one epoch of batch 8: 169 SGD steps) with the fast (numba) and the torch engine,
one thread each, and writes every step's weights, every step's ``(index, epoch, step,
lr, loss)``, the final weights and metrics, and the instruction sets torch and numba
used. ``tests/test_instruction_sets.py`` runs it under the host's CPU features and
under :func:`avx2_environment`; ``python isa_driver.py --avx2-environment`` prints that
environment as ``NAME=VALUE`` lines (the Makefile's ``test-avx2`` target uses it).
"""

from __future__ import annotations

import json
import sys

import numpy as np

ENGINES = ("fast", "torch")


def avx2_environment() -> dict[str, str]:
    """The settings that make this process compute as on an AVX2 CPU (Haswell) without
    AVX-512: torch's own kernels (ATen), its oneDNN convolutions and MKL, numba's code
    generation, OpenBLAS (numpy's and scipy's BLAS) and numpy's SIMD loops. Each library
    otherwise picks its code path from the CPU, and so its rounding: the same program
    gives other bits on another instruction set. (NUMBA_CACHE_DIR must point at a cache
    of its own: kernels compiled for one CPU are not the other's.)"""
    try:
        from numpy._core._multiarray_umath import __cpu_dispatch__ as dispatch
    except ImportError:   # numpy 1.x
        from numpy.core._multiarray_umath import __cpu_dispatch__ as dispatch
    beyond_avx2 = [name for name in dispatch if name.startswith("AVX512") or name == "X86_V4"]
    return {"ATEN_CPU_CAPABILITY": "avx2", "NUMBA_CPU_NAME": "haswell",
            "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
            "OPENBLAS_CORETYPE": "Haswell", "NPY_DISABLE_CPU_FEATURES": ",".join(beyond_avx2)}


def spec():
    from train_zoo import make_spec

    return make_spec("optunet-mnist", dataset="digits", architecture="optunet", base_seed=3,
                     recipe_overrides={"epochs": 1, "batch_size": 8})


class _Log:
    def __init__(self) -> None:
        self.weights: list[dict[str, np.ndarray]] = []
        self.steps: list[tuple] = []

    def on_step_end(self, info, weights) -> None:
        self.weights.append({key: value.copy() for key, value in weights.items()})
        self.steps.append((info.index, info.epoch, info.step, info.lr, info.loss))

    def on_epoch_end(self, info, weights) -> None:
        pass


def main(out: str) -> None:
    import numba
    import torch

    from train_zoo import train_checkpoints
    from train_zoo.data import load_training_data

    torch.set_num_threads(1)
    data = load_training_data("digits")
    arrays: dict[str, np.ndarray] = {}
    for engine in ENGINES:
        log = _Log()
        [result] = train_checkpoints(spec(), [0], data=data, engine=engine, callbacks=[log])
        assert result.engine == engine
        for key in result.state:
            arrays[f"{engine}/steps/{key}"] = np.stack([w[key] for w in log.weights])
            arrays[f"{engine}/final/{key}"] = result.state[key]
        arrays[f"{engine}/info"] = np.array(log.steps, dtype=np.float64)
        arrays[f"{engine}/metrics"] = np.array([result.metrics[name] for name in
                                                sorted(result.metrics)])
    machine = {"aten": torch.backends.cpu.get_cpu_capability(),
               "numba": numba.config.CPU_NAME or "host"}
    arrays["machine"] = np.array(json.dumps(machine))
    np.savez(out, **arrays)


if __name__ == "__main__":
    if sys.argv[1:] == ["--avx2-environment"]:
        print("\n".join(f"{name}={value}" for name, value in avx2_environment().items()))
    else:
        main(sys.argv[1])
