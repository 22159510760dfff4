"""Pieces every method shares: functional evaluation, the loss, flat parameter vectors."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from torch.func import functional_call

Params = dict[str, torch.Tensor]


def parameters_of(model: nn.Module) -> tuple[Params, Params]:
    """``(params, buffers)``: detached copies of the module's parameters and buffers."""
    params = {name: value.detach().clone() for name, value in model.named_parameters()}
    buffers = {name: value.detach().clone() for name, value in model.named_buffers()}
    return params, buffers


def untrained_parameters(model: nn.Module, method: str, architecture: str
                         ) -> tuple[Params, Params]:
    """:func:`parameters_of` an untrained network, for a method that trains from the
    initialisation (cyclical SG-MCMC, IVON, SVGD). A network with buffers (BatchNorm's
    running statistics) is refused: its samples would carry the initialisation's
    statistics, and re-estimating them at every sample is not done yet."""
    from posteriorzoo.errors import InvalidOptionError

    params, buffers = parameters_of(model)
    if buffers:
        raise InvalidOptionError(f"{method}: {architecture} has BatchNorm buffers, which "
                                 "its samples would carry from the initialisation; not "
                                 "supported yet")
    return params, buffers


def logits(model: nn.Module, params: Mapping[str, torch.Tensor],
           buffers: Mapping[str, torch.Tensor], images: torch.Tensor) -> torch.Tensor:
    """The network's logits ``(B, K)`` at ``params`` (the module's own weights unused)."""
    return functional_call(model, ({**params}, {**buffers}), (images,))


def mean_nll(model: nn.Module, params: Mapping[str, torch.Tensor],
             buffers: Mapping[str, torch.Tensor], batch: tuple[torch.Tensor, torch.Tensor]
             ) -> torch.Tensor:
    """Mean cross-entropy of the batch, in nats per example."""
    images, labels = batch
    return nn.functional.cross_entropy(logits(model, params, buffers, images), labels)


def flatten(params: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """All parameters as one vector, in the mapping's order."""
    return torch.cat([value.reshape(-1) for value in params.values()])


def unflatten(vector: torch.Tensor, like: Mapping[str, torch.Tensor]) -> Params:
    """The inverse of :func:`flatten`: ``vector`` cut into tensors shaped like ``like``."""
    result, start = {}, 0
    for name, value in like.items():
        size = value.numel()
        result[name] = vector[start:start + size].reshape(value.shape).to(value.dtype)
        start += size
    if start != vector.numel():
        raise ValueError(f"vector has {vector.numel()} values, the parameters {start}")
    return result


def state_dict_of(model: nn.Module, params: Mapping[str, torch.Tensor],
                  buffers: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state_dict of the base architecture holding ``params`` and ``buffers``, in the
    module's own key order and dtypes."""
    values = {**params, **buffers}
    return {key: values[key].detach().to(reference.dtype).clone()
            for key, reference in model.state_dict().items()}
