"""A small in-process run of benchmarks/bench_methods.py: the table and the GGN check.

The benchmark is a script, not a module of the package, so it is loaded from its file.
laplace-torch 0.3 (the baseline) is an optional test dependency (``make test`` installs
it); without it, or without the Fashion-MNIST files, the test is skipped.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
from zoo_helpers import load_script, need_fashion_mnist

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_methods.py"


def _bench() -> ModuleType:
    return load_script(BENCH)


def test_quick_run_prints_every_row_and_our_ggn_matches_laplace_torch(tmp_path, capsys):
    pytest.importorskip("laplace", reason="laplace-torch 0.3 (the baseline) is not installed")
    need_fashion_mnist()
    out = tmp_path / "methods.json"
    code = _bench().main(["--quick", "--weights", "random", "--ggn-images", "512",
                          "--batch-sizes", "64,128", "--calibration-images", "256",
                          "--curvlinops-images", "64", "--bbb-steps", "5",
                          "--bbb-fast-steps", "10", "--json", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    for label in ("(a) full GGN of OptuNet", "this project: full_ggn ",
                  "this project: full_ggn(generic=True)", "laplace-torch BackPackGGN",
                  "laplace-torch CurvlinopsGGN", "64 -> 512*", "batch-size calibration",
                  "faster than the faster baseline", "(b) BBB training steps/s",
                  "train_zoo.methods.bbb.step (torch)", "FastBBB.step (numba)",
                  "numba / torch", "(c) 100-sample collection", "not measured yet"):
        assert label in text, label
    record = json.loads(out.read_text())
    rows = {row["method"]: row for row in record["ggn"]["rows"]}
    assert rows["this project: full_ggn"]["images"] == 512
    # laplace-torch sums float32 Jacobian products; ours float32 rows in float32 blocks
    assert rows["laplace-torch BackPackGGN"]["max_rel_diff"] < 1e-5
    assert rows["laplace-torch CurvlinopsGGN"]["max_rel_diff"] < 1e-5
    assert rows["this project: full_ggn(generic=True)"]["max_rel_diff"] < 1e-6
    assert rows["laplace-torch CurvlinopsGGN"]["extrapolated_from"] == 64
    assert record["bbb"]["torch"]["steps"] == 5 and record["bbb"]["numba"]["steps"] == 10
    assert record["bbb"]["max_rel_mu_diff"] < 1e-4
    assert record["collections"] == []


def test_collection_rows_are_printed(capsys):
    bench = _bench()
    bench.print_collections([{"method": "swag", "samples": 100, "epochs": 2,
                              "engine": "auto", "wall_s": 12.5, "cpu_s": 20.0}])
    text = capsys.readouterr().out
    assert "swag" in text and "12.5" in text and "not measured" not in text
