"""A small in-process run of benchmarks/bench_methods.py: the table and the GGN check; and
the plain ``nn.Module`` baselines of part (d) compute what they claim (OptuNet itself in
their degenerate settings, and the methods' own losses step by step), so the benchmark
cannot time a wrong baseline.

The benchmark is a script, not a module of the package, so it is loaded from its file.
laplace-torch 0.3 (the baseline) is an optional test dependency (``make test`` installs
it); without it, or without the Fashion-MNIST files, the test is skipped.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
import torch
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
                  "numba / torch", "(c) 100-sample collection", "not measured yet",
                  "(d) variant training steps/s", "EmpStepper (ecmp)", "PlainEMP + Adam",
                  "Rank1Stepper", "PlainRank1 + SGD Nesterov", "rank-1: ours / plain"):
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
    variants = {row["variant"]: row for row in record["variants"]["rows"]}
    assert set(variants) == {"emp", "ecmp", "rank-1"}
    for row in variants.values():
        assert row["steps"] == 5 and row["ours"]["steps_per_s"] > 0
        assert row["max_loss_diff"] < 1e-4


def test_collection_rows_are_printed(capsys):
    bench = _bench()
    bench.print_collections([{"method": "swag", "samples": 100, "epochs": 2,
                              "engine": "auto", "wall_s": 12.5, "cpu_s": 20.0}])
    text = capsys.readouterr().out
    assert "swag" in text and "12.5" in text and "not measured" not in text


def _optunet_and_images(seed: int = 0) -> tuple[torch.nn.Module, torch.Tensor]:
    from posteriorzoo.models import build

    torch.manual_seed(seed)
    return build("optunet").eval(), torch.randn(6, 1, 28, 28)


@pytest.mark.parametrize("variant", ["emp", "ecmp"])
def test_plain_emp_with_identical_components_is_plain_optunet(variant):
    bench = _bench()
    model, images = _optunet_and_images()
    for count in (1, 3):                      # K = 1, and K copies of the same values
        def copies(value: torch.Tensor, k: int = count) -> torch.Tensor:
            return value.detach().unsqueeze(0).repeat(k, *[1] * value.dim())

        plain = bench.PlainEMP(copies(model.conv1.weight), model.conv2.weight,
                               copies(model.fc.weight), copies(model.fc.bias), variant,
                               torch.Generator().manual_seed(1))
        with torch.no_grad():
            torch.testing.assert_close(plain(images), model(images), rtol=1e-6, atol=1e-6)


def test_plain_emp_uses_the_drawn_component():
    bench = _bench()
    model, images = _optunet_and_images()
    other = torch.randn_like(model.fc.weight)
    stack = torch.stack([model.fc.weight.detach(), other])
    plain = bench.PlainEMP(model.conv1.weight[None], model.conv2.weight, stack,
                           model.fc.bias.detach().repeat(2, 1), "emp",
                           torch.Generator().manual_seed(3))
    seen = set()
    with torch.no_grad():
        expected = model(images)
        model.fc.weight.copy_(other)
        swapped = model(images)
        for _ in range(20):
            output = plain(images)
            hits = [torch.allclose(output, reference, atol=1e-6)
                    for reference in (expected, swapped)]
            assert sum(hits) == 1
            seen.add(hits.index(True))
    assert seen == {0, 1}


def test_plain_rank1_with_unit_factors_is_plain_optunet():
    bench = _bench()
    model, images = _optunet_and_images()
    count, zero_variance = 4, -1e4            # softplus(-1e4) == 0 in float32
    sizes = {"conv1": (2, 1), "conv2": (10, 2), "fc": (10, 10)}
    factors = {part: {layer: torch.full((count, size[0] if part[0] == "r" else size[1]),
                                        1.0 if part.endswith("loc") else zero_variance)
                      for layer, size in sizes.items()}
               for part in ("r_loc", "r_rho", "s_loc", "s_rho")}
    plain = bench.PlainRank1({layer: getattr(model, layer).weight for layer in sizes},
                             model.fc.bias.detach().repeat(count, 1), factors,
                             torch.Generator().manual_seed(1))
    with torch.no_grad():
        output = plain(images)
        assert output.shape == (count * len(images), 10)
        torch.testing.assert_close(output, model(images).repeat(count, 1), rtol=1e-6,
                                   atol=1e-6)
        # locations other than 1 scale the layers: each component is its folded network
        from train_zoo.methods import rank1

        for part in ("r_loc", "s_loc"):
            for layer in sizes:
                plain.get_parameter(f"{part}.{layer}").copy_(
                    torch.randn(factors[part][layer].shape))
        output = plain(images).reshape(count, len(images), 10)
        params = dict(model.named_parameters())
        for k in range(count):
            folded = rank1.fold(params, {layer: plain.r_loc[layer][k] for layer in sizes},
                                {layer: plain.s_loc[layer][k] for layer in sizes})
            reference = torch.func.functional_call(model, folded, (images,))
            torch.testing.assert_close(output[k], reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", ["emp", "ecmp", "rank-1"])
def test_plain_baselines_take_the_methods_steps(variant):
    """From the same state, batches and noise seed, each step's loss of the plain module
    equals the method's stepper's (and a differently seeded plain run does not)."""
    bench = _bench()
    generator = torch.Generator().manual_seed(5)
    batches = [(torch.randn(8, 1, 28, 28, generator=generator),
                torch.randint(10, (8,), generator=generator)) for _ in range(2)]
    ours, plain = bench._variant_runners(variant, 0, 1000)
    losses = {}
    for name, factory in (("ours", ours), ("plain", plain)):
        step = factory()
        losses[name] = [step(batches[index % 2], index) for index in range(4)]
    assert losses["ours"] == pytest.approx(losses["plain"], rel=1e-5)
    _, reseeded = bench._variant_runners(variant, 1, 1000)
    step = reseeded()
    assert [step(batches[index % 2], index) for index in range(4)] != pytest.approx(
        losses["ours"], rel=1e-5)
