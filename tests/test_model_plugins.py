"""Models of your own: plugin modules (--models, POSTERIORZOO_MODELS, entry points), the
module a collection records, training in worker processes, and the README's example.

Every test registers its model from a module written into its own folder, under a name
of its own, and leaves the registry and the loaded plugins as it found them.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import h5py
import numpy as np
import pytest
import torch
from rounding_bounds import U32, gamma, mlp_forward_bounds

from posteriorzoo.cli import MODELS_VARIABLE, build_parser, main
from posteriorzoo.errors import UnknownNameError, ZooFormatError
from posteriorzoo.models import ModelPluginError, build, load_models, model_entry, plugins, registry
from posteriorzoo.zoo import create_zoo, open_zoo

ROOT = Path(__file__).resolve().parent.parent
_NAMES = itertools.count()

#: A plugin: an MLP with a LeakyReLU, on 28x28 images, with MC Dropout's option.
PLUGIN = '''\
from torch import nn

from posteriorzoo.models import register


@register({model!r}, num_classes=10, input_shape=(1, 28, 28), description="test plugin",
          options={{"hidden": 8, "slope": 0.1, "dropout": 0.0}})
def build(num_classes, hidden, slope, dropout):
    return nn.Sequential(nn.Flatten(), nn.Linear(784, hidden), nn.LeakyReLU(slope),
                         nn.Dropout(dropout), nn.Linear(hidden, num_classes))
'''


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """A folder on Python's path for plugin modules; the registry, the loaded plugins and
    the entry points are restored afterwards."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(plugins, "_LOADED", [])
    monkeypatch.setattr(plugins, "_ENTRY_POINTS", [])  # no installed plugins unless a test adds
    monkeypatch.delenv(MODELS_VARIABLE, raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))  # sys.path is restored, appends included
    modules = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - modules:
        if name.startswith("pz_plugin_"):
            del sys.modules[name]
    for callback in registry._ON_CHANGE:  # caches keyed by this test's model names
        callback()


def write_plugin(folder: Path, text: str = PLUGIN) -> tuple[str, str]:
    """A plugin module of a new name registering a model of a new name: (module, model)."""
    number = next(_NAMES)
    module, model = f"pz_plugin_{os.getpid()}_{number}", f"plugin-mlp-{number}"
    (folder / f"{module}.py").write_text(text.format(model=model))
    return module, model


def forget(model: str) -> None:
    """The model is no longer registered and its module no longer loaded (a new process)."""
    entry = registry._REGISTRY.pop(model)
    plugins._LOADED[:] = [s for s in plugins._LOADED if s != entry.module]
    sys.modules.pop(entry.module.partition(":")[0], None)


def small_collection(path: Path, model: str, count: int = 3) -> Path:
    template = build(model).state_dict()
    with create_zoo(path, architecture=model, dataset="digits", method="de", num_classes=10,
                    template=template) as zoo:
        for seed in range(count):
            torch.manual_seed(seed)
            zoo.append(build(model).state_dict(), seed=seed)
    return path


def one_line_error(capsys, code: int) -> str:
    captured = capsys.readouterr()
    assert code == 2
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert "Traceback" not in captured.err
    return lines[0]


# ---------------------------------------------------------------------------- loading


def test_load_models_registers_and_credits_the_module(folder):
    module, model = write_plugin(folder)
    assert load_models(module) == [model]
    entry = model_entry(model)
    assert (entry.module, entry.package) == (module, None)
    assert load_models(module) == []  # once per process
    assert model_entry("optunet").module is None  # built-in


def test_a_module_no_import_could_repeat_is_not_recorded(folder):
    """A module loaded from a file under a name that is no module name records nothing
    (a collection must not name a module nobody can load)."""
    import importlib.util

    module, model = write_plugin(folder)
    spec = importlib.util.spec_from_file_location("pz plugin-by-path", folder / f"{module}.py")
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    assert model_entry(model).module is None
    assert registry.provider_attributes(model) == {}


def test_a_callable_registers_too(folder):
    text = PLUGIN.replace("@register(", "def register_all():\n    register(")
    text = text.replace('"dropout": 0.0}})\ndef build', '"dropout": 0.0}})(build)\n\n\ndef build')
    module, model = write_plugin(folder, text)
    assert load_models(f"{module}") == []  # importing registers nothing
    assert load_models(f"{module}:register_all") == [model]
    assert model_entry(model).module == f"{module}:register_all"


@pytest.mark.parametrize("name", ["a/b.py", "my models", "x;y", "1abc", "a..b", "a:", "-x",
                                  "m" * 201])
def test_names_that_are_no_module_are_refused(folder, name):
    with pytest.raises(ModelPluginError, match="is not a module name"):
        load_models(name)


def test_a_module_that_cannot_be_imported_is_one_line(folder):
    with pytest.raises(ModelPluginError, match=r"model module pz_none: no module named "
                                               r"'pz_none'"):
        load_models("pz_none")
    module, _ = write_plugin(folder, "import torch\n\nraise RuntimeError('no GPU here')\n")
    with pytest.raises(ModelPluginError) as caught:
        load_models(module)
    message = str(caught.value)
    assert "\n" not in message
    assert f"RuntimeError: no GPU here ({module}.py, line 3)" in message
    module, _ = write_plugin(folder, "import pz_missing_dependency\n")
    with pytest.raises(ModelPluginError, match="importing it failed: No module named "
                                               "'pz_missing_dependency'"):
        load_models(module)
    module, _ = write_plugin(folder, "def broken(:\n")
    with pytest.raises(ModelPluginError, match=rf"SyntaxError: .*{module}.py, line 1"):
        load_models(module)


def test_cli_models_option_and_environment(folder, monkeypatch, capsys, tmp_path):
    assert MODELS_VARIABLE == plugins.ENVIRONMENT_VARIABLE  # named twice: the CLI stays light
    module, model = write_plugin(folder)
    other, other_model = write_plugin(folder)
    load_models(module)
    path = small_collection(tmp_path / "zoo.h5", model)
    forget(model)
    code = main(["--models", f"pz_none,{module}", "info", str(path)])
    line = one_line_error(capsys, code)
    assert line.startswith("posteriorzoo info: error: --models pz_none: no module named")
    assert main(["--models", f"{module},{other}", "info", str(path)]) == 0
    assert "plugin-mlp" in capsys.readouterr().out
    forget(model)
    forget(other_model)
    monkeypatch.setenv(MODELS_VARIABLE, module)
    assert main(["--models", other, "info", str(path)]) == 0
    assert {model, other_model} <= set(registry._REGISTRY)
    monkeypatch.setenv(MODELS_VARIABLE, "pz_none")
    line = one_line_error(capsys, main(["info", str(path)]))
    assert f"{MODELS_VARIABLE}: module 'pz_none': no module named" in line


def test_cli_looks_in_the_current_folder(tmp_path, monkeypatch, capsys):
    """A console script does not put the current folder on Python's path; --models does."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(plugins, "_LOADED", [])
    monkeypatch.syspath_prepend(str(ROOT))  # restores sys.path afterwards
    sys.path[:] = [entry for entry in sys.path if entry not in ("", os.getcwd(), str(tmp_path))]
    module, model = write_plugin(tmp_path)
    monkeypatch.chdir(tmp_path)
    try:
        assert main(["--models", module, "info", "absent.h5"]) == 2
        assert "absent.h5" in capsys.readouterr().err  # the plugin loaded, then info failed
        assert model in registry._REGISTRY
    finally:
        sys.modules.pop(module, None)


# ------------------------------------------------------------------------ entry points


def install_distribution(folder: Path, package: str, value: str) -> None:
    """A distribution on Python's path declaring ``value`` in the group posteriorzoo.models,
    as ``pip install`` leaves one."""
    info = folder / f"{package}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[posteriorzoo.models]\nmodels = {value}\n")


def test_entry_points_load_when_a_name_is_missing(folder, monkeypatch):
    text = PLUGIN.replace("@register(", "def register_all():\n    register(")
    text = text.replace('"dropout": 0.0}})\ndef build', '"dropout": 0.0}})(build)\n\n\ndef build')
    module, model = write_plugin(folder, text)
    package = f"pz-plugin-package-{next(_NAMES)}"
    install_distribution(folder, package, f"{module}:register_all")
    monkeypatch.setattr(plugins, "_ENTRY_POINTS", None)  # read the installed ones again
    assert model not in registry._REGISTRY
    entry = model_entry(model)  # loaded because the name was missing
    assert (entry.module, entry.package) == (f"{module}:register_all", package)
    assert registry.provider_attributes(model) == {"model_module": f"{module}:register_all",
                                                   "model_package": package}


def test_a_broken_entry_point_is_one_line_naming_its_package(folder, monkeypatch):
    package = f"pz-broken-{next(_NAMES)}"
    install_distribution(folder, package, "pz_plugin_absent_module")
    monkeypatch.setattr(plugins, "_ENTRY_POINTS", None)
    assert model_entry("optunet")  # registered names need no plugin
    with pytest.raises(ModelPluginError, match=f"the entry point 'models' of the package "
                                               f"'{package}'.*no module named"):
        model_entry("no-such-model")


# ---------------------------------------------------- collections remember the module


def test_info_names_the_module_of_a_missing_model(folder, capsys):
    module, model = write_plugin(folder)
    load_models(module)
    path = small_collection(folder / "zoo.h5", model)
    with h5py.File(path, "r") as handle:
        assert handle.attrs["model_module"] == module
        assert "model_package" not in handle.attrs
    before = path.read_bytes()
    forget(model)
    expected = (f"unknown model '{model}': it was registered by module '{module}'; load it "
                f"with --models {module} or POSTERIORZOO_MODELS={module}")
    with pytest.raises(UnknownNameError) as caught:
        open_zoo(path)
    assert str(caught.value) == f"{path}: {expected}"
    for command in (["info", str(path)], ["verify", str(path)]):
        line = one_line_error(capsys, main(command))
        assert line == f"posteriorzoo {command[0]}: error: {path}: {expected}"
    assert path.read_bytes() == before  # nothing stored changed
    assert main(["--models", module, "verify", str(path)]) == 0


def test_an_entry_point_collection_names_the_package(folder, monkeypatch, capsys):
    module, model = write_plugin(folder)
    package = f"pz-plugin-package-{next(_NAMES)}"
    install_distribution(folder, package, module)
    monkeypatch.setattr(plugins, "_ENTRY_POINTS", None)
    path = small_collection(folder / "zoo.h5", model)
    forget(model)
    monkeypatch.setattr(plugins, "_ENTRY_POINTS", [])  # the package is uninstalled
    line = one_line_error(capsys, main(["info", str(path)]))
    assert line.endswith(f"unknown model '{model}': it was registered by the entry point "
                         f"'{module}' of the package '{package}'; install {package}, or load "
                         f"the module with --models {module}")


def test_a_collection_without_the_attribute_hints_at_models(folder, capsys):
    module, model = write_plugin(folder)
    load_models(module)
    path = small_collection(folder / "zoo.h5", model)
    with h5py.File(path, "r+") as handle:  # as written before collections recorded it
        del handle.attrs["model_module"]
    forget(model)
    line = one_line_error(capsys, main(["info", str(path)]))
    assert f"unknown model '{model}'; available models: mlp, mlp-bn, optunet" in line
    assert line.endswith("a model of your own is loaded with --models MODULE or "
                         "POSTERIORZOO_MODELS=MODULE (a module that calls "
                         "posteriorzoo.models.register)")


@pytest.mark.parametrize("attributes", [
    {"model_module": "x; rm -rf ~"}, {"model_module": "a\nb"}, {"model_module": "m" * 300},
    {"model_module": "ok", "model_package": "bad package\n"},
    {"model_package": "alone"}, {"model_module": np.int64(3)},
], ids=["shell", "newline", "long", "bad-package", "package-alone", "number"])
def test_a_crafted_model_module_attribute_is_refused(folder, capsys, attributes):
    path = small_collection(folder / "zoo.h5", "optunet")
    with h5py.File(path, "r+") as handle:
        handle.attrs.update(attributes)
    with pytest.raises(ZooFormatError, match="model_module|model_package"):
        open_zoo(path)
    line = one_line_error(capsys, main(["info", str(path)]))
    assert "model_" in line and "rm -rf" not in line.split("'")[0]


def test_derived_collections_keep_the_module(folder):
    from posteriorzoo.collection import canonicalize

    module, model = write_plugin(folder)
    load_models(module)
    source = small_collection(folder / "zoo.h5", model)
    canonicalize(source, folder / "canonical.h5", n_verify=2)
    with h5py.File(folder / "canonical.h5", "r") as handle:
        assert handle.attrs["model_module"] == module


# -------------------------------------------------------------------------- training


def plugin_spec(model: str, method: str = "de", **fields):
    from train_zoo.spec import make_spec

    return make_spec("optunet-mnist", dataset="digits", method=method,
                     recipe_overrides={"architecture": model, "epochs": 1,
                                       "crop_padding": 0, "batch_size": 128}, **fields)


def test_the_spec_needs_the_model_and_mc_dropout_its_option(folder):
    from train_zoo.spec import load_spec

    module, model = write_plugin(folder)
    spec = folder / "spec.toml"
    spec.write_text(f'recipe = "optunet-mnist"\ndataset = "digits"\n'
                    f'[recipe_overrides]\narchitecture = "{model}"\n')
    with pytest.raises(UnknownNameError, match=f"{spec}: unknown model '{model}'.*--models"):
        load_spec(spec)
    load_models(module)
    assert load_spec(spec).architecture == model
    no_dropout, other = write_plugin(folder, PLUGIN.replace(', "dropout": 0.0', "")
                                     .replace(", dropout)", ")").replace("nn.Dropout(dropout), ",
                                                                        ""))
    load_models(no_dropout)
    with pytest.raises(Exception, match=f"model '{other}' has no option 'dropout'"):
        plugin_spec(other, "mc-dropout", checkpoints=2)


def test_the_fast_engine_leaves_a_model_of_your_own_to_torch(folder):
    from posteriorzoo.errors import InvalidOptionError
    from train_zoo.job import resolve_engine

    module, model = write_plugin(folder)
    load_models(module)
    spec = plugin_spec(model, checkpoints=2)
    assert resolve_engine(spec, "auto") == "torch"
    with pytest.raises(InvalidOptionError, match="fast engine does not support"):
        resolve_engine(spec, "fast")


def test_train_in_worker_processes(folder, monkeypatch, capsys):
    """Two spawned workers (fresh interpreters) train a model of your own: they load the
    module the command loaded, and their checkpoints are those of this process."""
    from train_zoo.backends import SerialBackend
    from train_zoo.run import train_collection

    module, model = write_plugin(folder)
    spec = folder / "spec.toml"
    spec.write_text(textwrap.dedent(f'''\
        recipe = "optunet-mnist"
        dataset = "digits"
        method = "mc-dropout"
        modes = 2
        samples_per_mode = 2
        [recipe_overrides]
        architecture = "{model}"
        epochs = 1
        crop_padding = 0
        batch_size = 128
        '''))
    out = folder / "zoo.h5"
    code = main(["--models", module, "train", str(spec), "--out", str(out), "--workers", "2",
                 "--no-progress"])
    assert code == 0, capsys.readouterr().err
    with h5py.File(out, "r") as handle:
        assert handle.attrs["model_module"] == module
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in each worker: the same summation order
    try:
        from train_zoo import load_spec

        train_collection(load_spec(spec), folder / "serial.h5", backend=SerialBackend(),
                         progress=False)
    finally:
        torch.set_num_threads(threads)
    with open_zoo(out) as workers, open_zoo(folder / "serial.h5") as serial:
        assert len(workers) == 4
        assert sorted(workers.digests) == sorted(serial.digests)


def test_a_worker_finds_the_module_where_its_parent_did(folder):
    """A worker that does not share its parent's path (a Ray worker) gets the folder."""
    module, model = write_plugin(folder)
    load_models(module)
    needed = plugins.worker_plugins(model)
    assert needed.sources == (module,) and needed.folders == (str(folder.resolve()),)
    code = textwrap.dedent(f"""\
        import importlib.util, sys
        sys.path = [p for p in sys.path if p not in {[str(folder), str(folder.resolve())]!r}]
        from posteriorzoo.models.plugins import WorkerPlugins
        from train_zoo.backends.ray_backend import train_group
        from train_zoo.spec import make_spec
        assert importlib.util.find_spec({module!r}) is None  # not on this worker's path
        plugins = WorkerPlugins({needed.sources!r}, {needed.folders!r})
        plugins.load()
        spec = make_spec("optunet-mnist", dataset="digits", checkpoints=1,
                         recipe_overrides={{"architecture": {model!r}, "epochs": 1,
                                            "crop_padding": 0, "batch_size": 256}})
        [result] = train_group(spec, [0], "torch", plugins)  # loads nothing twice
        print(sorted(result.state))
        """)
    env = {**os.environ, "PYTHONPATH": str(ROOT), MODELS_VARIABLE: ""}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "['1.bias', '1.weight', '4.bias', '4.weight']"


def test_the_ray_backend_passes_the_plugins(folder, monkeypatch):
    from train_zoo.backends import ray_backend

    module, model = write_plugin(folder)
    load_models(module)
    passed = []

    class FakeRay:
        def is_initialized(self):
            return True

        def cluster_resources(self):
            return {"CPU": 1}

        def put(self, value):
            return value

        def remote(self, **options):
            class Task:
                @staticmethod
                def options(**resources):   # Ray's per-call resources (num_gpus)
                    return Task

                @staticmethod
                def remote(spec, group, engine, plugins=None, *rest):
                    passed.append(plugins)
                    return group

            return lambda function: Task

        def wait(self, refs, num_returns=1):
            return refs[:num_returns], refs[num_returns:]

        def get(self, ref):
            return ref

    monkeypatch.setattr(ray_backend, "import_ray", FakeRay)
    list(ray_backend.RayBackend().run(plugin_spec(model, checkpoints=2), [0, 1]))
    assert [p.sources for p in passed] == [(module,), (module,)]


#: A plugin whose factory breaks when PZ_TEST_BREAK says how: returns None, or raises.
BREAKABLE = '''\
import os

from torch import nn

from posteriorzoo.models import register


@register({model!r}, num_classes=10, input_shape=(1, 28, 28), description="test plugin",
          options={{"hidden": 8}})
def build(num_classes, hidden):
    if os.environ.get("PZ_TEST_BREAK") == "none":
        return None
    if os.environ.get("PZ_TEST_BREAK") == "raise":
        raise RuntimeError("no GPU kernel for this layer")
    return nn.Sequential(nn.Flatten(), nn.Linear(784, hidden), nn.ReLU(),
                         nn.Linear(hidden, num_classes))
'''
#: What each way of breaking says, after the model's name and its module.
BROKEN = {"none": "its factory returned None, not a torch.nn.Module",
          "raise": "could not be built: its factory raised RuntimeError: no GPU kernel for "
                   "this layer"}


def train_spec(folder: Path, model: str, modes: int = 2) -> Path:
    spec = folder / "spec.toml"
    spec.write_text(textwrap.dedent(f'''\
        recipe = "optunet-mnist"
        dataset = "digits"
        modes = {modes}
        [recipe_overrides]
        architecture = "{model}"
        epochs = 1
        crop_padding = 0
        batch_size = 128
        '''))
    return spec


def no_workers(monkeypatch) -> None:
    """Starting the worker pool fails the test: the model is checked before it starts."""
    from train_zoo.backends import local

    def refused(*_, **__):
        raise AssertionError("a worker started: the model was not checked before")

    monkeypatch.setattr(local.LocalBackend, "run", refused)


@pytest.mark.parametrize("how", sorted(BROKEN))
def test_a_factory_that_fails_is_one_line_before_any_worker(folder, monkeypatch, capsys,
                                                            how):
    """A factory returning None, or raising, was a traceback (from the workers when they
    were the first to build the model)."""
    from posteriorzoo.errors import ModelBuildError

    module, model = write_plugin(folder, BREAKABLE)
    spec = train_spec(folder, model)
    monkeypatch.setenv("PZ_TEST_BREAK", how)
    no_workers(monkeypatch)
    before = sorted(path.name for path in folder.iterdir())
    line = one_line_error(capsys, main(["--models", module, "train", str(spec), "--out",
                                        str(folder / "zoo.h5"), "--workers", "2",
                                        "--no-progress"]))
    assert f"model '{model}' (registered by module '{module}')" in line
    assert BROKEN[how] in line
    assert sorted(path.name for path in folder.iterdir() if path.name != "__pycache__") \
        == sorted(name for name in before if name != "__pycache__")  # no file, no partial
    with pytest.raises(ModelBuildError) as caught:
        build(model)
    assert str(caught.value).startswith(f"model '{model}' (registered by module '{module}')")
    assert BROKEN[how] in str(caught.value)


def test_resuming_with_a_factory_that_fails_is_one_line_before_any_worker(
        folder, monkeypatch, capsys):
    """An existing collection was resumed without building the model in this process:
    the workers were the first to fail."""
    from posteriorzoo.hashing import sha256_file

    module, model = write_plugin(folder, BREAKABLE)
    load_models(module)
    existing = small_collection(folder / "zoo.h5", model)
    digest = sha256_file(existing)
    spec = train_spec(folder, model, modes=5)
    monkeypatch.setenv("PZ_TEST_BREAK", "raise")
    no_workers(monkeypatch)
    line = one_line_error(capsys, main(["--models", module, "train", str(spec), "--out",
                                        str(existing), "--workers", "2", "--no-progress"]))
    assert f"model '{model}'" in line and BROKEN["raise"] in line
    assert sha256_file(existing) == digest
    assert not [path for path in folder.iterdir() if ".partial-" in path.name]


@pytest.mark.parametrize(("arguments", "refusal"), [
    ({"input_shape": (-1, 0)}, "input_shape (-1, 0) is refused: every dimension must be a "
                               "positive integer"),
    ({"input_shape": (1, 0, 28)}, "every dimension must be a positive integer"),
    ({"input_shape": (True, 28, 28)}, "every dimension must be a positive integer"),
    ({"input_shape": ()}, "an input shape is a non-empty tuple of positive integers"),
    ({"num_classes": 0}, "num_classes must be a positive integer or None, not 0"),
    ({"num_classes": -3}, "num_classes must be a positive integer or None, not -3"),
    ({"num_classes": True}, "num_classes must be a positive integer or None, not True"),
])
def test_register_refuses_a_bad_input_shape_or_num_classes(folder, arguments, refusal):
    from posteriorzoo.errors import InvalidOptionError

    options = {"num_classes": 10, "input_shape": (1, 28, 28), **arguments}
    with pytest.raises(InvalidOptionError) as caught:
        registry.register("pz-bad-registration", description="bad", **options)(
            lambda num_classes: torch.nn.Linear(784, num_classes))
    assert str(caught.value).startswith("model 'pz-bad-registration': ")
    assert refusal in str(caught.value)
    assert "pz-bad-registration" not in registry._REGISTRY


def test_a_plugin_declaring_a_bad_input_shape_is_one_line_before_training(folder,
                                                                          monkeypatch,
                                                                          capsys):
    module, model = write_plugin(folder, PLUGIN.replace("input_shape=(1, 28, 28)",
                                                        "input_shape=(-1, 0)"))
    spec = train_spec(folder, model)
    no_workers(monkeypatch)
    line = one_line_error(capsys, main(["--models", module, "train", str(spec), "--out",
                                        str(folder / "zoo.h5"), "--no-progress"]))
    assert f"--models {module}" in line
    assert f"model '{model}': input_shape (-1, 0) is refused" in line
    assert not (folder / "zoo.h5").exists()
    assert not [path for path in folder.iterdir() if ".partial-" in path.name]


def test_an_input_shape_function_giving_no_shape_names_the_model(folder):
    from posteriorzoo.errors import ModelBuildError
    from posteriorzoo.models import input_shape

    registry.register("pz-shape-rule", num_classes=10, input_shape=lambda options: (0, 28),
                      description="bad rule")(lambda num_classes: torch.nn.Linear(28, 10))
    with pytest.raises(ModelBuildError, match="model 'pz-shape-rule' .*: its input_shape "
                                              "function gave \\(0, 28\\): every dimension"):
        input_shape("pz-shape-rule")


# ------------------------------------------------------------------------ symmetries


def _pass_error(network: torch.nn.Module, inputs: torch.Tensor, relative: float = 0.0
                ) -> torch.Tensor:
    """How far (per example and class) the plugin MLP's float32 logits on ``inputs`` may
    lie from the exact function of weights within ``relative`` of ``network``'s own (an
    exact symmetric copy's, entry by entry): rounding_bounds.mlp_forward_bounds' analysis
    for one float32 pass (each Linear layer gamma(in + 1) of |W| |x| + |b|, carried through
    |W|; the LeakyReLU is 1-Lipschitz, whichever side of its kink) plus the weights'
    ``relative |W|`` carried the same way."""
    layers = [network[1], network[4]]
    delta = {f"layers.{i}.{name}": relative * value.detach().double().abs()
             for i, layer in enumerate(layers) for name, value in layer.named_parameters()}
    view = SimpleNamespace(layers=layers, training=False)
    return mlp_forward_bounds(view, inputs, delta, implementations=1).error


def test_a_leaky_relu_mlp_canonicalizes_to_the_same_function(folder):
    from posteriorzoo.symmetry import canonicalize, random_symmetry

    module, model = write_plugin(folder)
    load_models(module)
    torch.manual_seed(0)
    network = build(model, slope=0.3).eval()
    state = network.state_dict()
    moved = random_symmetry(model, state, seed=1, slope=0.3)
    assert not torch.allclose(moved["1.weight"], state["1.weight"])
    canonical = canonicalize(model, state, slope=0.3)
    again = canonicalize(model, moved, slope=0.3)
    assert canonical["1.weight"].dtype == torch.float32   # canonicalized in float32
    # How far each float32 state lies from an exact symmetric copy of ``state``, relative
    # to each entry: random_symmetry's factor power and two products (3 u; the output
    # biases' shift one rounding of the result); the float32 canonical form 2 gamma(R),
    # R = 800 its roundings (test_canonicalize_batch.canonical_roundings: the hidden
    # units' 785-entry rows + 4, the softmax shift's K + 1); the canonical form of
    # ``moved`` carries moved's 3 u to (2 L + 1) 3 u (L = 1 scale variable) plus 2 gamma(R).
    hidden_row = 784 + 1
    roundings = hidden_row + 4 + 10 + 1
    relative = {"moved": 3 * U32, "canonical": 2 * gamma(roundings),
                "again": 3 * 3 * U32 + 2 * gamma(roundings)}
    inputs = torch.randn(64, 1, 28, 28)
    with torch.no_grad():
        expected = network(inputs)
        error = _pass_error(network, inputs)
        for name, weights in (("moved", moved), ("canonical", canonical), ("again", again)):
            network.load_state_dict(weights)
            logits = network(inputs)
            # the same function, up to the softmax shift of the output biases: each pass
            # within its bound of the exact function, the centring doubles a row's largest
            # (the mean of the errors), and the test's own float32 differences, mean and
            # subtraction round by gamma(12) of the values. Bound 4.2e-3-1.5e-2 (logits up
            # to 1.9; the worst case over 784 inputs); measured 6e-7, at most 1.3e-4 of it.
            # A unit moved or scaled without its reader changes logits by O(0.1-1).
            shift = (logits - expected).mean(1, keepdim=True)
            both = error + _pass_error(network, inputs, relative[name])
            bound = (2 * both.max(1, keepdim=True).values
                     + gamma(12) * float(logits.abs().max() + expected.abs().max()
                                         + shift.abs().max()))
            assert ((logits - shift - expected).double().abs() <= bound).all(), name
    # canonical forms of a state and of its symmetric copy: 2 gamma(R) each side, plus
    # moved's error carried (9 u), of each tensor's largest entry; the output biases'
    # shift rounded in float32 (u of |b + shift|) becomes, centred, 2 u of moved's largest
    # bias, absolute. Bound 1.2e-5-7.3e-5; measured 1 ulp at most (8e-4 of the bound).
    rtol = 4 * gamma(roundings) + 3 * 3 * U32
    shifted = 2 * U32 * float(moved["4.bias"].abs().max())
    for key in state:
        difference = float((canonical[key] - again[key]).double().abs().max())
        assert difference <= rtol * float(canonical[key].abs().max()) + shifted, key
    # the LeakyReLU's positive scaling was removed: unit-norm incoming weights and bias,
    # each row divided by its float32 norm (785 squares summed, a root, a reciprocal, a
    # product: gamma(789)), whose norm this computes again (gamma(787)): 9.4e-5; measured
    # 6e-8. An unnormalized row is O(1) off.
    rows = torch.cat([canonical["1.weight"], canonical["1.bias"][:, None]], 1)
    assert float((rows.norm(dim=1) - 1).abs().max()) <= (gamma(hidden_row + 4)
                                                         + gamma(hidden_row + 2))


# ---------------------------------------------------------------------- the README


def readme_section() -> str:
    text = (ROOT / "README.md").read_text()
    return text.split("\n## Your own model\n", 1)[1].split("\n## ", 1)[0]


def code_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, re.S | re.M)


def readme_commands() -> list[str]:
    [block] = code_blocks(readme_section(), "sh")
    return [line for line in block.splitlines() if line.strip()]


def test_readme_example_matches_the_shipped_files():
    section = readme_section()
    source = (ROOT / "examples" / "my_models.py").read_text()
    [python] = code_blocks(section, "python")
    for excerpt in re.split(r"^ *\.\.\.\n", python, flags=re.M):  # "...": left out
        assert excerpt in source, excerpt
    spec = code_blocks(section, "toml")[0]
    assert spec == (ROOT / "examples" / "my-mlp-dropout.toml").read_text()
    parser = build_parser()
    for line in readme_commands():
        words = line.split("#")[0].split()
        if words[0] == "export":
            continue
        assert words[0] == "posteriorzoo"
        parser.parse_args(words[1:])  # exits on an option the command line does not have
        for word in words:
            if word.startswith("examples/"):
                assert (ROOT / word).is_file(), word
    message = registry.unknown_model_message("my-mlp", "my_models")
    assert f"my-target.h5: {message}" in " ".join(section.split())


def test_readme_example_runs(tmp_path):
    """The README's commands, exactly, in a fresh folder holding the repository's examples."""
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    env = {key: value for key, value in os.environ.items()
           if key not in (MODELS_VARIABLE, "PYTHONPATH")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    script = "set -e\n" + "\n".join(readme_commands()) + "\n"
    done = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "architecture  my-mlp" in done.stdout
    table = (tmp_path / "my-model-report" / "table1.csv").read_text()
    assert "MC-Dropout" in table
    with h5py.File(tmp_path / "my-dropout.h5", "r") as handle:  # my_models is not loaded here
        assert handle.attrs["method"] == "mc-dropout" and handle["committed"][0] == 8
        assert handle.attrs["model_module"] == "my_models"
