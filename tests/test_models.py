"""Tests of posteriorzoo.models: registry, architectures and state-dict schemas."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from posteriorzoo.errors import PosteriorZooError, UnknownNameError, ZooSchemaError
from posteriorzoo.models import (
    ModelEntry,
    available_models,
    build,
    check_state_dict,
    expected_state_shapes,
    input_shape,
    model_entry,
    parameter_count,
    register,
)

# Small widths keep the ResNet tests fast on 2 CPU cores.
SMALL = {
    "optunet": {},
    "optunet-v1": {},
    "resnet18": {"width": 8},
    "resnet18-tiny": {"width": 8},
    "mlp": {"widths": (5, 7, 3)},
}


def _trainable(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _batch(name: str, n: int = 3, **options: object) -> torch.Tensor:
    return torch.randn(n, *input_shape(name, **options))


# --- registry ---------------------------------------------------------------------------


def test_available_models_lists_the_builtin_architectures() -> None:
    assert available_models() == ["mlp", "mlp-bn", "optunet", "optunet-v1", "resnet18",
                                  "resnet18-imagenet", "resnet18-tiny", "resnet20-frn-silu",
                                  "resnet50", "small-cnn", "wrn28-10"]


def test_model_spec_records_defaults_and_options() -> None:
    spec = model_entry("resnet18")
    assert isinstance(spec, ModelEntry)
    assert spec.name == "resnet18"
    assert spec.num_classes == 100
    assert dict(spec.options) == {"width": 64, "dropout": 0.0, "in_channels": 3,
                                  "conv_bias": False}
    assert spec.description
    assert model_entry("resnet18-tiny").num_classes == 200
    assert model_entry("optunet").num_classes == 10
    assert model_entry("mlp").num_classes is None
    with pytest.raises(TypeError):
        spec.options["width"] = 8  # read-only, so callers cannot change others' defaults


def test_input_shapes() -> None:
    assert input_shape("optunet") == (1, 28, 28)
    assert input_shape("optunet-v1") == (1, 28, 28)
    assert input_shape("resnet18") == (3, 32, 32)
    assert input_shape("resnet18-tiny") == (3, 64, 64)
    assert input_shape("resnet18", in_channels=1) == (1, 32, 32)   # e.g. Fashion-MNIST
    assert input_shape("resnet50", in_channels=1) == (1, 224, 224)
    assert build("resnet18", width=4, in_channels=1).conv1.weight.shape == (4, 1, 3, 3)
    assert input_shape("mlp") == (2,)
    assert input_shape("mlp", widths=(784, 100, 10)) == (784,)


def test_unknown_model_name_raises_and_lists_valid_names() -> None:
    for call in (
        lambda: build("resnet19"),
        lambda: model_entry("resnet19"),
        lambda: input_shape("resnet19"),
        lambda: parameter_count("resnet19"),
        lambda: expected_state_shapes("resnet19"),
        lambda: check_state_dict("resnet19", {}),
    ):
        with pytest.raises(UnknownNameError) as info:
            call()
        assert "resnet19" in str(info.value)
        assert "optunet" in str(info.value) and "resnet18-tiny" in str(info.value)
        assert isinstance(info.value, PosteriorZooError)


def test_unknown_option_raises_and_lists_valid_options() -> None:
    with pytest.raises(UnknownNameError) as info:
        build("resnet18", depth=34)
    assert "depth" in str(info.value)
    assert "dropout" in str(info.value) and "width" in str(info.value)
    with pytest.raises(UnknownNameError, match="widths"):
        build("optunet", widths=(1, 2))
    with pytest.raises(UnknownNameError):
        input_shape("optunet", width=3)
    with pytest.raises(UnknownNameError):
        parameter_count("mlp", width=3)


def test_register_adds_a_model_and_refuses_silent_overwrite() -> None:
    from posteriorzoo.models import registry

    @register("test-linear", num_classes=4, input_shape=(6,), description="x", options={})
    def _factory(num_classes: int) -> nn.Module:
        return nn.Linear(6, num_classes)

    try:
        assert "test-linear" in available_models()
        assert parameter_count("test-linear") == 6 * 4 + 4
        assert build("test-linear", num_classes=2)(torch.randn(1, 6)).shape == (1, 2)
        with pytest.raises(ValueError, match="already registered"):
            register("test-linear", num_classes=4, input_shape=(6,), description="x")(_factory)

        # Replacing an entry must not leave stale cached schemas behind.
        register("test-linear", num_classes=4, input_shape=(6,), description="x", replace=True)(
            lambda num_classes: nn.Linear(6, num_classes, bias=False)
        )
        assert parameter_count("test-linear") == 6 * 4
    finally:
        registry._REGISTRY.pop("test-linear", None)


def test_invalid_option_values_are_rejected() -> None:
    with pytest.raises(ValueError):
        build("optunet", dropout=1.0)
    with pytest.raises(ValueError):
        build("resnet18", width=0)
    with pytest.raises(ValueError):
        build("optunet", num_classes=0)
    with pytest.raises(ValueError):
        build("mlp", widths=(3,))


# --- OptuNet ----------------------------------------------------------------------------


def test_optunet_parameter_counts() -> None:
    assert parameter_count("optunet") == 392 == _trainable(build("optunet"))
    assert parameter_count("optunet-v1") == 355 == _trainable(build("optunet-v1"))


def test_optunet_layer_list() -> None:
    model = build("optunet")
    layers = [(name, type(module)) for name, module in model.named_children()]
    assert layers == [
        ("conv1", nn.Conv2d),
        ("relu1", nn.ReLU),
        ("pool1", nn.MaxPool2d),
        ("conv2", nn.Conv2d),
        ("relu2", nn.ReLU),
        ("pool2", nn.AdaptiveAvgPool2d),
        ("flatten", nn.Flatten),
        ("dropout", nn.Dropout),
        ("fc", nn.Linear),
    ]
    conv1, conv2 = model.conv1, model.conv2
    assert (conv1.in_channels, conv1.out_channels, conv1.kernel_size) == (1, 2, (4, 4))
    assert conv1.bias is None and conv1.stride == (1, 1)
    assert (conv2.in_channels, conv2.out_channels, conv2.kernel_size) == (2, 10, (5, 5))
    assert conv2.groups == 2 and conv2.bias is None
    assert model.pool1.kernel_size == 3 and model.pool1.stride == 3
    assert (model.fc.in_features, model.fc.out_features) == (10, 10)
    assert model.fc.bias is not None
    assert list(model.state_dict()) == ["conv1.weight", "conv2.weight", "fc.weight", "fc.bias"]


def test_optunet_spatial_sizes_28_25_8_4_1() -> None:
    model = build("optunet").eval()
    sizes: dict[str, tuple[int, ...]] = {}
    for name in ("conv1", "pool1", "conv2", "pool2"):
        module = getattr(model, name)
        module.register_forward_hook(
            lambda _m, _i, out, name=name: sizes.__setitem__(name, tuple(out.shape))
        )
    out = model(torch.randn(4, 1, 28, 28))
    assert sizes == {
        "conv1": (4, 2, 25, 25),
        "pool1": (4, 2, 8, 8),
        "conv2": (4, 10, 4, 4),
        "pool2": (4, 10, 1, 1),
    }
    assert out.shape == (4, 10)


def test_optunet_v1_head() -> None:
    model = build("optunet-v1")
    assert (model.fc1.in_features, model.fc1.out_features) == (10, 3)
    assert (model.fc2.in_features, model.fc2.out_features) == (3, 10)
    keys = list(model.state_dict())
    expected = ["conv1.weight", "conv2.weight", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    assert keys == expected


def test_optunet_v1_has_relu_between_head_layers() -> None:
    model = build("optunet-v1").eval()
    with torch.no_grad():
        model.fc1.weight.copy_(torch.eye(3, 10) * -1.0)  # every hidden unit negative...
        model.fc1.bias.zero_()
    x = torch.rand(2, 1, 28, 28)  # ...on non-negative features, so ReLU gives zeros
    out = model(x)
    assert torch.equal(out, model.fc2.bias.expand(2, 10))   # 0 * W + b: exact


# --- ResNet-18 --------------------------------------------------------------------------


def test_resnet18_parameter_count_cifar100() -> None:
    assert parameter_count("resnet18", num_classes=100) == 11_220_132
    assert parameter_count("resnet18") == 11_220_132  # 100 classes is the default
    # 10 classes: the head loses 90 * (512 + 1) parameters.
    assert parameter_count("resnet18", num_classes=10) == 11_220_132 - 90 * 513
    assert parameter_count("resnet18-tiny") == 11_220_132 + 100 * 513


def test_resnet18_structure_and_keys() -> None:
    model = build("resnet18", num_classes=10, width=8)
    assert model.conv1.kernel_size == (3, 3) and model.conv1.stride == (1, 1)
    assert model.conv1.bias is None
    assert not any(isinstance(m, nn.MaxPool2d) for m in model.modules())
    widths = [getattr(model, f"layer{i}")[1].conv2.out_channels for i in range(1, 5)]
    assert widths == [8, 16, 32, 64]
    keys = set(model.state_dict())
    assert {"conv1.weight", "bn1.running_mean", "layer1.0.conv1.weight", "fc.bias"} <= keys
    # 1x1 conv + BN shortcuts exactly where the shape changes.
    shortcuts = sorted(k.rsplit(".", 1)[0] for k in keys if ".shortcut." in k)
    assert set(shortcuts) == {f"layer{i}.0.shortcut.{j}" for i in (2, 3, 4) for j in (0, 1)}
    assert model.layer2[0].shortcut[0].kernel_size == (1, 1)
    assert model.fc.in_features == 64


def test_resnet18_blocks_add_the_shortcut() -> None:
    model = build("resnet18", num_classes=10, width=8).eval()
    identity_block, projection_block = model.layer1[0], model.layer2[0]
    with torch.no_grad():
        for block in (identity_block, projection_block):
            block.bn2.weight.zero_()  # silence the residual branch...
            block.bn2.bias.zero_()
        x = torch.rand(2, 8, 16, 16)  # ...so only the shortcut is left, then the ReLU
        # the silenced branch gives exact zeros (0 times anything, plus 0), so the block
        # is relu(x + 0) = x and relu(shortcut(x) + 0): exact
        assert torch.equal(identity_block(x), x)
        expected = torch.relu(projection_block.shortcut(x))
        assert expected.shape == (2, 16, 8, 8)
        assert torch.equal(projection_block(x), expected)


def test_resnet18_real_build_matches_meta_count() -> None:
    model = build("resnet18")
    assert _trainable(model) == 11_220_132
    assert model.fc.out_features == 100


def test_resnet18_tiny_accepts_64x64_and_uses_cifar_stem() -> None:
    model = build("resnet18-tiny", width=8).eval()
    assert model.conv1.kernel_size == (3, 3) and model.conv1.stride == (1, 1)
    sizes: list[tuple[int, ...]] = []
    # A hook returning non-None would replace the output, hence append (returns None).
    model.layer4.register_forward_hook(lambda _m, _i, out: sizes.append(tuple(out.shape)))
    out = model(torch.randn(2, 3, 64, 64))
    assert out.shape == (2, 200)
    assert sizes == [(2, 64, 8, 8)]  # 64 / 8: no stride-2 stem, no max-pool


# --- MLP --------------------------------------------------------------------------------


@pytest.mark.parametrize("widths", [(2, 2, 1), (5, 7, 3), (784, 100, 50, 10), (4, 1)])
def test_mlp_parameter_count_formula(widths: tuple[int, ...]) -> None:
    formula = sum(a * b + b for a, b in zip(widths[:-1], widths[1:], strict=True))
    assert parameter_count("mlp", widths=widths) == formula
    assert _trainable(build("mlp", widths=widths)) == formula


def test_mlp_toy_keys_and_relu() -> None:
    model = build("mlp", widths=(2, 2, 1))
    assert list(model.state_dict()) == [
        "layers.0.weight",
        "layers.0.bias",
        "layers.1.weight",
        "layers.1.bias",
    ]
    assert parameter_count("mlp") == 9  # the default is the paper's 2-2-1 toy
    with torch.no_grad():
        model.layers[0].weight.copy_(torch.eye(2))
        model.layers[0].bias.zero_()
        model.layers[1].weight.fill_(1.0)
        model.layers[1].bias.zero_()
    out = model(torch.tensor([[1.0, -2.0], [-1.0, -1.0]]))
    torch.testing.assert_close(out, torch.tensor([[1.0], [0.0]]))  # ReLU drops negatives


def test_mlp_num_classes_must_match_output_width() -> None:
    assert build("mlp", num_classes=3, widths=(5, 3)).layers[-1].out_features == 3
    with pytest.raises(ZooSchemaError, match="widths"):
        build("mlp", num_classes=3, widths=(2, 2, 1))
    with pytest.raises(ValueError):  # ZooSchemaError is a ValueError too
        parameter_count("mlp", num_classes=2)


def test_mlp_accepts_list_widths() -> None:
    assert parameter_count("mlp", widths=[3, 4, 2]) == 3 * 4 + 4 + 4 * 2 + 2
    assert expected_state_shapes("mlp", widths=[3, 4, 2])["layers.1.weight"][0] == (2, 4)


# --- every model ------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SMALL))
def test_forward_output_shape(name: str) -> None:
    options = SMALL[name]
    model = build(name, **options).eval()
    n_out = options["widths"][-1] if name == "mlp" else model_entry(name).num_classes
    with torch.no_grad():
        assert model(_batch(name, 3, **options)).shape == (3, n_out)
    if name != "mlp":
        model = build(name, num_classes=7, **options).eval()
        with torch.no_grad():
            assert model(_batch(name, 2, **options)).shape == (2, 7)


@pytest.mark.parametrize("name", sorted(SMALL))
def test_expected_state_shapes_match_real_model(name: str) -> None:
    options = SMALL[name]
    real = {k: (tuple(v.shape), v.dtype) for k, v in build(name, **options).state_dict().items()}
    expected = expected_state_shapes(name, **options)
    assert list(expected) == list(real)  # same keys, same order
    assert expected == real


def test_expected_state_shapes_include_batchnorm_buffers() -> None:
    shapes = expected_state_shapes("resnet18", num_classes=10, width=8)
    assert shapes["bn1.running_mean"] == ((8,), torch.float32)
    assert shapes["bn1.running_var"] == ((8,), torch.float32)
    assert shapes["bn1.num_batches_tracked"] == ((), torch.int64)
    assert shapes["layer3.0.shortcut.1.running_var"] == ((32,), torch.float32)
    assert shapes["fc.weight"] == ((10, 64), torch.float32)


def test_expected_state_shapes_does_not_touch_rng_or_allocate() -> None:
    torch.manual_seed(3)
    reference = torch.rand(5)
    torch.manual_seed(3)
    expected_state_shapes("resnet18", num_classes=17)  # uncached: a fresh build on meta
    assert torch.equal(torch.rand(5), reference)


def test_expected_state_shapes_returns_a_fresh_dict() -> None:
    first = expected_state_shapes("optunet")
    first.pop("fc.bias")
    assert "fc.bias" in expected_state_shapes("optunet")


# --- check_state_dict -------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SMALL))
def test_check_state_dict_accepts_own_state_dict(name: str) -> None:
    options = SMALL[name]
    check_state_dict(name, build(name, **options).state_dict(), **options)


def test_check_state_dict_rejects_missing_key() -> None:
    state = build("resnet18", width=8).state_dict()
    del state["layer2.0.shortcut.1.running_mean"]
    with pytest.raises(ZooSchemaError, match=r"missing key 'layer2\.0\.shortcut\.1\.running_mean'"):
        check_state_dict("resnet18", state, width=8)


def test_check_state_dict_rejects_extra_key() -> None:
    state = build("optunet").state_dict()
    state["conv1.bias"] = torch.zeros(2)
    with pytest.raises(ZooSchemaError, match=r"unexpected key 'conv1\.bias'"):
        check_state_dict("optunet", state)


def test_check_state_dict_rejects_wrong_shape() -> None:
    state = build("optunet").state_dict()
    state["conv2.weight"] = torch.zeros(10, 2, 5, 5)  # conv2 without groups
    with pytest.raises(ZooSchemaError) as info:
        check_state_dict("optunet", state)
    message = str(info.value)
    assert "conv2.weight" in message and "(10, 2, 5, 5)" in message and "(10, 1, 5, 5)" in message


def test_check_state_dict_uses_num_classes_and_options() -> None:
    state = build("optunet", num_classes=10).state_dict()
    with pytest.raises(ZooSchemaError, match="fc.weight"):
        check_state_dict("optunet", state, num_classes=5)
    resnet = build("resnet18", num_classes=10, width=8).state_dict()
    check_state_dict("resnet18", resnet, num_classes=10, width=8)
    with pytest.raises(ZooSchemaError):
        check_state_dict("resnet18", resnet, num_classes=10, width=16)


def test_check_state_dict_accepts_numpy_and_optionally_checks_dtypes() -> None:
    state = {k: v.numpy().astype(np.float16) for k, v in build("optunet").state_dict().items()}
    check_state_dict("optunet", state)  # float16 storage is fine by default
    with pytest.raises(ZooSchemaError, match="dtype"):
        check_state_dict("optunet", state, check_dtypes=True)
    state32 = {k: v.astype(np.float32) for k, v in state.items()}
    check_state_dict("optunet", state32, check_dtypes=True)
    with pytest.raises(ZooSchemaError, match="no shape"):
        check_state_dict("optunet", {**state32, "fc.bias": [0.0] * 10})


# --- dropout and initialisation ---------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "p"),
    [
        ("optunet", 0.2),
        ("optunet-v1", 0.2),
        ("resnet18", 0.5),
        ("resnet18-tiny", 0.5),
        ("mlp", 0.5),
    ],
)
def test_dropout_changes_train_outputs_only(name: str, p: float) -> None:
    options = {**SMALL[name]}
    if name == "mlp":
        options["widths"] = (5, 64, 3)  # enough hidden units for dropout to show
    torch.manual_seed(0)
    plain = build(name, **options)
    torch.manual_seed(0)
    dropped = build(name, dropout=p, **options)
    assert parameter_count(name, dropout=p, **options) == parameter_count(name, **options)
    assert _trainable(dropped) == _trainable(plain)
    assert expected_state_shapes(name, dropout=p, **options) == expected_state_shapes(
        name, **options
    )
    x = _batch(name, 4, **options).abs()
    with torch.no_grad():
        plain.eval()
        dropped.eval()
        assert torch.equal(dropped(x), plain(x))   # evaluation: the same operations
        plain.train()
        dropped.train()
        torch.manual_seed(1)
        assert not torch.allclose(dropped(x), plain(x))


def test_mc_dropout_samples_differ_in_train_mode() -> None:
    model = build("optunet", dropout=0.2).train()
    x = torch.rand(8, 1, 28, 28)
    torch.manual_seed(0)
    first = model(x)
    second = model(x)
    assert not torch.allclose(first, second)


@pytest.mark.parametrize("name", sorted(SMALL))
def test_initialisation_is_reproducible_under_manual_seed(name: str) -> None:
    options = SMALL[name]
    torch.manual_seed(123)
    first = build(name, **options).state_dict()
    torch.manual_seed(123)
    second = build(name, **options).state_dict()
    torch.manual_seed(124)
    other = build(name, **options).state_dict()
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert not all(torch.equal(first[k], other[k]) for k in first)
