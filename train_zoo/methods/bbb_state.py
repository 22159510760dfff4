"""Bayes by Backprop's variational state: the mean-field Gaussian, its start and its draws.

:class:`BBBState` (``mu`` and ``rho`` per parameter, with the optimisers' buffers,
:class:`OptimizerState`), :class:`BBBGrads`, :func:`layer_kinds` (which parameters are
variational, from the module that owns them), :func:`init`, :func:`draw_noise` (the one
draw order both engines use), :func:`sample_weights`, :func:`sample` (state_dicts of the
base architecture) and :func:`variance_record`. The state is what every other piece of
the method reads or returns (the loss in :mod:`~train_zoo.methods.bbb_elbo`, the step in
:mod:`~train_zoo.methods.bbb_update`, the numba path in :mod:`train_zoo.fast.bbb`), so it
stands apart from all of them. The method and the module docstring that states the
model are in :mod:`train_zoo.methods.bbb`, which re-exports every name here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from posteriorzoo.options import check_integer
from train_zoo.methods.bbb_options import BBBOptions
from train_zoo.methods.common import Params, state_dict_of

__all__ = [
    "CONV_TYPES",
    "LINEAR_TYPES",
    "BBBGrads",
    "BBBState",
    "OptimizerState",
    "draw_noise",
    "init",
    "layer_kinds",
    "sample",
    "sample_weights",
    "variance_record",
]

#: Modules whose parameters are variational with the Linear initialisation.
LINEAR_TYPES: tuple[type[nn.Module], ...] = (nn.Linear, nn.Bilinear)
#: Modules whose parameters are variational with the Conv initialisation.
CONV_TYPES: tuple[type[nn.Module], ...] = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d,
                                           nn.ConvTranspose2d, nn.ConvTranspose3d)


@dataclass(frozen=True)
class BBBGrads:
    """Gradients (or an optimiser's buffers) for the means and the ``rho`` of a state.

    Attributes
    ----------
    mu : dict of str to tensor
        One entry per parameter, shaped like it.
    rho : dict of str to tensor
        One entry per variational parameter.
    """

    mu: Params
    rho: Params


@dataclass(frozen=True)
class OptimizerState:
    """An optimiser's buffers for one group of tensors (the means, or ``rho``), as
    ``torch.optim`` keeps them.

    Attributes
    ----------
    kind : {"sgd", "adam"}
    steps : int
        Updates taken (Adam's bias correction).
    first : dict of str to tensor
        SGD's momentum buffers, or Adam's first moments (``exp_avg``).
    second : dict of str to tensor or None
        Adam's second moments (``exp_avg_sq``); None for SGD.
    """

    kind: str
    steps: int
    first: Params
    second: Params | None = None


@dataclass(frozen=True)
class BBBState:
    """A mean-field Gaussian over a network's parameters.

    Attributes
    ----------
    mu : dict of str to tensor
        Means of every parameter, keyed and ordered like ``model.named_parameters()``,
        in the parameters' dtype. For point estimates, the value itself.
    rho : dict of str to tensor
        ``sigma = softplus(rho)`` of the variational parameters (Linear and Conv layers),
        a subset of ``mu``'s keys in the same order.
    options : BBBOptions
    mu_buffers, rho_buffers : OptimizerState or None
        The optimisers' buffers of the means and of ``rho`` (None before the first step,
        and with SGD without momentum).
    """

    mu: Params
    rho: Params
    options: BBBOptions
    mu_buffers: OptimizerState | None = None
    rho_buffers: OptimizerState | None = None

    @property
    def momentum(self) -> BBBGrads | None:
        """SGD's momentum buffers when both groups are trained by SGD with momentum, else
        None."""
        mu, rho = self.mu_buffers, self.rho_buffers
        if mu is None or rho is None or mu.kind != "sgd" or rho.kind != "sgd":
            return None
        return BBBGrads(mu=mu.first, rho=rho.first)

    @property
    def sigma(self) -> Params:
        """``softplus(rho)`` of the variational parameters."""
        return {name: nn.functional.softplus(rho) for name, rho in self.rho.items()}


def layer_kinds(model: nn.Module) -> dict[str, str]:
    """``{parameter name: "linear" | "conv" | "point"}`` in ``named_parameters`` order,
    from the type of the module that owns each parameter (:data:`LINEAR_TYPES`,
    :data:`CONV_TYPES`; anything else is a point estimate)."""
    owners: dict[str, str] = {}
    for prefix, module in model.named_modules():
        kind = ("linear" if isinstance(module, LINEAR_TYPES)
                else "conv" if isinstance(module, CONV_TYPES) else "point")
        for name, _ in module.named_parameters(recurse=False):
            owners[f"{prefix}.{name}" if prefix else name] = kind
    return {name: owners[name] for name, _ in model.named_parameters()}


def init(model: nn.Module, generator: torch.Generator, **options: Any) -> BBBState:
    """The initial variational state of ``model``.

    Parameters
    ----------
    model : nn.Module
        The base architecture (its weights are used only with ``mean_init="model"`` and for
        the point estimates).
    generator : torch.Generator
        Source of the initial draws: for each variational parameter in order, its means
        (``mean_init="random"``) then its ``rho``.
    **options
        :class:`BBBOptions` fields (``prior_sigma=0.1``, ``elbo_samples=3``, ...).

    Returns
    -------
    BBBState
        Tensors shaped, typed and placed like the model's parameters; ``momentum`` None.
    """
    opts = BBBOptions(**options)
    kinds = layer_kinds(model)
    mu, rho = {}, {}
    for name, parameter in model.named_parameters():
        value = parameter.detach()
        if kinds[name] == "point":
            mu[name] = value.clone()
            continue
        if opts.mean_init == "random":
            mu[name] = opts.mean_std * torch.randn(value.shape, generator=generator,
                                                   dtype=value.dtype, device=value.device)
        else:
            mu[name] = value.clone()
        centre = opts.rho_linear if kinds[name] == "linear" else opts.rho_conv
        rho[name] = centre + opts.rho_std * torch.randn(value.shape, generator=generator,
                                                        dtype=value.dtype, device=value.device)
    return BBBState(mu=mu, rho=rho, options=opts)


def draw_noise(like: Mapping[str, Tensor], generator: torch.Generator, count: int
               ) -> list[Params]:
    """``count`` standard normal draws ``eps`` shaped like ``like`` (a state's ``rho``).

    The draw order (sample by sample, parameters in order, one ``torch.randn`` each) is
    the one both engines use, so one generator gives both the same noise.
    """
    return [{name: torch.randn(value.shape, generator=generator, dtype=value.dtype,
                               device=value.device) for name, value in like.items()}
            for _ in range(count)]


def _weights(mu: Mapping[str, Tensor], sigma: Mapping[str, Tensor],
             eps: Mapping[str, Tensor]) -> Params:
    """``mu + sigma * eps`` for the variational parameters, ``mu`` for the others."""
    return {name: mu[name] + sigma[name] * eps[name] if name in sigma else mu[name]
            for name in mu}


def sample_weights(state: BBBState, noise: Mapping[str, Tensor]) -> Params:
    """The parameters ``mu + softplus(rho) * noise`` (point estimates: ``mu``)."""
    return _weights(state.mu, state.sigma, noise)


def variance_record(start: BBBState, end: BBBState) -> dict[str, dict[str, float]]:
    """How ``sigma`` moved between two states of one run, per variational parameter.

    Returns
    -------
    dict
        ``{name: {"sigma_median_start", "sigma_median_end", "rho_max_change"}}`` in the
        state's order: the median ``sigma`` of the tensor in each state and the largest
        ``|rho_end - rho_start|`` over its entries (plain floats, JSON-able).
    """
    def median(values: Tensor) -> float:  # the midpoint for an even count, as numpy's
        return float(torch.quantile(values.detach().reshape(-1).double(), 0.5))

    record = {}
    start_sigma, end_sigma = start.sigma, end.sigma
    for name, rho in start.rho.items():
        record[name] = {
            "sigma_median_start": median(start_sigma[name]),
            "sigma_median_end": median(end_sigma[name]),
            "rho_max_change": float((end.rho[name] - rho).abs().max()),
        }
    return record


def sample(model: nn.Module, state: BBBState, generator: torch.Generator, count: int,
           buffers: Mapping[str, Tensor] | None = None) -> list[dict[str, Tensor]]:
    """``count`` draws from ``q``: state_dicts of the base architecture.

    Parameters
    ----------
    model : nn.Module
        The base architecture (key order and dtypes of the result).
    state : BBBState
    generator : torch.Generator
        Source of the noise (:func:`draw_noise`, one draw per sample).
    count : int
        Number of samples.
    buffers : dict of str to tensor, optional
        Buffers to store with every sample (default: the model's own).

    Returns
    -------
    list of dict of str to tensor
        ``mu + softplus(rho) * eps`` (point estimates: ``mu``) with the buffers; each loads
        with ``model.load_state_dict``.
    """
    check_integer("count", count, 0)
    if buffers is None:
        buffers = {name: value.detach() for name, value in model.named_buffers()}
    sigma = state.sigma
    return [state_dict_of(model, _weights(state.mu, sigma, eps), buffers)
            for eps in draw_noise(state.rho, generator, count)]
