"""Last-layer MC Dropout, with each sample folded into a checkpoint of the base network.

The base network is trained with dropout of probability ``p`` on the input of its last
``Linear`` layer (``build("optunet", dropout=0.2)``; the paper's ResNet-18 uses 0.5). At
test time MC Dropout draws one Bernoulli mask per forward pass. With the mask shared by the
whole batch (one mask per *sample*, not per input), dropout of the features followed by the
linear layer is itself a linear layer::

    fc(x * m / (1 - p)) = (W * (m / (1 - p))[None, :]) x + b,   m_j ~ Bernoulli(1 - p)

so a sample is the trained state_dict with the last layer's weight column ``j`` multiplied
by ``m_j / (1 - p)`` and the bias unchanged. Dropout has no parameters, so the sample loads
into the base architecture built *without* dropout (same keys) and is an ordinary
checkpoint for the canonicalizer, the MMD engine and the metrics.

>>> import torch
>>> from posteriorzoo.models import build
>>> model = build("optunet", dropout=0.2)
>>> draws = sample(model, model.state_dict(), 0.2, torch.Generator().manual_seed(0), 3)
>>> build("optunet").load_state_dict(draws[0])
<All keys matched successfully>
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch import nn

from posteriorzoo.errors import InvalidOptionError
from posteriorzoo.options import check_integer, check_number
from train_zoo.methods.base import (
    Context,
    Method,
    ModeRun,
    Posterior,
    Resolved,
    declared_options,
)

__all__ = ["apply_mask", "draw_masks", "last_linear", "sample"]


def _check_p(p: object) -> float:
    return float(check_number("dropout option 'p'", p, 0, maximum=1, strict_maximum=True))


def _check_count(count: object) -> int:
    return check_integer("dropout option 'count'", count, 1)


def last_linear(model: nn.Module) -> str:
    """Name of the ``Linear`` module that produces the network's output.

    Found by symbolic tracing (:mod:`torch.fx`), so the answer follows the forward pass,
    not the order of attribute definition: ``"fc"`` for OptuNet and ResNet-18, ``"fc2"``
    for OptuNet v1, ``"layers.<n>"`` for the MLP.

    Parameters
    ----------
    model : torch.nn.Module
        The base network (with or without its dropout).

    Returns
    -------
    str
        A name from ``model.named_modules()``.

    Raises
    ------
    InvalidOptionError
        If the network cannot be traced or its output is not a ``Linear`` layer's output
        (then pass ``layer`` to :func:`sample` explicitly).
    """
    try:
        graph = torch.fx.symbolic_trace(model).graph
    except Exception as error:  # fx raises many types for untraceable control flow
        raise InvalidOptionError(f"dropout option 'layer' is needed: the network cannot be "
                                 f"traced ({type(error).__name__})") from None
    modules = dict(model.named_modules())
    output = next(node for node in graph.nodes if node.op == "output")
    producer = output.args[0]
    if (isinstance(producer, torch.fx.Node) and producer.op == "call_module"
            and isinstance(modules.get(str(producer.target)), nn.Linear)):
        return str(producer.target)
    raise InvalidOptionError("dropout option 'layer' is needed: the network's output is not "
                             "produced by a Linear layer")


def _linear(model: nn.Module, layer: str | None) -> tuple[str, nn.Linear]:
    if layer is None:
        layer = last_linear(model)
    module = dict(model.named_modules()).get(layer) if isinstance(layer, str) else None
    if not isinstance(module, nn.Linear):
        raise InvalidOptionError(f"dropout option 'layer' must name a Linear module of the "
                                 f"network, not {layer!r}")
    return layer, module


def draw_masks(in_features: int, p: float, generator: torch.Generator, count: int
               ) -> torch.Tensor:
    """``count`` independent keep-masks of the last layer's inputs.

    Parameters
    ----------
    in_features : int
        Width ``F`` of the last layer's input.
    p : float
        Dropout probability in ``[0, 1)``.
    generator : torch.Generator
        The only source of randomness (its device is the masks' device).
    count : int
        Number of masks ``S``.

    Returns
    -------
    torch.Tensor
        Float64 ``(S, F)`` of zeros and ones, ``m_j ~ Bernoulli(1 - p)`` independently
        (a 1 keeps feature ``j``).
    """
    p = _check_p(p)
    count = _check_count(count)
    keep = torch.full((count, in_features), 1.0 - p, dtype=torch.float64,
                      device=generator.device)
    return torch.bernoulli(keep, generator=generator)


def apply_mask(state_dict: Mapping[str, torch.Tensor], layer: str, mask: torch.Tensor,
               p: float) -> dict[str, torch.Tensor]:
    """``state_dict`` with one dropout mask folded into ``layer``'s weight.

    Parameters
    ----------
    state_dict : Mapping[str, torch.Tensor]
        A checkpoint of the base network; ``state_dict[layer + ".weight"]`` is
        ``(out_features, F)``.
    layer : str
        Name of the last ``Linear`` module.
    mask : torch.Tensor
        ``(F,)`` keep-mask of zeros and ones.
    p : float
        Dropout probability in ``[0, 1)``.

    Returns
    -------
    dict[str, torch.Tensor]
        A new state_dict (same keys, order and dtypes; tensors cloned) whose weight column
        ``j`` is multiplied by ``mask[j] / (1 - p)``; the bias is unchanged.
    """
    p = _check_p(p)
    key = f"{layer}.weight"
    result = {name: value.detach().clone() for name, value in state_dict.items()}
    weight = result[key]
    factor = (mask.to(torch.float64) / (1.0 - p)).to(device=weight.device)
    result[key] = (weight.to(torch.float64) * factor[None, :]).to(weight.dtype)
    return result


def sample(model: nn.Module, state_dict: Mapping[str, torch.Tensor], p: float,
           generator: torch.Generator, count: int, layer: str | None = None
           ) -> list[dict[str, torch.Tensor]]:
    """``count`` MC Dropout samples of one trained network, as base-architecture checkpoints.

    Parameters
    ----------
    model : torch.nn.Module
        The network's architecture (with or without its dropout module; its own weights are
        not used). It locates the last layer.
    state_dict : Mapping[str, torch.Tensor]
        The trained weights: the keys of ``model.state_dict()``.
    p : float
        The dropout probability the network was trained with, in ``[0, 1)``.
    generator : torch.Generator
        The only source of randomness; the masks are drawn in one call, so a sample's mask
        is row ``s`` of ``draw_masks(F, p, generator, count)`` from the same generator state.
    count : int
        Number of samples ``S`` (>= 1).
    layer : str, optional
        Name of the last ``Linear`` module; found by tracing (:func:`last_linear`) if
        omitted.

    Returns
    -------
    list of dict[str, torch.Tensor]
        ``S`` state_dicts with the keys, order and dtypes of ``model.state_dict()``; they load
        into the architecture built without dropout.

    Raises
    ------
    InvalidOptionError
        Bad ``p``, ``count`` or ``layer``, or a ``state_dict`` whose keys differ from the
        model's.
    """
    p = _check_p(p)
    count = _check_count(count)
    name, module = _linear(model, layer)
    expected = list(model.state_dict())
    if sorted(state_dict) != sorted(expected):
        missing = sorted(set(expected) - set(state_dict)) or sorted(set(state_dict) - set(expected))
        raise InvalidOptionError(f"dropout option 'state_dict' does not match the network "
                                 f"(first differing key: {missing[0]!r})")
    ordered = {key: state_dict[key] for key in expected}
    masks = draw_masks(module.in_features, p, generator, count)
    return [apply_mask(ordered, name, mask, p) for mask in masks]


# ---------------------------------------------------------------- the method
def _p_default(context: Context) -> Resolved:
    resnet = context.architecture.startswith("resnet")
    return Resolved(0.5 if resnet else 0.2, "derived from the architecture (ResNets 0.5, "
                                            "others 0.2)")


@dataclass(frozen=True)
class DropoutPosterior:
    """The trained base network (with its dropout layer) and the dropout probability."""

    model: nn.Module
    p: float


class McDropout(Method):
    """MC Dropout: the base network trains with a dropout layer before its last layer;
    a sample is the trained weights with one dropout mask folded into that layer."""

    name = "mc-dropout"
    summary = "MC Dropout: dropout masks on the last layer of a base network trained with it"
    options = declared_options("mc-dropout", defaults={"p": _p_default})

    def check_model(self, architecture: str, model_options: Mapping[str, Any],
                    model_option_names: Any) -> None:
        if "dropout" in model_options:
            raise InvalidOptionError("MC Dropout's probability is the method option 'p'; "
                                     "model_options describe the stored base architecture")
        if "dropout" not in model_option_names:
            raise InvalidOptionError(
                f"mc-dropout trains the base network with dropout, but model "
                f"{architecture!r} has no option 'dropout': register it with the option "
                "dropout = 0.0 (the probability of a dropout layer before its last Linear "
                "layer)")

    def training_model_options(self, model_options: Mapping[str, Any],
                               method_options: Mapping[str, Any]) -> dict[str, Any]:
        """The stored architecture's options plus the dropout layer."""
        return {**model_options, "dropout": method_options["p"]}

    def fit(self, run: ModeRun) -> Posterior:
        model, steps = run.engine.train_base()
        return Posterior(DropoutPosterior(model, run.spec.method_options["p"]), steps,
                         run.engine.name)

    def sample(self, state: DropoutPosterior, generator: torch.Generator, count: int
               ) -> list[dict[str, torch.Tensor]]:
        return sample(state.model, state.model.state_dict(), state.p, generator, count)


METHOD = McDropout()
