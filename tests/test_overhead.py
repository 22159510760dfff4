"""Parameter overhead (``posteriorzoo overhead``, :mod:`posteriorzoo.overhead`) and the
architectures its figures need: the seeds' published numbers reproduced at their printed
precision, the counting rules on hand-made networks, the command's text and JSON, and bad
options as one line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch import nn
from zoo_helpers import assert_one_line_error, run

from posteriorzoo.errors import InvalidOptionError, PosteriorZooError, UnknownNameError
from posteriorzoo.models import build, expected_state_shapes, parameter_count
from posteriorzoo.overhead import (
    MAX_COMPONENTS,
    architecture_overhead,
    batchnorm_layers,
    bbb_overhead,
    emp_overhead,
    overhead_report,
    patch_layers,
    rank1_factor_size,
    rank1_overhead,
    seed_figures,
    weighted_layers,
)


def _meta(name: str, num_classes: int | None = None, **options: object) -> nn.Module:
    with torch.device("meta"):
        return build(name, num_classes, **options)


def _trainable(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


# --- the architectures ------------------------------------------------------------------


def test_parameter_counts_of_the_new_architectures() -> None:
    # torchvision's resnet18 / resnet50 and the original WRN-28-10 code's counts
    assert parameter_count("resnet18-imagenet") == 11_689_512
    assert parameter_count("resnet50") == 25_557_032
    assert parameter_count("wrn28-10") == 36_479_194
    assert parameter_count("wrn28-10", num_classes=100) == 36_536_884
    assert parameter_count("mlp-bn") == 1_009_900
    # the class count only changes the head: (features + 1) per class
    assert parameter_count("resnet50", num_classes=10) == 25_557_032 - 990 * 2049
    assert parameter_count("resnet18-imagenet", num_classes=100) == 11_689_512 - 900 * 513


def test_small_real_builds_match_the_meta_counts_and_run() -> None:
    cases = [("resnet18-imagenet", {"width": 4}, (2, 3, 64, 64), 1000),
             ("resnet50", {"width": 4}, (2, 3, 64, 64), 1000),
             ("wrn28-10", {"widen_factor": 1}, (2, 3, 32, 32), 10),
             ("mlp-bn", {"widths": (3, 5, 5, 4)}, (2, 3), 4)]
    for name, options, shape, outputs in cases:
        model = build(name, **options).eval()
        assert _trainable(model) == parameter_count(name, **options), name
        with torch.no_grad():
            assert model(torch.randn(*shape)).shape == (2, outputs), name


def test_resnet_imagenet_layout_and_torchvision_keys() -> None:
    shapes = expected_state_shapes("resnet18-imagenet")
    assert shapes["conv1.weight"][0] == (64, 3, 7, 7)
    assert shapes["fc.weight"][0] == (1000, 512)
    # torchvision names the projection shortcut downsample.{0,1}: stages 2-4 only
    shortcut = {key.rsplit(".", 1)[0] for key in shapes if ".downsample." in key}
    assert shortcut == {f"layer{i}.0.downsample.{j}" for i in (2, 3, 4) for j in (0, 1)}
    model = build("resnet18-imagenet", width=4)
    assert model.conv1.stride == (2, 2) and model.conv1.bias is None
    assert isinstance(model.maxpool, nn.MaxPool2d) and model.maxpool.stride == 2
    sizes: list[tuple[int, ...]] = []
    model.layer4.register_forward_hook(lambda _m, _i, out: sizes.append(tuple(out.shape)))
    model.eval()(torch.randn(1, 3, 224, 224))
    assert sizes == [(1, 32, 7, 7)]  # 224 / 32: the stride-2 stem and the max-pool


def test_resnet50_bottleneck_keys() -> None:
    shapes = expected_state_shapes("resnet50")
    assert shapes["layer1.0.conv1.weight"][0] == (64, 64, 1, 1)
    assert shapes["layer1.0.conv2.weight"][0] == (64, 64, 3, 3)
    assert shapes["layer1.0.conv3.weight"][0] == (256, 64, 1, 1)
    assert shapes["layer1.0.downsample.0.weight"][0] == (256, 64, 1, 1)
    assert "layer1.1.downsample.0.weight" not in shapes
    assert shapes["layer4.2.bn3.running_var"][0] == (2048,)
    assert shapes["fc.weight"][0] == (1000, 2048)
    blocks = {key.split(".")[0] + "." + key.split(".")[1] for key in shapes
              if key.startswith("layer")}
    assert len(blocks) == 3 + 4 + 6 + 3
    model = build("resnet50", width=4)
    assert model.layer2[0].conv2.stride == (2, 2)  # the stride on the 3x3 conv ("v1.5")


def test_wide_resnet_is_pre_activation_with_projection_on_the_activated_input() -> None:
    shapes = expected_state_shapes("wrn28-10")
    assert shapes["conv1.weight"][0] == (16, 3, 3, 3)
    assert shapes["layer1.0.shortcut.weight"][0] == (160, 16, 1, 1)
    assert shapes["layer3.3.conv2.weight"][0] == (640, 640, 3, 3)
    assert shapes["bn.weight"][0] == (640,) and shapes["fc.weight"][0] == (10, 640)
    assert not any(key.endswith("conv1.bias") for key in shapes)
    assert len({key.split(".")[1] for key in shapes if key.startswith("layer1.")}) == 4
    model = build("wrn28-10", widen_factor=1).eval()
    identity, projection = model.layer1[1], model.layer2[0]
    with torch.no_grad():
        for block in (identity, projection):
            block.conv2.weight.zero_()  # silence the residual branch
        x = torch.randn(2, 16, 8, 8)
        # the zeroed convolution gives exact zeros, so x + 0 and the shortcut's own
        # operations on the same tensor: bit for bit
        assert torch.equal(identity(x), x)
        x = torch.randn(2, 16, 8, 8)
        expected = projection.shortcut(torch.relu(projection.bn1(x)))
        assert torch.equal(projection(x), expected)
    with pytest.raises(InvalidOptionError, match="6 n \\+ 4"):
        from posteriorzoo.models.wide_resnet import WideResNet

        WideResNet(depth=27)


def test_mlp_bn_layout() -> None:
    model = build("mlp-bn", widths=(3, 5, 5, 4))
    assert [k for k in model.state_dict() if not k.startswith("norms")] == [
        "layers.0.weight", "layers.1.weight", "layers.2.weight"]
    assert len(model.norms) == 2
    assert parameter_count("mlp-bn", widths=(3, 5, 5, 4)) == 15 + 25 + 20 + 2 * (5 + 5)
    assert parameter_count("mlp-bn", widths=(3, 5, 4), output_bias=True) == 15 + 10 + 20 + 4
    with pytest.raises(PosteriorZooError, match="widths"):
        build("mlp-bn", num_classes=3, widths=(3, 5, 4))


# --- the counting rules on hand-made networks -------------------------------------------


class _Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, bias=False)    # 216
        self.norm = nn.BatchNorm2d(8)                 # 16
        self.middle = nn.Conv2d(8, 6, 1)              # 54
        self.norm2 = nn.BatchNorm2d(6, affine=False)  # nothing to patch
        self.head = nn.Linear(6, 5)                   # 35


def test_counting_rules_on_a_small_network() -> None:
    model = _Small()
    assert [name for name, _ in weighted_layers(model)] == ["stem", "middle", "head"]
    assert [name for name, _ in batchnorm_layers(model)] == ["norm"]
    assert [name for name, _ in patch_layers(model, "bn")] == ["norm"]
    assert [name for name, _ in patch_layers(model, "bn+out")] == ["norm", "head"]
    assert [name for name, _ in patch_layers(model, "in+out")] == ["stem", "head"]
    assert emp_overhead(model, "bn", 5) == 4 * 16
    assert emp_overhead(model, "bn+out", 3) == 2 * (16 + 35)
    assert emp_overhead(model, "in+out", 2) == 216 + 35
    assert rank1_factor_size(model) == (3 + 8) + (8 + 6) + (6 + 5)
    assert rank1_overhead(model, 4) == 2 * 4 * 36
    assert rank1_overhead(model, 1) == 2 * 36
    assert bbb_overhead(model) == 216 + 54 + 35


def test_a_patch_that_selects_nothing_is_refused() -> None:
    with pytest.raises(InvalidOptionError, match="BatchNorm"):
        emp_overhead(_meta("optunet"), "bn")
    with pytest.raises(InvalidOptionError, match="patch"):
        emp_overhead(_Small(), "conv")
    row = architecture_overhead("optunet")
    assert [m.patch for m in row.methods if m.method == "emp"] == ["in+out"]
    assert len(row.skipped) == 2 and all("BatchNorm" in line for line in row.skipped)


@pytest.mark.parametrize("components", [0, 1, MAX_COMPONENTS + 1, 2.5, True, "5"])
def test_bad_emp_components_are_refused(components: object) -> None:
    with pytest.raises(InvalidOptionError, match="components"):
        emp_overhead(_Small(), "bn", components)


@pytest.mark.parametrize("components", [0, -3, MAX_COMPONENTS + 1, 4.0])
def test_bad_rank1_components_are_refused(components: object) -> None:
    with pytest.raises(InvalidOptionError, match="components"):
        rank1_overhead(_Small(), components)


def test_unknown_architectures_are_refused_before_any_count() -> None:
    with pytest.raises(UnknownNameError, match="resnet19"):
        overhead_report(["optunet", "resnet19"])
    with pytest.raises(UnknownNameError):
        architecture_overhead("optunet", depth=3)


# --- the seeds' figures -----------------------------------------------------------------


def _method(name: str, method: str, patch: str | None = None, num_classes: int | None = None):
    row = architecture_overhead(name, num_classes)
    return row, next(m for m in row.methods if m.method == method and m.patch == patch)


def test_emp_on_imagenet_resnet18_reproduces_seed_001() -> None:
    row, bn = _method("resnet18-imagenet", "emp", "bn")
    _, out = _method("resnet18-imagenet", "emp", "bn+out")
    assert row.parameters == 11_689_512                          # Table 3, dropout/vanilla
    assert f"{100 * bn.fraction:.3f}%" == "0.328%"                # Table 4
    assert f"{100 * out.fraction:.1f}%" == "17.9%"                # Tables 1 and 4
    assert out.total == 13_779_912                                # Table 3
    assert f"{out.total / 1e6:.1f}M" == "13.8M"                   # Table 1
    assert bn.added == 4 * 2 * (64 + 4 * 64 + 5 * 128 + 5 * 256 + 5 * 512)


def test_emp_on_cifar_resnet18() -> None:
    _, bn = _method("resnet18", "emp", "bn", 100)
    _, out = _method("resnet18", "emp", "bn+out", 100)
    assert f"{100 * bn.fraction:.3f}%" == "0.342%"
    assert f"{100 * out.fraction:.3f}%" == "2.171%"


def test_emp_on_the_seeds_mlp() -> None:
    row, out = _method("mlp-bn", "emp", "bn+out")
    assert row.parameters == 1_009_900 and out.total == 1_129_100  # Table 3
    assert 5 * row.parameters == 5_049_500                          # its explicit ensemble


def test_mean_field_on_resnet18_and_rank1_on_resnet50_and_wrn() -> None:
    _, bbb = _method("resnet18-imagenet", "bbb")
    assert f"{bbb.total / 1e6:.1f}M" == "23.4M"                     # seed 001, Table 1
    assert f"{100 * bbb.fraction:.0f}%" == "100%"
    row, rank1 = _method("resnet50", "rank-1")
    assert f"{row.parameters / 1e6:.1f}M" == "25.6M"                # seed 002, Table 1
    assert f"{rank1.total / 1e6:.1f}M" == "26.0M"
    # its BatchEnsemble row (25.8M) is the same factors, means only: half the added part
    assert f"{(row.parameters + rank1.added // 2) / 1e6:.1f}M" == "25.8M"
    row, rank1 = _method("wrn28-10", "rank-1", num_classes=10)
    assert f"{row.parameters / 1e6:.1f}M" == "36.5M"                # seed 002, Table 2
    assert f"{rank1.total / 1e6:.1f}M" == "36.6M"


def test_seed_figures_match_except_the_two_that_say_what_it_would_take() -> None:
    figures = seed_figures()
    assert len(figures) == 17
    printed = {(f.architecture, f.claim): f.printed for f in figures}
    assert printed[("resnet18-imagenet", "EMP/ECMP (BN+out), ResNet-18 ImageNet, K = 5: "
                    "parameters")] == "13,779,912"
    differ = [f for f in figures if not f.matches]
    assert [(f.architecture, f.num_classes, f.printed, f.computed) for f in differ] == [
        ("resnet50", 1000, "0.4%", "4.1%"), ("wrn28-10", 100, "36.6M", "36.7M")]
    assert "one component's share" in differ[0].note and "0.408%" in differ[0].note
    assert "113,115" in differ[1].note and "36,615,568" in differ[1].note
    for figure in figures:
        assert (figure.computed == figure.printed) == figure.matches
        assert figure.note


# --- the command ------------------------------------------------------------------------


def test_cli_text(capsys) -> None:
    code, out, err = run(capsys, "overhead", "resnet18-imagenet", "optunet")
    assert code == 0 and err == ""
    assert "resnet18-imagenet, 1,000 classes: 11,689,512 parameters" in out
    lines = out.splitlines()
    bn_out = next(line for line in lines if "EMP/ECMP K=5 bn+out" in line)
    assert "+2,090,400" in bn_out and "+17.88%" in bn_out and "13,779,912" in bn_out
    assert any("Rank-1 K=4" in line and "+81,240" in line for line in lines)
    assert "skipped: EMP/ECMP bn: the patch 'bn' needs BatchNorm layers" in out
    assert "mlp-bn" not in out  # only the named architectures


def test_cli_json_equals_the_core(capsys) -> None:
    code, out, _ = run(capsys, "overhead", "wrn28-10", "--num-classes", "100",
                       "--emp-components", "3", "--rank1-components", "2", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["kind"] == "overhead" and data["seed_figures"] == []
    assert (data["emp_components"], data["rank1_components"]) == (3, 2)
    [row] = data["architectures"]
    assert row["architecture"] == "wrn28-10" and row["num_classes"] == 100
    assert row["parameters"] == 36_536_884
    expected = architecture_overhead("wrn28-10", 100, emp_components=3, rank1_components=2)
    assert row == json.loads(json.dumps(expected.to_dict()))
    rank1 = next(m for m in row["methods"] if m["method"] == "rank-1")
    assert rank1["added"] == 2 * 2 * 19_671 and rank1["components"] == 2


def test_cli_seeds_alone_prints_only_the_figures(capsys) -> None:
    code, out, _ = run(capsys, "overhead", "--seeds")
    assert code == 0
    assert out.startswith("The papers' figures, recomputed: 15 of 17 match as printed")
    assert out.count("DIFFERS") == 2 and "parameters added" not in out
    code, out, _ = run(capsys, "overhead", "--seeds", "--json")
    data = json.loads(out)
    assert data["architectures"] == [] and len(data["seed_figures"]) == 17


def test_cli_without_architectures_lists_the_registry(capsys) -> None:
    from posteriorzoo.models import available_models

    code, out, _ = run(capsys, "overhead", "--json", "--num-classes", "7")
    data = json.loads(out)
    assert [row["architecture"] for row in data["architectures"]] == available_models()
    classes = {row["architecture"]: row["num_classes"] for row in data["architectures"]}
    assert classes["resnet50"] == 7 and classes["mlp"] == 1  # widths set mlp's outputs


@pytest.mark.parametrize("argv, fragment", [
    (["overhead", "resnet19"], "unknown model 'resnet19'"),
    (["overhead", "optunet", "--emp-components", "1"], "--emp-components"),
    (["overhead", "--emp-components", "0"], "--emp-components"),
    (["overhead", "--emp-components", "2.5"], "--emp-components"),
    (["overhead", "--rank1-components", "0"], "--rank1-components"),
    (["overhead", "--rank1-components", "1001"], "--rank1-components"),
    (["overhead", "--num-classes", "0"], "--num-classes"),
    (["overhead", "mlp", "--num-classes", "10"], "num_classes"),
], ids=["unknown-architecture", "emp-1", "emp-0", "emp-fraction", "rank1-0", "rank1-big",
        "classes-0", "mlp-classes"])
def test_bad_options_are_one_line(capsys, argv: list[str], fragment: str) -> None:
    code, out, err = run(capsys, *argv)
    assert_one_line_error(code, err, fragment)
    assert out == ""


def test_cli_bounds_are_the_cores() -> None:
    from posteriorzoo.cli.overhead_command import EMP_COMPONENTS, RANK1_COMPONENTS

    assert (EMP_COMPONENTS.low, EMP_COMPONENTS.high) == (2, MAX_COMPONENTS)
    assert (RANK1_COMPONENTS.low, RANK1_COMPONENTS.high) == (1, MAX_COMPONENTS)


def test_help_imports_no_torch() -> None:
    code = ("import contextlib, io, sys\n"
            "from posteriorzoo.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    try:\n"
            "        main(['overhead', '--help'])\n"
            "    except SystemExit:\n"
            "        pass\n"
            "print('torch' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    assert done.stdout.strip().splitlines()[-1] == "False"
