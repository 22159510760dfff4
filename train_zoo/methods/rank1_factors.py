"""Rank-1 BNNs' factors: the layers that carry them, the state, draws, forward pass and folds.

Everything about the random factors ``(r, s)`` and the network that computes with them
(the model is written out in :mod:`train_zoo.methods.rank1`'s docstring):
:func:`rank1_layers` (which Conv2d and Linear layers get factors), :class:`Rank1State`
and :func:`init`; :func:`draw_noise` and :func:`draw` (one ``(r, s)`` per example, in the
draw order every engine shares); :func:`forward`, :func:`logits` and
:func:`mixture_log_likelihood` (the base architecture under ``torch.func.functional_call``
with a hook pair on each rank-1 layer); :func:`fold`, :func:`component_params`,
:func:`point_estimates` and :func:`sample` (a draw folded exactly into plain weights).
It is apart from the training objective (:mod:`~train_zoo.methods.rank1_training`), which
builds on these pieces, and from the method and its stepper
(:mod:`train_zoo.methods.rank1`), which re-exports every public name here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.func import functional_call

from posteriorzoo.errors import InvalidOptionError, ShapeMismatchError
from posteriorzoo.options import check_integer, show
from train_zoo.methods.common import Params, state_dict_of
from train_zoo.methods.rank1_options import Rank1Options

__all__ = [
    "RANK1_TYPES",
    "RHO_SPREAD",
    "Draw",
    "Rank1State",
    "component_params",
    "draw",
    "draw_noise",
    "fold",
    "forward",
    "init",
    "logits",
    "mixture_log_likelihood",
    "point_estimates",
    "rank1_layers",
    "sample",
]

#: Layers that can carry rank-1 factors (their weight's axis 0 is the output, axis 1 the
#: input per group).
RANK1_TYPES: tuple[type[nn.Module], ...] = (nn.Linear, nn.Conv2d)
#: Standard deviation of the initial ``rho`` around ``softplus^-1(init_std)`` (Gaussian
#: components), cut at two of it, as a TensorFlow ``TruncatedNormal(stddev=0.1)``.
RHO_SPREAD = 0.1


# ------------------------------------------------------------------------- layers
def _key(layer: str, tensor: str) -> str:
    """The parameter name of ``tensor`` (``weight``, ``bias``) of module ``layer``."""
    return f"{layer}.{tensor}" if layer else tensor


def _sizes(module: nn.Module) -> tuple[int, int]:
    """``(outputs, inputs)`` of a rank-1 layer: the lengths of ``r`` and ``s``."""
    if isinstance(module, nn.Linear):
        return module.out_features, module.in_features
    conv = cast(nn.Conv2d, module)  # the other of RANK1_TYPES
    return conv.out_channels, conv.in_channels


def rank1_layers(model: nn.Module, names: Sequence[str] | None = None) -> dict[str, nn.Module]:
    """The layers that get rank-1 factors, ``{module name: module}`` in model order.

    Parameters
    ----------
    model : nn.Module
    names : sequence of str, optional
        Module names to choose; None: every Conv2d and Linear layer (:data:`RANK1_TYPES`).

    Raises
    ------
    InvalidOptionError
        A name that is not a Conv2d or Linear layer of ``model``, or a model without one.
    """
    candidates = {name: module for name, module in model.named_modules()
                  if isinstance(module, RANK1_TYPES)}
    if names is None:
        if not candidates:
            raise InvalidOptionError(
                f"{type(model).__name__} has no Conv2d or Linear layer for rank-1 factors")
        return candidates
    missing = [name for name in names if name not in candidates]
    if missing:
        raise InvalidOptionError(
            f"layers: {show(missing)} are not Conv2d or Linear layers of "
            f"{type(model).__name__}; its layers: {show(list(candidates), 200)}")
    chosen = set(names)
    return {name: module for name, module in candidates.items() if name in chosen}


# -------------------------------------------------------------------------- state
@dataclass(frozen=True)
class Rank1State:
    """A rank-1 BNN: shared point estimates and a ``K``-component posterior over ``(r, s)``.

    Attributes
    ----------
    weights : dict of str to tensor
        Every parameter of the model except the biases of rank-1 layers, keyed and
        ordered like ``model.named_parameters()``.
    biases : dict of str to tensor
        The biases of rank-1 layers, one row per component: ``(K, outputs)``.
    r_loc, r_rho : dict of str to tensor
        Per rank-1 layer (module name, in model order): locations and ``rho`` of ``r``,
        ``(K, outputs)``; the scale is ``softplus(rho)``.
    s_loc, s_rho : dict of str to tensor
        The same for ``s``, ``(K, inputs)``.
    options : Rank1Options
    steps : int
        Updates taken (the KL annealing's clock).
    momentum : dict or None
        SGD's momentum buffers, shaped like :meth:`trainable` (None before the first step).
    """

    weights: Params
    biases: Params
    r_loc: Params
    r_rho: Params
    s_loc: Params
    s_rho: Params
    options: Rank1Options
    steps: int = 0
    momentum: dict[str, Params] | None = None

    @property
    def layers(self) -> list[str]:
        """The rank-1 layers' module names, in model order."""
        return list(self.r_loc)

    @property
    def components(self) -> int:
        return self.options.components

    def trainable(self) -> dict[str, Params]:
        """Every trained tensor, grouped: ``weights``, ``biases``, ``r_loc``, ``r_rho``,
        ``s_loc``, ``s_rho`` (the structure of :func:`loss_and_grad`'s gradients)."""
        return {"weights": self.weights, "biases": self.biases, "r_loc": self.r_loc,
                "r_rho": self.r_rho, "s_loc": self.s_loc, "s_rho": self.s_rho}


def _softplus_inverse(value: float) -> float:
    return value + math.log(-math.expm1(-value))


def _random_signs(shape: tuple[int, ...], probability: float, like: Tensor,
                  generator: torch.Generator) -> Tensor:
    chances = torch.full(shape, float(probability), dtype=like.dtype, device=like.device)
    return 2 * torch.bernoulli(chances, generator=generator) - 1


def _initial_rho(shape: tuple[int, ...], opts: Rank1Options, like: Tensor,
                 generator: torch.Generator) -> Tensor:
    centre = _softplus_inverse(float(opts.init_std))
    if opts.distribution == "cauchy":  # the reference starts a Cauchy's scale constant
        return torch.full(shape, centre, dtype=like.dtype, device=like.device)
    values = torch.empty(shape, dtype=like.dtype, device=like.device)
    nn.init.trunc_normal_(values, centre, RHO_SPREAD, centre - 2 * RHO_SPREAD,
                          centre + 2 * RHO_SPREAD, generator=generator)
    return values


def init(model: nn.Module, params: Mapping[str, Tensor], components: int,
         generator: torch.Generator, **options: Any) -> Rank1State:
    """The initial rank-1 state of ``model`` around the point estimates ``params``.

    Parameters
    ----------
    model : nn.Module
        The base architecture.
    params : dict of str to tensor
        Its initial parameters (every ``named_parameters()`` key); a rank-1 layer's bias
        starts every component's bias.
    components : int
        ``K``.
    generator : torch.Generator
        Source of the initial draws: for each rank-1 layer in order, the locations of
        ``r``, the ``rho`` of ``r``, then those of ``s``.
    **options
        The other :class:`Rank1Options` fields.

    Raises
    ------
    ShapeMismatchError
        ``params`` does not hold the model's parameters with their shapes.
    """
    opts = Rank1Options(components=components, **options)
    layers = rank1_layers(model, opts.layers)
    expected = dict(model.named_parameters())
    if set(params) != set(expected):
        missing, unknown = sorted(set(expected) - set(params)), sorted(set(params) - set(expected))
        raise ShapeMismatchError(f"params must hold the model's parameters; missing "
                                 f"{show(missing)}, unknown {show(unknown)}")
    for name, value in expected.items():
        if tuple(params[name].shape) != tuple(value.shape):
            raise ShapeMismatchError(f"params[{name!r}] has shape {tuple(params[name].shape)}, "
                                     f"the model's {tuple(value.shape)}")
    bias_keys = {_key(name, "bias") for name, module in layers.items()
                 if module.bias is not None}
    weights = {name: params[name].detach().clone() for name in expected
               if name not in bias_keys}
    biases = {key: params[key].detach().unsqueeze(0).repeat(opts.components, 1)
              for key in expected if key in bias_keys}
    r_loc, r_rho, s_loc, s_rho = {}, {}, {}, {}
    for name, module in layers.items():
        outputs, inputs = _sizes(module)
        like = params[_key(name, "weight")]
        r_loc[name] = _random_signs((opts.components, outputs), opts.sign_probability, like,
                                    generator)
        r_rho[name] = _initial_rho((opts.components, outputs), opts, like, generator)
        s_loc[name] = _random_signs((opts.components, inputs), opts.sign_probability, like,
                                    generator)
        s_rho[name] = _initial_rho((opts.components, inputs), opts, like, generator)
    return Rank1State(weights, biases, r_loc, r_rho, s_loc, s_rho, opts)


# -------------------------------------------------------------------------- draws
@dataclass(frozen=True)
class Draw:
    """One ``(r, s)`` per example: ``components`` (int64 ``(n,)``), and per rank-1 layer
    ``r`` ``(n, outputs)`` and ``s`` ``(n, inputs)``."""

    components: Tensor
    r: Params
    s: Params


def _check_components(state: Rank1State, components: object) -> Tensor:
    components = torch.as_tensor(components)
    if components.dim() != 1 or components.dtype not in (torch.int64, torch.int32):
        raise InvalidOptionError("components must be a 1-d integer tensor (one per example), "
                                 f"not {components.dtype} of shape {tuple(components.shape)}")
    if components.numel() and (components.min() < 0 or components.max() >= state.components):
        raise InvalidOptionError(f"components must be in [0, {state.components - 1}]")
    return components.long()


def draw_noise(state: Rank1State, count: int, generator: torch.Generator
               ) -> tuple[Params, Params]:
    """Standard ``eps`` for ``count`` examples: ``(eps_r, eps_s)`` per rank-1 layer, normal
    or standard Cauchy (``tan(pi (u - 1/2))``), drawn layer by layer, ``r``'s then ``s``'s."""
    check_integer("count", count, 0)
    eps_r: Params = {}
    eps_s: Params = {}
    for name in state.layers:
        for target, loc in ((eps_r, state.r_loc[name]), (eps_s, state.s_loc[name])):
            shape = (count, loc.shape[1])
            if state.options.distribution == "gaussian":
                target[name] = torch.randn(shape, generator=generator, dtype=loc.dtype,
                                           device=loc.device)
            else:
                uniform = torch.rand(shape, generator=generator, dtype=loc.dtype,
                                     device=loc.device)
                target[name] = torch.tan(math.pi * (uniform - 0.5))
    return eps_r, eps_s


def _factors(loc: Mapping[str, Tensor], rho: Mapping[str, Tensor], eps: Mapping[str, Tensor],
             components: Tensor, clip: float) -> Params:
    """``clip(loc[k] + softplus(rho[k]) * eps)`` per example (differentiable in loc, rho)."""
    return {name: (loc[name][components] + nn.functional.softplus(rho[name][components])
                   * eps[name]).clamp(-clip, clip) for name in loc}


def draw(state: Rank1State, components: Tensor, generator: torch.Generator) -> Draw:
    """One draw of ``(r, s)`` for each example, from its component ``components[i]``."""
    components = _check_components(state, components)
    eps_r, eps_s = draw_noise(state, components.numel(), generator)
    clip = float(state.options.clip)
    with torch.no_grad():
        return Draw(components, _factors(state.r_loc, state.r_rho, eps_r, components, clip),
                    _factors(state.s_loc, state.s_rho, eps_s, components, clip))


# ------------------------------------------------------------------- forward pass
def _per_example(factor: Tensor, value: Tensor, channel_axis: int) -> Tensor:
    """``factor`` ``(n, channels)`` shaped to broadcast over ``value`` ``(n, ...)`` along
    ``channel_axis`` (1 for a conv, the last for a Linear)."""
    if value.shape[0] != factor.shape[0]:
        raise ShapeMismatchError(
            f"a rank-1 layer saw {value.shape[0]} examples, the draw has {factor.shape[0]}: "
            "the model must keep the batch axis first")
    shape = [1] * value.dim()
    shape[0] = factor.shape[0]
    shape[channel_axis] = factor.shape[1]
    return factor.reshape(shape)


def _hooks(module: nn.Module, r: Tensor, s: Tensor, bias: Tensor | None
           ) -> tuple[Callable, Callable]:
    axis = -1 if isinstance(module, nn.Linear) else 1

    def scale_input(_module: nn.Module, args: tuple) -> tuple:
        x = args[0]
        return (x * _per_example(s, x, axis), *args[1:])

    def scale_output(_module: nn.Module, _args: tuple, y: Tensor) -> Tensor:
        y = y * _per_example(r, y, axis)
        return y if bias is None else y + _per_example(bias, y, axis)

    return scale_input, scale_output


def _forward(model: nn.Module, weights: Mapping[str, Tensor], biases: Mapping[str, Tensor],
             buffers: Mapping[str, Tensor], inputs: Tensor, components: Tensor,
             r: Mapping[str, Tensor], s: Mapping[str, Tensor]) -> Tensor:
    params = dict(weights)
    handles = []
    try:
        for name in r:
            module = model.get_submodule(name)
            key = _key(name, "bias")
            bias = None
            if key in biases:
                bias = biases[key][components]
                # The layer adds no bias of its own: b_k is added after the r product.
                params[key] = torch.zeros_like(biases[key][0])
            pre, post = _hooks(module, r[name], s[name], bias)
            handles.append(module.register_forward_pre_hook(pre))
            handles.append(module.register_forward_hook(post))
        return functional_call(model, (params, dict(buffers)), (inputs,))
    finally:
        for handle in handles:
            handle.remove()


def _buffers(model: nn.Module, buffers: Mapping[str, Tensor] | None) -> Mapping[str, Tensor]:
    if buffers is None:
        return {name: value for name, value in model.named_buffers()}
    return buffers


def forward(model: nn.Module, state: Rank1State, inputs: Tensor, factors: Draw,
            buffers: Mapping[str, Tensor] | None = None) -> Tensor:
    """The network's output for ``inputs`` ``(n, ...)``, example ``i`` under the factors
    ``factors.r[.][i]``, ``factors.s[.][i]`` and the bias of component
    ``factors.components[i]``.

    In training mode BatchNorm normalises over the ``n`` examples and updates the running
    statistics in ``buffers`` (default: the model's own) in place.
    """
    components = _check_components(state, factors.components)
    if set(factors.r) != set(state.layers) or set(factors.s) != set(state.layers):
        raise ShapeMismatchError(f"the draw's layers {sorted(factors.r)} are not the state's "
                                 f"{state.layers}")
    return _forward(model, state.weights, state.biases, _buffers(model, buffers), inputs,
                    components, factors.r, factors.s)


def _tile(inputs: Tensor, components: int) -> tuple[Tensor, Tensor]:
    """``inputs`` repeated ``components`` times, component-major, and each row's component."""
    tiled = inputs.repeat(components, *([1] * (inputs.dim() - 1)))
    which = torch.arange(components, device=inputs.device).repeat_interleave(inputs.shape[0])
    return tiled, which


def logits(model: nn.Module, state: Rank1State, inputs: Tensor,
           components: Tensor | None, generator: torch.Generator,
           buffers: Mapping[str, Tensor] | None = None) -> Tensor:
    """The network's output with a fresh ``(r, s)`` per example.

    Parameters
    ----------
    components : int tensor ``(n,)`` or None
        The component of each example; None tiles the batch: every component sees every
        example, and the result is ``(K, n, ...)`` (component ``k`` in row ``k``).
    generator : torch.Generator
        Source of the draws (:func:`draw_noise`).

    Returns
    -------
    tensor
        ``(n, ...)``, or ``(K, n, ...)`` when tiled.
    """
    if components is None:
        tiled, which = _tile(inputs, state.components)
        out = forward(model, state, tiled, draw(state, which, generator), buffers)
        return out.reshape(state.components, inputs.shape[0], *out.shape[1:])
    return forward(model, state, inputs, draw(state, components, generator), buffers)


def mixture_log_likelihood(model: nn.Module, state: Rank1State,
                           batch: tuple[Tensor, Tensor], generator: torch.Generator,
                           samples: int = 1, buffers: Mapping[str, Tensor] | None = None
                           ) -> Tensor:
    """The log-mixture predictive ``log (1 / (S K)) sum_{s, k} p(y | x, r_sk, s_sk)`` per
    example (``(n,)``), with ``S = samples`` draws per component (the reference's
    evaluation: ``logsumexp`` of the log-likelihoods minus ``log(S K)``)."""
    check_integer("samples", samples, 1, 10_000)
    images, labels = batch
    with torch.no_grad():
        per_draw = torch.stack([
            torch.log_softmax(logits(model, state, images, None, generator, buffers), -1)
            .gather(-1, labels.expand(state.components, -1).unsqueeze(-1)).squeeze(-1)
            for _ in range(samples)])
        return (torch.logsumexp(per_draw.reshape(-1, images.shape[0]), 0)
                - math.log(samples * state.components))


# -------------------------------------------------------------------------- fold
def component_params(state: Rank1State, component: int) -> Params:
    """The base architecture's parameters of component ``component`` before folding: the
    shared point estimates and that component's biases."""
    check_integer("component", component, 0, state.components - 1)
    params = dict(state.weights)
    params.update({key: value[component] for key, value in state.biases.items()})
    return params


def _input_factor(s: Tensor, weight: Tensor, layer: str) -> Tensor:
    """``s`` laid out like ``weight``'s rows: entry ``(o, j)`` is the factor of the input
    channel that weight ``(o, j)`` reads (a grouped conv's group ``g`` reads channels
    ``g * in_per_group ...``)."""
    outputs, per_group = weight.shape[0], weight.shape[1]
    if s.numel() % per_group or outputs % (s.numel() // per_group):
        raise ShapeMismatchError(f"{layer}: s has {s.numel()} entries, which does not fit "
                                 f"a weight of shape {tuple(weight.shape)}")
    groups = s.numel() // per_group
    return s.reshape(groups, per_group).repeat_interleave(outputs // groups, dim=0)


def fold(params: Mapping[str, Tensor], r: Mapping[str, Tensor], s: Mapping[str, Tensor]
         ) -> Params:
    """Plain parameters whose network computes what the rank-1 layers compute with factors
    ``r``, ``s``: ``weight' = diag(r) weight diag(s)`` on the output and input axes of each
    layer named in ``r`` (a conv's kernel axes untouched, a grouped conv per group);
    biases and every other tensor unchanged (the bias is added after the ``r`` product).

    Parameters
    ----------
    params : dict of str to tensor
        The base architecture's parameters (:func:`component_params`).
    r, s : dict of str to tensor
        Per layer (module name), ``r`` ``(outputs,)`` and ``s`` ``(inputs,)``.

    Raises
    ------
    ShapeMismatchError
        A layer without a weight in ``params``, ``r`` and ``s`` for different layers, or
        factors whose lengths do not fit the weight.
    """
    if set(r) != set(s):
        raise ShapeMismatchError(f"r and s name different layers: {sorted(r)} and {sorted(s)}")
    folded = dict(params)
    for layer in r:
        key = _key(layer, "weight")
        if key not in params:
            raise ShapeMismatchError(f"{layer}: params holds no {key}")
        weight, out_factor, in_factor = params[key], r[layer], s[layer]
        if out_factor.dim() != 1 or in_factor.dim() != 1 or weight.dim() < 2:
            raise ShapeMismatchError(f"{layer}: r and s must be vectors and the weight a "
                                     "matrix or a kernel")
        if out_factor.numel() != weight.shape[0]:
            raise ShapeMismatchError(f"{layer}: r has {out_factor.numel()} entries, the "
                                     f"weight {weight.shape[0]} outputs")
        rows = _input_factor(in_factor, weight, layer)
        trailing = [1] * (weight.dim() - 2)
        folded[key] = (weight * out_factor.reshape(-1, 1, *trailing)
                       * rows.reshape(*rows.shape, *trailing))
    return folded


def point_estimates(state: Rank1State) -> Params:
    """The base architecture's parameters with the shared weights and each rank-1 bias
    averaged over the components (unfolded: what the training loop's callbacks see)."""
    params = dict(state.weights)
    params.update({key: value.mean(0) for key, value in state.biases.items()})
    return params


def sample(model: nn.Module, state: Rank1State, generator: torch.Generator, count: int,
           buffers: Mapping[str, Tensor] | None = None) -> list[dict[str, Tensor]]:
    """``count`` draws from the mixture: state_dicts of the base architecture.

    Each sample draws its component ``k`` uniformly (``torch.randint``), then one ``(r, s)``
    from component ``k`` (:func:`draw_noise` for one example), and folds them into
    component ``k``'s parameters (:func:`fold`); ``buffers`` (default: the model's own,
    BatchNorm's running statistics) are stored with every sample.
    """
    check_integer("count", count, 0)
    buffers = {name: value.detach() for name, value in _buffers(model, buffers).items()}
    samples = []
    for _ in range(count):
        component = int(torch.randint(state.components, (1,), generator=generator))
        factors = draw(state, torch.tensor([component]), generator)
        folded = fold(component_params(state, component),
                      {name: value[0] for name, value in factors.r.items()},
                      {name: value[0] for name, value in factors.s.items()})
        samples.append(state_dict_of(model, folded, buffers))
    return samples
