"""Models of your own: plugin modules that register architectures.

A plugin is a Python module that calls :func:`posteriorzoo.models.register` when it is
imported, or a callable (``"module:function"``) that does when it is called with no
arguments. Three ways make one known, to every command and to the trainer's worker
processes:

- **Installed packages** declare an entry point in the group ``posteriorzoo.models``
  (``pyproject.toml``: ``[project.entry-points."posteriorzoo.models"]``, ``my-models =
  "my_package.models"``). Entry points are loaded the first time a model name is not
  found among the registered ones (so commands that need no model of theirs never import
  them), or when every name is listed (:func:`~posteriorzoo.models.available_models`).
- **The environment variable** ``POSTERIORZOO_MODELS=module[,module...]``, loaded by the
  command line before the command runs, and in Python like the entry points.
- **The command line's global option** ``--models MODULE`` (repeatable or
  comma-separated, before the subcommand), or :func:`load_models` in Python. The command
  line looks for these modules in the current folder too.

Each plugin is loaded once per process. A plugin that cannot be imported (or whose
callable fails) raises :class:`ModelPluginError`, one line naming it. Every model keeps
the plugin that registered it (:attr:`~posteriorzoo.models.ModelEntry.module`), and a
collection of it records the plugin (file attributes ``model_module`` and, for entry
points, ``model_package``), so that a command meeting the collection without the plugin
says which module to load. The trainer's worker processes load the same plugins
(:func:`worker_plugins`).

>>> from posteriorzoo.models.plugins import load_models
>>> load_models("my_models")        # doctest: +SKIP
['my-mlp']
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import re
import sys
import traceback
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from posteriorzoo._api import public
from posteriorzoo.errors import PosteriorZooError
from posteriorzoo.models import registry

__all__ = [
    "ENTRY_POINT_GROUP",
    "ENVIRONMENT_VARIABLE",
    "ModelPluginError",
    "WorkerPlugins",
    "check_provider",
    "check_source",
    "is_source",
    "load_installed",
    "load_models",
    "loaded_sources",
    "parse_sources",
    "worker_plugins",
]

#: The entry-point group installed packages declare their models in.
ENTRY_POINT_GROUP = "posteriorzoo.models"
#: Plugin modules to load, comma-separated.
ENVIRONMENT_VARIABLE = "POSTERIORZOO_MODELS"
#: A plugin's name is a dotted module path, optionally ``:`` and a dotted attribute path;
#: a longer name than this is no module anyone wrote.
MAX_SOURCE_LENGTH = 200
_PART = r"[^\W\d]\w*"
_SOURCE = re.compile(rf"{_PART}(?:\.{_PART})*(?::{_PART}(?:\.{_PART})*)?")
#: A distribution's name (PEP 508).
_PACKAGE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?")


class ModelPluginError(PosteriorZooError, ImportError):
    """A plugin module could not be imported, or its registering callable failed."""


# Plugins loaded in this process, in order (what worker processes must load too).
_LOADED: list[str] = []
# The installed entry points, read once per process: (name, value, package).
_ENTRY_POINTS: list[tuple[str, str, str | None]] | None = None


def is_source(source: object) -> bool:
    """Whether ``source`` names a module, or a callable in one (see :func:`check_source`)."""
    return isinstance(source, str) and len(source) <= MAX_SOURCE_LENGTH \
        and _SOURCE.fullmatch(source) is not None


def check_source(source: object, where: str = "a model plugin") -> str:
    """``source`` if it names a module (``my_models``, ``my_package.models``) or a
    callable in one (``my_package.models:register``); else ModelPluginError."""
    if not is_source(source):
        shown = repr(source) if not isinstance(source, str) or len(source) <= 60 \
            else repr(source[:57] + "...")
        raise ModelPluginError(
            f"{where}: {shown} is not a module name (e.g. my_models, my_package.models or "
            "my_package.models:register; a file is named by its module, without .py)")
    return source


def check_provider(module: str | None, package: str | None) -> None:
    """Refuse a recorded provider (a collection's ``model_module`` and ``model_package``)
    that is not a module name and a package name, or a package without a module."""
    if module is not None:
        check_source(module, "attribute 'model_module'")
    if package is None:
        return
    if module is None:
        raise ModelPluginError("attribute 'model_package' without 'model_module'")
    if not isinstance(package, str) or len(package) > MAX_SOURCE_LENGTH \
            or not _PACKAGE.fullmatch(package):
        raise ModelPluginError("attribute 'model_package' is not a package name")


def parse_sources(values: str | Iterable[str], where: str = "a model plugin") -> list[str]:
    """Plugin names from comma-separated text or a list of such texts, checked, in order,
    each once. Empty items (``a,,b``, a trailing comma) are skipped."""
    texts = [values] if isinstance(values, str) else list(values)
    sources: list[str] = []
    for text in texts:
        if not isinstance(text, str):
            check_source(text, where)
        for item in text.split(","):
            item = item.strip()
            if item and check_source(item, where) not in sources:
                sources.append(item)
    return sources


#: The posteriorzoo package's folder: its frames are not the plugin's code.
_PACKAGE_FOLDER = str(Path(__file__).resolve().parents[1]) + os.sep


def _installed_code(filename: str) -> bool:
    """Whether ``filename`` belongs to Python, its libraries or posteriorzoo."""
    if filename.startswith(("<", _PACKAGE_FOLDER)):
        return True
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix}
    return "site-packages" in filename or any(
        filename.startswith(os.path.join(prefix, "lib")) for prefix in prefixes)


def _failure(error: BaseException) -> str:
    """One line for an exception raised inside a plugin, with the line of the plugin's
    code (else of any code) where it was raised."""
    text = " ".join(str(error).split()) or type(error).__name__
    if type(error) is not ModuleNotFoundError:
        text = f"{type(error).__name__}: {text}"
    frames = [frame for frame in traceback.extract_tb(error.__traceback__)
              if not frame.filename.startswith("<")]
    # A SyntaxError's message already says where: "invalid syntax (file.py, line 3)".
    if frames and not (isinstance(error, SyntaxError) and error.filename):
        own = [frame for frame in frames if not _installed_code(frame.filename)]
        frame = (own or frames)[-1]
        text += f" ({Path(frame.filename).name}, line {frame.lineno})"
    return text


def _import(module: str, label: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        missing = error.name or ""
        if missing == module or module.startswith(missing + "."):
            raise ModelPluginError(
                f"{label}: no module named {missing!r} (is it installed, or in the current "
                "folder or a folder on PYTHONPATH?)") from None
        raise ModelPluginError(f"{label}: importing it failed: {_failure(error)}") from None
    except Exception as error:
        raise ModelPluginError(f"{label}: importing it failed: {_failure(error)}") from None


def _load(source: str, label: str, package: str | None = None) -> None:
    """Import ``source``'s module (and call its callable) once, crediting what registers
    meanwhile to ``source``."""
    if source in _LOADED:
        return
    module_name, _, attribute = source.partition(":")
    with registry.providing(source, package):
        module = _import(module_name, label)
        if attribute:
            target: object = module
            for part in attribute.split("."):
                target = getattr(target, part, None)
                if target is None:
                    raise ModelPluginError(f"{label}: module {module_name!r} has no "
                                           f"attribute {attribute!r}")
            if not callable(target):
                raise ModelPluginError(f"{label}: {attribute!r} is not callable")
            try:
                target()
            except PosteriorZooError as error:
                raise ModelPluginError(f"{label}: {error}") from None
            except Exception as error:
                raise ModelPluginError(
                    f"{label}: calling {attribute} failed: {_failure(error)}") from None
    _LOADED.append(source)


@public
def load_models(sources: str | Iterable[str] = (), *, environment: bool = False,
                label: str = "model module") -> list[str]:
    """Load plugin modules; return the names of the models they registered now.

    Parameters
    ----------
    sources : str or iterable of str
        ``"my_models"``, ``"my_package.models:register"``, comma-separated or a list.
    environment : bool
        Load the modules of ``POSTERIORZOO_MODELS`` first (the command line does).
    label : str
        How messages name ``sources`` (the command line: ``--models``).

    Raises
    ------
    ModelPluginError
        A name that is not a module name, a module that cannot be imported, a callable
        that fails (one line naming the plugin and the first cause).
    """
    wanted = []
    if environment:
        wanted += [(source, f"{ENVIRONMENT_VARIABLE}: module {source!r}")
                   for source in _environment_sources()]
    wanted += [(source, f"{label} {source}") for source in parse_sources(sources, label)]
    before = set(registry._REGISTRY)
    for source, label in wanted:
        _load(source, label)
    return sorted(set(registry._REGISTRY) - before)


def _environment_sources() -> list[str]:
    return parse_sources(os.environ.get(ENVIRONMENT_VARIABLE, ""), ENVIRONMENT_VARIABLE)


def _entry_points() -> list[tuple[str, str, str | None]]:
    global _ENTRY_POINTS
    if _ENTRY_POINTS is None:
        found = []
        for point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            distribution = getattr(point, "dist", None)
            found.append((point.name, point.value.replace(" ", ""),
                          getattr(distribution, "name", None)))
        _ENTRY_POINTS = found
    return _ENTRY_POINTS


def load_installed() -> None:
    """Load every plugin of the entry-point group ``posteriorzoo.models`` and of
    ``POSTERIORZOO_MODELS`` that this process has not loaded yet.

    Raises ModelPluginError for one that cannot be loaded (it is tried again next time).
    """
    for name, value, package in _entry_points():
        owner = f" of the package {package!r}" if package else ""
        label = f"the entry point {name!r}{owner} in the group {ENTRY_POINT_GROUP}"
        _load(check_source(value, label), label, package)
    for source in _environment_sources():
        _load(source, f"{ENVIRONMENT_VARIABLE}: module {source!r}")


def loaded_sources() -> tuple[str, ...]:
    """The plugins loaded in this process so far, in order."""
    return tuple(_LOADED)


@dataclass(frozen=True)
class WorkerPlugins:
    """What a worker process loads to know the same models as the process that started
    it: the plugins, and the folders they were found in (added to the end of its
    ``sys.path`` when missing, as a worker need not share its parent's path)."""

    sources: tuple[str, ...] = ()
    folders: tuple[str, ...] = ()

    def load(self) -> None:
        """Load the plugins in this process (each once)."""
        for folder in self.folders:
            if folder not in sys.path:
                sys.path.append(folder)
        for source in self.sources:
            _load(source, f"model module {source!r} (in a worker process)")


def _search_folder(source: str) -> str | None:
    """The folder from which ``source``'s top-level package was imported, if any."""
    module_name = source.partition(":")[0]
    module = sys.modules.get(module_name)
    filename = getattr(module, "__file__", None)
    if not filename:
        return None
    path = Path(filename).resolve()
    levels = module_name.count(".") + (path.stem == "__init__")
    folder = path.parent
    for _ in range(levels):
        folder = folder.parent
    return str(folder)


def worker_plugins(architecture: str | None = None) -> WorkerPlugins:
    """The plugins a worker process needs: those loaded here, and the module that
    registered ``architecture`` (a model registered by importing its module directly)."""
    sources = list(_LOADED)
    if architecture is not None:
        entry = registry._REGISTRY.get(architecture)
        if entry is not None and entry.module is not None and entry.module not in sources:
            sources.append(entry.module)
    folders = []
    for source in sources:
        folder = _search_folder(source)
        if folder is not None and folder not in folders:
            folders.append(folder)
    return WorkerPlugins(tuple(sources), tuple(folders))


registry.set_installed_loader(load_installed)
