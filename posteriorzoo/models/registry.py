"""Name -> architecture registry.

Checkpoint collections record an architecture by name plus options (e.g.
``"resnet18"``, ``{"width": 64}``), so every network the library can rebuild
must be reachable through :func:`build` with exactly those arguments.

Models of your own are registered by modules (:mod:`posteriorzoo.models.plugins`); each
entry remembers the module that registered it (:attr:`ModelEntry.module`), which a
collection records so that a missing model can be named with the module to load.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from torch import nn

from posteriorzoo._api import public
from posteriorzoo.errors import (
    InvalidOptionError,
    ModelBuildError,
    PosteriorZooError,
    UnknownNameError,
)

__all__ = [
    "ModelEntry",
    "available_models",
    "build",
    "input_shape",
    "model_entry",
    "provider_attributes",
    "register",
    "resolve",
    "unknown_model_message",
]

Factory = Callable[..., nn.Module]
ShapeRule = Callable[[Mapping[str, Any]], tuple[int, ...]]


@dataclass(frozen=True)
class ModelEntry:
    """Everything the registry knows about one architecture.

    Attributes
    ----------
    name : str
        Registry key, e.g. ``"optunet"``.
    factory : callable
        ``factory(num_classes=..., **options) -> torch.nn.Module``.
    num_classes : int or None
        Default number of outputs; ``None`` when the options determine it
        (``mlp``: ``widths[-1]``).
    input_shape : tuple of int or callable
        Shape of one input example without the batch axis (``(C, H, W)`` for
        images, ``(D,)`` for vectors), or a function of the resolved options
        returning it.
    description : str
        One line for listings.
    options : Mapping[str, Any]
        Accepted option names and their defaults (read-only).
    module : str or None
        The plugin that registered it, as ``--models`` takes it (``"my_models"``, or
        ``"my_package.models:register"`` for a callable); None for the built-in models
        and for models registered from a script run as ``__main__`` (nothing could
        import it again).
    package : str or None
        The installed distribution whose entry point (group ``posteriorzoo.models``)
        named ``module``; None otherwise.
    """

    name: str
    factory: Factory
    num_classes: int | None
    input_shape: tuple[int, ...] | ShapeRule
    description: str
    options: Mapping[str, Any] = field(default_factory=dict)
    module: str | None = None
    package: str | None = None

    def __post_init__(self) -> None:
        # A shared mutable default would let one caller change another's defaults.
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))

    def shape_for(self, options: Mapping[str, Any]) -> tuple[int, ...]:
        """Input shape (no batch axis) for fully resolved ``options``.

        A shape function that fails or gives anything but positive integers raises
        :class:`ModelBuildError` naming the model (a plugin's code, run here).
        """
        if not callable(self.input_shape):
            return tuple(self.input_shape)
        try:
            shape = self.input_shape(options)
        except PosteriorZooError:
            raise
        except Exception as error:
            raise ModelBuildError(f"model {self.name!r}{self.provided_by()}: its input_shape "
                                  f"function raised {_one_line(error)}") from None
        problem = _shape_problem(shape)
        if problem:
            raise ModelBuildError(f"model {self.name!r}{self.provided_by()}: its input_shape "
                                  f"function gave {_shown(shape)}: {problem}")
        return tuple(int(d) for d in shape)

    def provided_by(self) -> str:
        """`` (registered by module 'my_models')``, or nothing for a built-in model."""
        return "" if self.module is None else f" (registered by module {self.module!r})"


#: Longest value a message about a registration shows.
_SHOW = 60


def _shown(value: object) -> str:
    text = " ".join(repr(value).split())
    return text if len(text) <= _SHOW else text[:_SHOW - 3] + "..."


def _one_line(error: BaseException) -> str:
    """``Type: message`` on one line."""
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _is_positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _shape_problem(shape: object) -> str | None:
    """Why ``shape`` is no input shape (None if it is one): a non-empty tuple of
    positive integers, ``(C, H, W)`` or ``(D,)``."""
    if not isinstance(shape, tuple | list) or not shape:
        return "an input shape is a non-empty tuple of positive integers, (C, H, W) or (D,)"
    if not all(_is_positive_int(d) for d in shape):
        return "every dimension must be a positive integer"
    return None


_REGISTRY: dict[str, ModelEntry] = {}
# Callbacks run whenever the registry changes, so derived caches never go stale.
_ON_CHANGE: list[Callable[[], None]] = []
# The plugin being loaded ((module, package), innermost last): what registers meanwhile
# was provided by it, whichever module defines the factory.
_PROVIDING: list[tuple[str, str | None]] = []
# Set while installed plugins load, so a lookup they make does not start loading again.
_LOADING_INSTALLED: list[bool] = []
# What loads the installed plugins: posteriorzoo.models.plugins sets it when imported (the
# registry does not import plugins, which imports the registry).
_INSTALLED_LOADERS: list[Callable[[], None]] = []
# A dotted module name, as posteriorzoo.models.plugins accepts (bounded: no regex blow-up).
_MODULE_NAME = re.compile(r"[^\W\d]\w*(?:\.[^\W\d]\w*)*")


def _is_module_name(name: object) -> bool:
    return isinstance(name, str) and len(name) <= 200 and _MODULE_NAME.fullmatch(name) is not None


def set_installed_loader(loader: Callable[[], None]) -> None:
    """Called once by :mod:`posteriorzoo.models.plugins`: how to load installed plugins."""
    _INSTALLED_LOADERS[:] = [loader]


@contextlib.contextmanager
def providing(module: str, package: str | None = None) -> Iterator[None]:
    """Attribute what is registered inside the block to the plugin ``module``
    (:mod:`posteriorzoo.models.plugins` wraps each plugin's import and call in it)."""
    _PROVIDING.append((module, package))
    try:
        yield
    finally:
        _PROVIDING.pop()


def _provider(factory: Factory) -> tuple[str | None, str | None]:
    """Which plugin registers ``factory`` now: the one being loaded (the innermost, as a
    plugin may load another), else the module defining the factory; nothing for the
    built-in models and ``__main__``."""
    if _PROVIDING:
        return _PROVIDING[-1]
    module = getattr(factory, "__module__", None)
    # A module loaded under a name no import could repeat (from a file path) is no plugin.
    if not _is_module_name(module) or module == "__main__" or module == "posteriorzoo" \
            or module.startswith("posteriorzoo."):
        return None, None
    return module, None


@public
def register(
    name: str,
    *,
    num_classes: int | None,
    input_shape: tuple[int, ...] | ShapeRule,
    description: str,
    options: Mapping[str, Any] | None = None,
    replace: bool = False,
) -> Callable[[Factory], Factory]:
    """Decorator adding a model factory to the registry under ``name``.

    Parameters
    ----------
    name : str
        Registry key.
    num_classes : int or None
        Default number of outputs (``None``: the factory derives it from options).
    input_shape : tuple of int or callable
        Input shape without batch axis, or ``f(options) -> shape``.
    description : str
        One-line description.
    options : Mapping[str, Any], optional
        Accepted options and their defaults. Anything else passed to
        :func:`build` is rejected.
    replace : bool, default False
        Allow overwriting an existing entry (otherwise ``ValueError``), so a
        typo cannot silently shadow a built-in architecture.

    Returns
    -------
    callable
        The decorator; it returns the factory unchanged.

    Raises
    ------
    InvalidOptionError
        When called: an ``input_shape`` that is not a non-empty tuple of positive
        integers, a ``num_classes`` that is neither a positive integer nor None. When
        decorating: a name already registered (without ``replace``). What the factory
        builds is checked by :func:`build` (:class:`ModelBuildError`).
    """

    # Refused when registered, in the process that loads the plugin: a worker process
    # would otherwise be the first to fail on them, with its traceback.
    if not name:
        raise InvalidOptionError("a model's name must not be empty")
    if num_classes is not None and not _is_positive_int(num_classes):
        raise InvalidOptionError(f"model {name!r}: num_classes must be a positive integer "
                                 f"or None, not {_shown(num_classes)}")
    if not callable(input_shape):
        problem = _shape_problem(input_shape)
        if problem:
            raise InvalidOptionError(f"model {name!r}: input_shape {_shown(input_shape)} is "
                                     f"refused: {problem}")

    def decorator(factory: Factory) -> Factory:
        if not callable(factory):
            raise InvalidOptionError(f"model {name!r}: register(...) decorates the "
                                     f"function that builds the model, not {_shown(factory)}")
        if name in _REGISTRY and not replace:
            raise InvalidOptionError(f"model {name!r} is already registered")
        module, package = _provider(factory)
        _REGISTRY[name] = ModelEntry(
            name=name,
            factory=factory,
            num_classes=num_classes,
            input_shape=input_shape,
            description=description,
            options=dict(options or {}),
            module=module,
            package=package,
        )
        for callback in _ON_CHANGE:
            callback()
        return factory

    return decorator


def _load_installed() -> None:
    """Load the installed plugins (entry points, ``POSTERIORZOO_MODELS``) not loaded yet."""
    if _LOADING_INSTALLED or not _INSTALLED_LOADERS:
        return
    _LOADING_INSTALLED.append(True)
    try:
        _INSTALLED_LOADERS[-1]()
    finally:
        _LOADING_INSTALLED.pop()


@public
def available_models() -> list[str]:
    """Sorted list of registered model names (installed plugins loaded first)."""
    _load_installed()
    return sorted(_REGISTRY)


def provider_attributes(name: str) -> dict[str, str]:
    """The file attributes that record which plugin provides the registered model
    ``name``: ``model_module`` (and ``model_package`` for an entry point's); empty for the
    built-in models and for names not registered."""
    entry = _REGISTRY.get(name) if isinstance(name, str) else None
    if entry is None or entry.module is None:
        return {}
    attributes = {"model_module": entry.module}
    if entry.package is not None:
        attributes["model_package"] = entry.package
    return attributes


def unknown_model_message(name: str, module: str | None = None,
                          package: str | None = None) -> str:
    """One line saying that model ``name`` is not registered, and how to get it.

    ``module`` and ``package``: the plugin a collection records as the model's provider
    (:attr:`ModelEntry.module`, :attr:`ModelEntry.package`).
    """
    if module is None:
        valid = ", ".join(sorted(_REGISTRY))
        return (f"unknown model {name!r}; available models: {valid}; a model of your own "
                "is loaded with --models MODULE or POSTERIORZOO_MODELS=MODULE (a module "
                "that calls posteriorzoo.models.register)")
    if package is None:
        return (f"unknown model {name!r}: it was registered by module {module!r}; load it "
                f"with --models {module} or POSTERIORZOO_MODELS={module}")
    return (f"unknown model {name!r}: it was registered by the entry point {module!r} of "
            f"the package {package!r}; install {package}, or load the module with "
            f"--models {module}")


@public
def model_entry(name: str, *, module: str | None = None,
                package: str | None = None) -> ModelEntry:
    """The :class:`ModelEntry` registered under ``name``.

    A name not registered yet loads the installed plugins first
    (:func:`posteriorzoo.models.plugins.load_installed`).

    Parameters
    ----------
    name : str
    module, package : str, optional
        Which plugin provided the model where it was recorded (a collection's
        ``model_module`` and ``model_package``): the error then names it.

    Raises
    ------
    UnknownNameError
        If ``name`` is not registered; the message lists the valid names and says how a
        model of your own is loaded (or which module provided this one).
    """
    if name not in _REGISTRY:
        _load_installed()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownNameError(unknown_model_message(name, module, package)) from None


def resolve(
    name: str, num_classes: int | None, options: Mapping[str, Any]
) -> tuple[ModelEntry, int | None, dict[str, Any]]:
    """Validate option names and fill in defaults.

    Returns
    -------
    spec : ModelEntry
    num_classes : int or None
        ``num_classes`` or the spec's default.
    options : dict
        The spec's defaults updated with ``options``.

    Raises
    ------
    UnknownNameError
        For an unknown model or option name (the message lists the valid ones).
    """
    spec = model_entry(name)
    unknown = [key for key in options if key not in spec.options]
    if unknown:
        valid = ", ".join(sorted(spec.options)) or "(none)"
        raise UnknownNameError(
            f"unknown option {unknown[0]!r} for model {name!r}; valid options: {valid}"
        )
    merged = {**spec.options, **options}
    return spec, (spec.num_classes if num_classes is None else num_classes), merged


@public
def build(name: str, num_classes: int | None = None, **options: Any) -> nn.Module:
    """Instantiate a registered architecture with freshly initialised weights.

    Initialisation draws from torch's global generator, so it is reproducible
    under :func:`torch.manual_seed`; wrap the call in ``with torch.device(...)``
    to allocate elsewhere (``"meta"`` allocates nothing).

    Parameters
    ----------
    name : str
        Registered model name (see :func:`available_models`).
    num_classes : int, optional
        Number of outputs; defaults to the spec's ``num_classes``.
    **options
        Architecture options accepted by this model (see ``model_entry(name).options``).

    Returns
    -------
    torch.nn.Module
        Maps a batch of shape ``(N, *input_shape(name, **options))`` to
        logits of shape ``(N, num_classes)``.

    Raises
    ------
    UnknownNameError
        Unknown model name or option name.
    ModelBuildError
        The factory raised an error that is not a :class:`PosteriorZooError` (which passes
        unchanged: a factory's own refusal of an option), or returned something that is
        not a ``torch.nn.Module``: one line naming the model and its plugin.
    """
    spec, n_out, merged = resolve(name, num_classes, options)
    try:
        model = spec.factory(num_classes=n_out, **merged)
    except PosteriorZooError:
        raise
    except Exception as error:
        given = f" with options {_shown(dict(options))}" if options else ""
        raise ModelBuildError(f"model {name!r}{spec.provided_by()}{given} could not be "
                              f"built: its factory raised {_one_line(error)}") from None
    if not isinstance(model, nn.Module):
        raise ModelBuildError(f"model {name!r}{spec.provided_by()}: its factory returned "
                              f"{_shown(model)}, not a torch.nn.Module")
    return model


@public
def input_shape(name: str, **options: Any) -> tuple[int, ...]:
    """Shape of one input example (no batch axis) for ``name`` built with ``options``.

    Returns
    -------
    tuple of int
        ``(C, H, W)`` for image models, ``(D,)`` for ``mlp``.

    Raises
    ------
    UnknownNameError
        Unknown model name or option name.
    """
    spec, _, merged = resolve(name, None, options)
    return spec.shape_for(merged)
