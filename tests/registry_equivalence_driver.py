"""Train tiny digits specs of every method on the torch and the auto engine (the numba
kernels where they apply); print one JSON line: per spec and engine, the SHA-256 of every
checkpoint's arrays, the steps, the engines that ran and the mode's training record.

Run by tests/test_method_registry_equivalence.py with the code of a given checkout on
``PYTHONPATH`` (this file imports only the trainer's public API, which both the code
before and after the method registry have): ``python registry_equivalence_driver.py
[NAME ...]``.
"""

from __future__ import annotations

import hashlib
import json
import sys

import numpy as np

from train_zoo import make_spec, train_checkpoints

SPECS = {
    "de": dict(method="de", modes=2),
    "mc-dropout": dict(method="mc-dropout", modes=2, samples_per_mode=2),
    "swag": dict(method="swag", modes=2, samples_per_mode=2,
                 method_options={"epochs": 3, "iterates": 2, "rank": 2}),
    "laplace": dict(method="laplace", modes=2, samples_per_mode=2),
    "sghmc": dict(method="sghmc", modes=2, samples_per_mode=2,
                  method_options={"burn_in": 30, "thin": 10, "chains": 2,
                                  "preconditioner": "none"}),
    "sghmc-plain": dict(method="sghmc", modes=1, samples_per_mode=2,
                        method_options={"burn_in": 30, "thin": 10, "preconditioner": "none"}),
    "bbb": dict(method="bbb", modes=2, samples_per_mode=2),
    "bbb-tv": dict(method="bbb", modes=1, samples_per_mode=2,
                   method_options={"preset": "trained-variance"}),
}


def _digest(state: dict) -> str:
    digest = hashlib.sha256()
    for key in sorted(state):
        digest.update(key.encode())
        digest.update(np.ascontiguousarray(state[key]).tobytes())
    return digest.hexdigest()


def main(names: list[str]) -> dict[str, object]:
    out = {}
    for name, fields in SPECS.items():
        if names and name not in names:
            continue
        spec = make_spec("optunet-mnist", dataset="digits", base_seed=5,
                         recipe_overrides={"epochs": 2}, **fields)
        for engine in ("torch", "auto"):
            results = train_checkpoints(spec, range(spec.modes), engine=engine)
            out[f"{name}/{engine}"] = {
                "digests": [_digest(r.state) for r in results],
                "steps": [r.steps for r in results],
                "engines": [r.engine for r in results],
                "records": [json.dumps(r.record, sort_keys=True, default=str)
                            for r in results]}
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:]), sort_keys=True))
