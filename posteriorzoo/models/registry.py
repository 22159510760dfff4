"""Name -> architecture registry.

Checkpoint collections record an architecture by name plus options (e.g.
``"resnet18"``, ``{"width": 64}``), so every network the library can rebuild
must be reachable through :func:`build` with exactly those arguments.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from torch import nn

from posteriorzoo._api import public
from posteriorzoo.errors import InvalidOptionError, UnknownNameError

__all__ = [
    "ModelEntry",
    "available_models",
    "build",
    "input_shape",
    "model_entry",
    "register",
    "resolve",
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
    """

    name: str
    factory: Factory
    num_classes: int | None
    input_shape: tuple[int, ...] | ShapeRule
    description: str
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # A shared mutable default would let one caller change another's defaults.
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))

    def shape_for(self, options: Mapping[str, Any]) -> tuple[int, ...]:
        """Input shape (no batch axis) for fully resolved ``options``."""
        if callable(self.input_shape):
            return tuple(int(d) for d in self.input_shape(options))
        return tuple(self.input_shape)


_REGISTRY: dict[str, ModelEntry] = {}
# Callbacks run whenever the registry changes, so derived caches never go stale.
_ON_CHANGE: list[Callable[[], None]] = []


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
    """

    def decorator(factory: Factory) -> Factory:
        if name in _REGISTRY and not replace:
            raise InvalidOptionError(f"model {name!r} is already registered")
        _REGISTRY[name] = ModelEntry(
            name=name,
            factory=factory,
            num_classes=num_classes,
            input_shape=input_shape,
            description=description,
            options=dict(options or {}),
        )
        for callback in _ON_CHANGE:
            callback()
        return factory

    return decorator


@public
def available_models() -> list[str]:
    """Sorted list of registered model names."""
    return sorted(_REGISTRY)


@public
def model_entry(name: str) -> ModelEntry:
    """The :class:`ModelEntry` registered under ``name``.

    Raises
    ------
    UnknownNameError
        If ``name`` is not registered; the message lists the valid names.
    """
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        valid = ", ".join(available_models())
        raise UnknownNameError(f"unknown model {name!r}; available models: {valid}") from None


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
    """
    spec, n_out, merged = resolve(name, num_classes, options)
    return spec.factory(num_classes=n_out, **merged)


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
