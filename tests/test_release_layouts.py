"""The authors' ResNet-18 release folders import with no key map.

``cifar10-resnet18``, ``cifar100-resnet18`` and ``tiny-imagenet-resnet18`` hold
torch-uncertainty ResNet-18s (``style="cifar"``) saved under the training routine's
attribute ``model``: our ``resnet18``'s keys but for the head, ``linear`` (ours ``fc``).
torch-uncertainty 0.13 (the test oracle ``make test`` installs) builds the foreign
networks here, loaded from its ResNet module files alone (the package's ``__init__``
needs Lightning and torchvision); its state dicts, prefixed and in float16 like the
release's, are packed in release-shaped archives and imported with ``posteriorzoo
import``; the collection must hold the same tensors under our names, and our network on
them must compute what torch-uncertainty's computes on the originals.
"""

from __future__ import annotations

import importlib
import importlib.util
import io
import sys
import tarfile
import types
from pathlib import Path

import pytest
import torch
from rounding_bounds import deep_rtol
from safetensors.torch import save as save_safetensors_bytes

from posteriorzoo import models
from posteriorzoo.cli import main
from posteriorzoo.collection import import_checkpoints, plan_import
from posteriorzoo.errors import ZooSchemaError
from posteriorzoo.symmetry import canonicalize, symmetry_structure
from posteriorzoo.zoo import open_zoo
from posteriorzoo.zoo.keymap import FOREIGN_LAYOUTS, closest_reading, implied_reading

#: The rules an import of a release ResNet-18 implies: the routine's prefix, then the head.
RELEASE_RULES = [("^model\\.", ""), ("^linear\\.", "fc.")]


def _oracle_resnet():
    """torch-uncertainty's ``resnet`` builder (``models/classification/resnet/std.py``),
    imported as a package of its own so that only ``std.py`` and ``utils.py`` run."""
    spec = importlib.util.find_spec("torch_uncertainty")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("torch-uncertainty (test oracle) is not installed")
    folder = Path(spec.submodule_search_locations[0]) / "models/classification/resnet"
    if "_tu_resnet_oracle" not in sys.modules:
        package = types.ModuleType("_tu_resnet_oracle")
        package.__path__ = [str(folder)]
        sys.modules["_tu_resnet_oracle"] = package
    return importlib.import_module("_tu_resnet_oracle.std").resnet


def _their_network(seed: int, num_classes: int, width: int, conv_bias: bool = False):
    """A torch-uncertainty ResNet-18 as the release's recipe builds it (``style="cifar"``,
    3 channels), with every parameter and BatchNorm buffer drawn from ``seed`` (fresh
    running statistics are 0 and 1, which would hide a swapped mean and variance)."""
    torch.manual_seed(seed)
    network = _oracle_resnet()(in_channels=3, num_classes=num_classes, arch=18,
                               conv_bias=conv_bias, width_multiplier=width / 64,
                               style="cifar")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in network.state_dict().items():
            if name.endswith("num_batches_tracked"):
                tensor.fill_(100 + seed)
            elif name.endswith("running_var"):
                tensor.copy_(torch.rand(tensor.shape, generator=generator) + 0.5)
            elif tensor.dim() == 1:   # BN weight, bias and mean; linear and conv biases
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.3)
    return network.eval()


def _release_state(network) -> dict[str, torch.Tensor]:
    """What a release member holds: the routine's state (``model.`` + the network's
    keys), floating tensors in float16; ``num_batches_tracked`` keeps its int64."""
    return {f"model.{key}": (value.half() if value.is_floating_point() else value)
            .contiguous() for key, value in network.state_dict().items()}


def _release_archive(path: Path, states: list[dict[str, torch.Tensor]]) -> None:
    """``<task>-<start>-<end>.tgz`` of ``<task>/model_<i>.safetensors`` members."""
    task = path.name.rsplit("-", 2)[0]
    with tarfile.open(path, "w:gz") as tar:
        for index, state in enumerate(states):
            data = save_safetensors_bytes(state)
            info = tarfile.TarInfo(f"{task}/model_{index}.safetensors")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def _ours(key: str) -> str:
    """Their key (prefix stripped) in our name, per the key table in the module docstring
    of :mod:`posteriorzoo.models.resnet`: only the head differs."""
    return "fc." + key[len("linear."):] if key.startswith("linear.") else key


@pytest.mark.parametrize("conv_bias", [False, True])
def test_their_layout_is_ours_but_for_the_head(conv_bias):
    """The established key table, checked on the oracle: in order, every key of
    torch-uncertainty's ResNet-18 is ours once ``linear`` is read ``fc``, with our shape
    (``shortcut.0/1`` projections on layer2-4, ``bn1``, a 3x3 stem); with
    ``conv_bias`` both have the 20 convolution biases (stem, 16 block convs, 3
    projections)."""
    theirs = _their_network(0, 100, 64, conv_bias).state_dict()
    ours = models.build("resnet18", 100, conv_bias=conv_bias).state_dict()
    assert [_ours(key) for key in theirs] == list(ours)
    assert all(theirs[key].shape == ours[_ours(key)].shape for key in theirs)
    assert theirs["conv1.weight"].shape == (64, 3, 3, 3)
    assert theirs["layer2.0.shortcut.0.weight"].shape == (128, 64, 1, 1)
    assert theirs["linear.weight"].shape == (100, 512)
    biases = [key for key in theirs if ".bias" in key and "bn" not in key
              and "shortcut.1" not in key and key != "linear.bias"]
    # 1 stem + 4 stages x 2 blocks x 2 convs + 3 projection shortcuts
    assert len(biases) == (1 + 16 + 3 if conv_bias else 0)
    expected = models.expected_state_shapes("resnet18", 100, conv_bias=conv_bias)
    reading = implied_reading(_release_state(_their_network(0, 100, 64, conv_bias)),
                              expected)
    assert reading.key_map.rules == RELEASE_RULES and reading.options == {}


def _import_by_cli(archive: Path, out: Path, *options: str) -> int:
    return main(["import", str(archive), "--out", str(out), *options])


@pytest.mark.filterwarnings("ignore:.* input checkpoint.s. record no SHA-256")
@pytest.mark.parametrize(("task", "architecture", "num_classes", "size", "width"), [
    ("cifar10-resnet18", "resnet18", 10, 32, 8),
    ("cifar100-resnet18", "resnet18", 100, 32, 64),   # the release's own shapes
    ("tiny-imagenet-resnet18", "resnet18-tiny", 200, 64, 8),
])
def test_release_folder_imports_with_no_key_map(tmp_path, task, architecture,
                                                num_classes, size, width):
    """The members of a release-shaped archive import by the CLI, no key map: the
    collection holds each float16 tensor as saved under our name, and our network on
    the stored weights gives torch-uncertainty's logits on the originals, bit for bit
    (the same float32 operations in the same order on the same values)."""
    seeds = (1,) if width == 64 else (1, 2)   # one full-size member is enough
    networks = [_their_network(seed, num_classes, width) for seed in seeds]
    states = [_release_state(network) for network in networks]
    archive = tmp_path / f"{task}-0-{len(seeds) - 1}.tgz"
    _release_archive(archive, states)
    options = [] if width == 64 else ["--model-option", f"width={width}"]
    assert _import_by_cli(archive, tmp_path / "z.h5", *options) == 0
    x = torch.randn(4, 3, size, size, generator=torch.Generator().manual_seed(0))
    with open_zoo(tmp_path / "z.h5") as zoo:
        assert (zoo.architecture, zoo.num_classes, len(zoo)) == (architecture,
                                                                 num_classes, len(seeds))
        for index, (network, state) in enumerate(zip(networks, states, strict=True)):
            stored = zoo.state_dict(index)
            assert set(stored) == {_ours(key[len("model."):]) for key in state}
            for key, value in state.items():
                ours = stored[_ours(key[len("model."):])]
                assert ours.dtype == value.dtype or not value.is_floating_point()
                assert torch.equal(ours.to(value.dtype), value)
            model = models.build(architecture, num_classes,
                                 **zoo.model_options).eval()
            model.load_state_dict({key: value.float() if value.is_floating_point()
                                   else value for key, value in stored.items()})
            network.load_state_dict({key[len("model."):]: value.float()
                                     if value.is_floating_point() else value
                                     for key, value in state.items()})
            with torch.no_grad():
                assert torch.equal(model(x), network(x))


@pytest.mark.filterwarnings("ignore:.* input checkpoint.s. record no SHA-256")
def test_provenance_and_dry_run_record_the_renaming(tmp_path, capsys):
    """The implied key map (prefix and head) is what ``--dry-run`` lists and what the
    import's provenance records, as a given key map would be; keys without the prefix
    (appended to the collection) have only the head renamed."""
    archive = tmp_path / "cifar10-resnet18-0-0.tgz"
    _release_archive(archive, [_release_state(_their_network(0, 10, 8))])
    plan = plan_import([archive], model_options={"width": 8})
    assert plan["key_map"]["rules"] == RELEASE_RULES and plan["key_map"]["implied"]
    assert plan["key_map"]["reading"].startswith(
        "without the keys' prefix 'model.' read as torch-uncertainty's ResNet")
    assert _import_by_cli(archive, tmp_path / "z.h5", "--dry-run", "--model-option",
                          "width=8") == 0
    assert "(implied: without the keys' prefix 'model.' read as torch-uncertainty's " \
        "ResNet" in capsys.readouterr().out
    result = import_checkpoints(tmp_path / "z.h5", [archive], model_options={"width": 8})
    assert result.provenance["options"]["key_map"]["rules"] == RELEASE_RULES
    # torch-uncertainty's own Hub script strips "model."; the head is still renamed
    bare = tmp_path / "cifar10-resnet18-1-1.tgz"
    _release_archive(bare, [{key[len("model."):]: value for key, value in
                             _release_state(_their_network(1, 10, 8)).items()}])
    result = import_checkpoints(tmp_path / "z.h5", [bare])
    assert result.provenance["options"]["key_map"]["rules"] == RELEASE_RULES[1:]
    with open_zoo(tmp_path / "z.h5") as zoo:
        assert len(zoo) == 2


@pytest.mark.filterwarnings("ignore:.* input checkpoint.s. record no SHA-256")
def test_conv_bias_variant_picks_the_option(tmp_path, capsys):
    """A ResNet-18 built with torch-uncertainty's ``conv_bias=True`` (its ``resnet``
    default from February 2024 to May 2025) fits our model built with ``conv_bias``:
    the import picks that option (the dry run shows it, the collection records it) and
    our network computes theirs. Told ``conv_bias=false``, the import refuses in one line
    that names the keys as read without ``model.`` and with the head renamed (not
    ``model.conv1.bias``), exit 2, nothing written."""
    network = _their_network(3, 10, 8, conv_bias=True)
    state = _release_state(network)
    archive = tmp_path / "cifar10-resnet18-0-0.tgz"
    _release_archive(archive, [state])
    plan = plan_import([archive], model_options={"width": 8})
    assert plan["attributes"]["model_options"] == {"conv_bias": True, "width": 8}
    assert plan["key_map"]["rules"] == RELEASE_RULES
    assert _import_by_cli(archive, tmp_path / "refused.h5", "--model-option", "width=8",
                          "--model-option", "conv_bias=false") == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and "model.conv1" not in error
    assert "without the keys' prefix 'model.' read as torch-uncertainty's ResNet" in error
    assert "unexpected key 'conv1.bias' (and 19 more)" in error and "missing" not in error
    assert not (tmp_path / "refused.h5").exists()
    assert _import_by_cli(archive, tmp_path / "z.h5", "--model-option", "width=8") == 0
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with open_zoo(tmp_path / "z.h5") as zoo:
        assert zoo.model_options == {"conv_bias": True, "width": 8}
        model = models.build("resnet18", 10, **zoo.model_options).eval()
        model.load_state_dict({key: value.float() if value.is_floating_point() else value
                               for key, value in zoo.state_dict(0).items()})
    network.load_state_dict({key[len("model."):]: value.float()
                             if value.is_floating_point() else value
                             for key, value in state.items()})
    with torch.no_grad():
        assert torch.equal(model(x), network(x))


def test_a_key_that_no_reading_fits_is_named_as_read(tmp_path, capsys):
    """A release member short of its BatchNorm counters fits no reading: the one-line
    refusal names them as the closest reading has them (``bn1.num_batches_tracked``, not
    ``model.bn1...``, and no head key), exit 2."""
    state = {key: value for key, value in _release_state(_their_network(4, 10, 8)).items()
             if not key.endswith("num_batches_tracked")}
    archive = tmp_path / "cifar10-resnet18-0-0.tgz"
    _release_archive(archive, [state])
    assert _import_by_cli(archive, tmp_path / "z.h5", "--model-option", "width=8") == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and "'model.bn1" not in error
    assert "missing key 'bn1.num_batches_tracked' (and 19 more)" in error
    assert "unexpected" not in error and "fc." not in error and "linear" in error
    assert not (tmp_path / "z.h5").exists()


@pytest.mark.filterwarnings("ignore:.* input checkpoint.s. record no SHA-256")
def test_counters_saved_in_float16_are_stored_as_integers(tmp_path):
    """torch-uncertainty's Hub script (``scripts/to_hub_format.py``) casts every tensor to
    float16, BatchNorm's ``num_batches_tracked`` too: such a member imports with one
    warning, each counter stored as the model's int64 with the value saved (39200 steps:
    a multiple of 32, float16's spacing there, so exact); a counter that is not a whole
    number is refused, nothing written."""
    network = _their_network(5, 10, 8)
    state = {f"model.{key}": value.half() for key, value in network.state_dict().items()}
    state["model.layer1.0.bn1.num_batches_tracked"] = torch.tensor(39200.0).half()
    archive = tmp_path / "cifar10-resnet18-0-0.tgz"
    _release_archive(archive, [state])
    with pytest.warns(UserWarning, match=r"20 integer tensor\(s\) \('bn1.num_batches_tracked"
                      r"'...\) arrive in floating point"):
        import_checkpoints(tmp_path / "z.h5", [archive], model_options={"width": 8})
    with open_zoo(tmp_path / "z.h5") as zoo:
        stored = zoo.state_dict(0)
    counters = {key: value for key, value in stored.items() if "num_batches" in key}
    assert len(counters) == 20 and all(value.dtype == torch.int64 for value in counters.values())
    assert int(counters["bn1.num_batches_tracked"]) == 105
    assert int(counters["layer1.0.bn1.num_batches_tracked"]) == 39200
    assert torch.equal(stored["fc.weight"], state["model.linear.weight"])
    state["model.bn1.num_batches_tracked"] = torch.tensor(1.5).half()
    _release_archive(archive, [state])
    with pytest.warns(UserWarning, match="arrive in floating point"), pytest.raises(
            ZooSchemaError, match=r"'bn1.num_batches_tracked' holds float16 values that are "
            r"not whole numbers, where the model has int64"):
        import_checkpoints(tmp_path / "refused.h5", [archive], model_options={"width": 8})
    assert not (tmp_path / "refused.h5").exists()


def test_an_imagenet_stem_is_refused_in_one_line(tmp_path, capsys):
    """Were a TinyImageNet member built with torch-uncertainty's ``style="imagenet"``
    (7x7 stride-2 stem and max-pool; our ``resnet18-tiny`` assumes its recipe's
    ``style="cifar"``), the keys fit but the stem's shape does not: one line naming
    ``conv1.weight`` and both shapes, exit 2, nothing written."""
    torch.manual_seed(0)
    network = _oracle_resnet()(in_channels=3, num_classes=200, arch=18,
                               width_multiplier=8 / 64, style="imagenet")
    archive = tmp_path / "tiny-imagenet-resnet18-0-0.tgz"
    _release_archive(archive, [_release_state(network)])
    assert _import_by_cli(archive, tmp_path / "z.h5", "--model-option", "width=8") == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and "'conv1.weight' has shape (8, 3, 7, 7), expected " \
        "(8, 3, 3, 3)" in error
    assert not (tmp_path / "z.h5").exists()


def test_canonicalization_keeps_the_conv_bias_variant_function():
    """Our ``resnet18`` with ``conv_bias`` is canonicalized like the plain one: the
    structure sees each bias with its channel (no gaps), the canonical weights differ
    (biases included) and the logits stay the same up to the softmax's shift: within
    ``2 deep_rtol`` of their scale (two float32 passes of the same depth, each within
    ``deep_rtol`` of the exact function)."""
    network = _their_network(6, 10, 8, conv_bias=True)
    state = {_ours(key): value for key, value in network.state_dict().items()}
    options = {"num_classes": 10, "width": 8, "conv_bias": True}
    assert symmetry_structure("resnet18", state, **options).gaps == []
    canonical = canonicalize("resnet18", state, **options)
    assert not torch.equal(canonical["layer1.0.conv1.bias"], state["layer1.0.conv1.bias"])
    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    model = models.build("resnet18", **options).eval()
    with torch.no_grad():
        model.load_state_dict(state)
        before = model(x)
        model.load_state_dict(canonical)
        after = model(x)
    before, after = (logits - logits.mean(1, keepdim=True) for logits in (before, after))
    scale = float(before.abs().max())
    assert float((after - before).abs().max()) <= 2 * deep_rtol(model, x) * scale


def test_implied_key_map_renames_only_an_exact_fit():
    """Stripping a prefix and renaming a known layout happen only when the result is
    exactly the model's keys: a key too many or too few, or two keys sent to one name,
    leaves the keys alone; ``module.`` and unprefixed foreign keys are read too; the
    closest reading names what is still missing or unexpected, and says nothing when the
    keys as they are come closest."""
    expected = ["conv1.weight", "fc.weight", "fc.bias"]
    theirs = ["conv1.weight", "linear.weight", "linear.bias"]
    def rules(keys, keys_with=None):
        reading = implied_reading(keys, expected, keys_with)
        return None if reading is None else reading.key_map.rules

    assert implied_reading(expected, expected) is None
    assert rules(theirs) == [("^linear\\.", "fc.")]
    assert rules([f"module.{key}" for key in theirs]) == [
        ("^module\\.", ""), ("^linear\\.", "fc.")]
    assert rules([f"model.{key}" for key in expected]) == [("^model\\.", "")]
    assert rules([*theirs, "linear.extra"]) is None
    assert rules(theirs[:2]) is None
    assert rules(["conv1.weight", "linear.weight", "fc.weight"]) is None   # two to fc.weight
    assert rules(["model.conv1.weight", "other.fc.weight"]) is None
    # a layout with options is read only where the model takes them, given keys_with
    biased = [*theirs, "conv1.bias"]
    assert rules(biased) is None and rules(biased, lambda options: []) is None
    reading = implied_reading(biased, expected, lambda options: [*expected, "conv1.bias"]
                              if options == {"conv_bias": True} else [])
    assert reading.options == {"conv_bias": True} and "conv_bias=true" in reading.what
    assert closest_reading([f"model.{key}" for key in theirs[:2]], expected) == (
        "without the keys' prefix 'model.' read as "
        f"{FOREIGN_LAYOUTS[0].name}: missing key 'fc.bias'")
    assert closest_reading(["conv1.weight", "fc.weight"], expected) is None
    assert closest_reading(["model.net.conv1.weight"], expected) is None
