"""Ensemble Model Patching, EMP and ECMP (Chang, Yao, Williams-King and Lipson 2019).

A few *patch* layers of the network are ensembles of ``K`` components with uniform, fixed
mixing probabilities; every other parameter is one point estimate shared by all draws
(the paper's mean-field Gaussian with ``sigma`` fixed near machine epsilon, section 3.1).

- **Patch layers** (:func:`patched_names`, option ``patch``): ``"bn"``, the affine weight
  and bias of every BatchNorm layer; ``"bn+out"``, these and the output layer (the
  paper's best setting, Table 4); ``"in+out"``, the first conv/linear layer and the
  output layer, for networks without BatchNorm such as OptuNet (section 3.3: "include the
  encoder/decoder layers ... since they interface with the data"); ``"auto"`` (the
  default), ``"bn+out"`` when the network has BatchNorm, else ``"in+out"``.
- **Draws** (:func:`draw`, option ``variant``): EMP (equation 4) picks one component per
  patched *layer* per forward pass (a layer's weight and bias share it); ECMP (equation
  5) picks one per *element*: every scalar of a patched tensor has its own index. The
  whole batch shares a draw. Indices are uniform over ``0 .. K-1``.
- **Loss** (:func:`loss`): the negative ELBO with one Monte Carlo draw (``S = 1`` for
  gradients, section 3.2), simplified as in appendix C.1 to the minibatch mean
  cross-entropy plus plain L2 with one factor ``lambda = weight_decay / batch size``
  (``weight_decay = 0.001``, the paper's "arbitrarily chosen value") on every shared
  parameter and on every component of every patched parameter, drawn or not.
- **Optimiser**: Adam with ``torch.optim.Adam``'s defaults (lr 1e-3, section 5: "use Adam
  on the default settings"), no optimiser weight decay: the L2 term is in the loss
  (:class:`EmpStepper`).
- **Prediction** (:func:`predict`): the average softmax over ``S`` passes, each with its
  own draw (``S = 100``, option ``samples``; appendix D.6: gains stop near 100).
- **Initialisation** (:func:`init`): the paper says only that the components are
  initialised "randomly" (Algorithm 1). Here component 0 is the base network's own
  initial value and components ``1 .. K-1`` are copies of it plus Gaussian noise of
  standard deviation ``init_noise`` (default 0.1) times the tensor's root mean square
  (times 1 for an all-zero tensor, such as BatchNorm's bias, which lives on the unit
  scale of the normalised activations). With ``K = 1`` the method is therefore plain
  training of the base network with the same L2 and optimiser.
- **Samples** (:func:`sample`): one draw folded into the parameters (:func:`fold`) is an
  ordinary checkpoint of the base architecture: the patched tensors hold the drawn
  components' values, everything else (shared parameters, BatchNorm statistics) is the
  same in every sample of a mode. The BatchNorm running statistics are shared by all
  components (buffers, not parameters): they average over the draws seen in training.

The pieces follow the style of the other methods (:mod:`train_zoo.methods`): tensors in,
tensors out, randomness only from a ``torch.Generator``, the model evaluated with
``torch.func.functional_call``. :class:`EmpStepper` adapts them to
:func:`train_zoo.loop.fit`.

>>> import torch
>>> from posteriorzoo.models import build
>>> model = build("optunet")
>>> patched_names(model, "auto")
['conv1.weight', 'fc.weight', 'fc.bias']
>>> state = init_model(model, torch.Generator().manual_seed(0))
>>> draws = sample(model, state, torch.Generator().manual_seed(1), 2)
>>> build("optunet").load_state_dict(draws[0])
<All keys matched successfully>
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.func import functional_call

from posteriorzoo.errors import InvalidOptionError, UnknownNameError
from posteriorzoo.options import check_choice, check_constraints, check_integer, check_number
from posteriorzoo.vocabulary import (
    EMP_COMPONENTS,
    EMP_INIT_NOISE,
    EMP_LR,
    EMP_PATCHES,
    EMP_SAMPLES,
    EMP_WEIGHT_DECAY,
    options_of,
)
from train_zoo.loop import fit
from train_zoo.methods.base import (
    Method,
    ModeRun,
    Posterior,
    declared_options,
    generator_for,
)
from train_zoo.methods.common import Params, state_dict_of

if TYPE_CHECKING:
    from train_zoo.fast.gradients import LossGradient

__all__ = [
    "ECMP",
    "ADAM_LR",
    "COMPONENTS",
    "INIT_NOISE",
    "OPTION_HELP",
    "PATCHES",
    "SAMPLES",
    "VARIANTS",
    "WEIGHT_DECAY",
    "EmpOptions",
    "EmpState",
    "EmpStepper",
    "draw",
    "fold",
    "init",
    "init_model",
    "logits",
    "loss",
    "patched_names",
    "penalty",
    "predict",
    "resolve_options",
    "sample",
]

#: The numbers of the options, the vocabulary's (with their reasons): components per
#: patched layer (the paper's K = 5), forward passes averaged by :func:`predict` (appendix
#: D.6: S = 100 is as good as 200), the L2 factor ``WEIGHT_DECAY / batch size`` (appendix
#: C.1), Adam's default learning rate (the paper trains with Adam's defaults), the
#: components' initial spread relative to each tensor's RMS, the patch layer choices
#: (:func:`patched_names`).
COMPONENTS, SAMPLES, WEIGHT_DECAY = EMP_COMPONENTS, EMP_SAMPLES, EMP_WEIGHT_DECAY
ADAM_LR, INIT_NOISE, PATCHES = EMP_LR, EMP_INIT_NOISE, EMP_PATCHES
#: ``"emp"``: one component per patched layer and pass; ``"ecmp"``: one per element. Not
#: a method option: the method's name fixes it.
VARIANTS = ("emp", "ecmp")

_DECLARED = {option.name: option for option in options_of("emp")}
#: One line of help per option (a spec's ``[method_options]``, from the vocabulary), and
#: the variant's.
OPTION_HELP: dict[str, str] = {}
for _name, _declared in _DECLARED.items():
    OPTION_HELP[_name] = _declared.help
    if _name == "patch":
        OPTION_HELP["variant"] = ("emp (one component per layer and pass) or ecmp (one per "
                                  "element)")

_BATCHNORM_TYPES: tuple[type[nn.Module], ...] = (nn.BatchNorm1d, nn.BatchNorm2d,
                                                 nn.BatchNorm3d, nn.SyncBatchNorm)
_LAYER_TYPES: tuple[type[nn.Module], ...] = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def _default(name: str) -> Any:
    """The vocabulary's default of the option ``name``."""
    return _DECLARED[name].default


def _what(option: str) -> str:
    return f"emp option '{option}'"


@dataclass(frozen=True)
class EmpOptions:
    """The method's options, validated on construction (:class:`InvalidOptionError`) by
    the constraints the vocabulary declares (``posteriorzoo.vocabulary.EMP_OPTIONS``:
    ranges, defaults and help, with the reasons for the ranges).

    Attributes
    ----------
    components : int
        ``K``, components per patched layer (``K = 1`` is plain training).
    patch : {"auto", "bn", "bn+out", "in+out"}
        Which layers are patched (:func:`patched_names`).
    variant : {"emp", "ecmp"}, default "emp"
        One component per patched layer per pass, or one per element.
    samples : int
        ``S``, passes averaged by :func:`predict`.
    weight_decay : float
        The L2 factor is ``weight_decay / batch size``.
    lr : float
        Adam's learning rate.
    init_noise : float
        Relative spread of the initial components (:func:`init`).
    """

    components: int = _default("components")
    patch: str = _default("patch")
    variant: str = "emp"
    samples: int = _default("samples")
    weight_decay: float = _default("weight_decay")
    lr: float = _default("lr")
    init_noise: float = _default("init_noise")

    def __post_init__(self) -> None:
        # The vocabulary's constraints (their reasons there), and the variant.
        check_choice(_what("variant"), self.variant, VARIANTS)
        for name, option in _DECLARED.items():
            check_constraints(_what(name), getattr(self, name), option.constraints)


def resolve_options(options: Mapping[str, Any]) -> dict[str, object]:
    """A spec's ``[method_options]`` for EMP, checked and completed with the defaults:
    what a collection records.

    Raises
    ------
    UnknownNameError
        An option the method does not have (:data:`OPTION_HELP` lists them).
    InvalidOptionError
        A bad value; the message names the option.
    """
    unknown = sorted(set(options) - set(OPTION_HELP))
    if unknown:
        raise UnknownNameError(f"unknown emp option(s) {unknown}; options: "
                               f"{', '.join(OPTION_HELP)}")
    return asdict(EmpOptions(**options))


# ---------------------------------------------------------------- the patch layers
def _own_parameters(prefix: str, module: nn.Module) -> list[str]:
    return [f"{prefix}.{name}" if prefix else name
            for name, _ in module.named_parameters(recurse=False)]


def patched_names(model: nn.Module, patch: str) -> list[str]:
    """The names of the patched parameters, in ``model.named_parameters()`` order.

    Found by walking ``model.named_modules()`` (registration order, which is the order of
    the forward pass in this project's networks):

    - ``"bn"``: the weight and bias of every BatchNorm layer with affine parameters;
    - ``"in"`` part of ``"in+out"``: the first ``Linear`` or ``Conv`` layer (weight, and
      bias if it has one);
    - ``"out"`` part: the last ``Linear`` layer;
    - ``"auto"``: ``"bn+out"`` if the network has BatchNorm, else ``"in+out"``.

    Raises
    ------
    InvalidOptionError
        An unknown ``patch``; ``"bn"`` or ``"bn+out"`` for a network without affine
        BatchNorm; ``"in+out"`` or ``"bn+out"`` for a network without a Linear layer.
    """
    check_choice(_what("patch"), patch, PATCHES)
    modules = list(model.named_modules())
    batchnorm = [name for prefix, module in modules if isinstance(module, _BATCHNORM_TYPES)
                 for name in _own_parameters(prefix, module)]
    layers = [(prefix, module) for prefix, module in modules
              if isinstance(module, _LAYER_TYPES) and _own_parameters(prefix, module)]
    linears = [(prefix, module) for prefix, module in layers if isinstance(module, nn.Linear)]
    if patch == "auto":
        patch = "bn+out" if batchnorm else "in+out"
    chosen: set[str] = set()
    if patch in ("bn", "bn+out"):
        if not batchnorm:
            raise InvalidOptionError(f"{_what('patch')} is {patch!r} but the network has no "
                                     f"BatchNorm layer with affine parameters; use 'in+out'")
        chosen.update(batchnorm)
    if patch in ("bn+out", "in+out"):
        if not linears:
            raise InvalidOptionError(f"{_what('patch')} is {patch!r} but the network has no "
                                     f"Linear output layer")
        chosen.update(_own_parameters(*linears[-1]))
    if patch == "in+out":
        chosen.update(_own_parameters(*layers[0]))
    return [name for name, _ in model.named_parameters() if name in chosen]


def _layer_of(name: str) -> str:
    """The module that owns parameter ``name`` (EMP draws one index per module)."""
    return name.rpartition(".")[0]


# ---------------------------------------------------------------- state
@dataclass(frozen=True)
class EmpState:
    """An EMP/ECMP variational distribution.

    Attributes
    ----------
    shared : dict of str to tensor
        The unpatched parameters (point estimates), in the model's order.
    components : dict of str to tensor
        Every patched parameter's ``K`` components, stacked: ``(K, *shape)``.
    buffers : dict of str to tensor
        The network's buffers (BatchNorm statistics), shared by every draw.
    variant : {"emp", "ecmp"}
        How :func:`sample` and :func:`predict` draw.
    order : tuple of str
        Every parameter name in ``model.named_parameters()`` order (:func:`fold`'s order).
    """

    shared: Params
    components: Params
    buffers: Params
    variant: str
    order: tuple[str, ...]

    @property
    def num_components(self) -> int:
        """``K``."""
        return int(next(iter(self.components.values())).shape[0])


def init(params: Mapping[str, Tensor], components: int, generator: torch.Generator, *,
         patched: Sequence[str], buffers: Mapping[str, Tensor] | None = None,
         variant: str = "emp", init_noise: float = INIT_NOISE) -> EmpState:
    """The initial state: ``K`` components of every patched parameter.

    Parameters
    ----------
    params : mapping of str to tensor
        The base network's initial parameters, in ``model.named_parameters()`` order.
    components : int
        ``K``, components per patched layer (1 to 100).
    generator : torch.Generator
        Source of the components' noise (one ``torch.randn`` of shape ``(K - 1, *shape)``
        per patched parameter, in order).
    patched : sequence of str
        The patched parameters (:func:`patched_names`), a non-empty subset of ``params``.
    buffers : mapping of str to tensor, optional
        The network's buffers (default none).
    variant : {"emp", "ecmp"}, default "emp"
    init_noise : float, default 0.1
        Component ``k >= 1`` is ``value + init_noise * rms(value) * N(0, I)`` (``rms``
        taken as 1 for an all-zero tensor); component 0 is ``value`` itself.

    Returns
    -------
    EmpState
        Tensors cloned (the inputs are not modified), in the parameters' dtypes.
    """
    count = check_integer(_what("components"), components, 1, 100)
    check_choice(_what("variant"), variant, VARIANTS)
    check_number(_what("init_noise"), init_noise, 0, maximum=10)
    patched = list(patched)
    missing = [name for name in patched if name not in params]
    if not patched or missing:
        raise InvalidOptionError(f"emp needs patched parameters of the network, not "
                                 f"{missing or patched}")
    shared = {name: value.detach().clone() for name, value in params.items()
              if name not in patched}
    stacks = {}
    for name in patched:
        value = params[name].detach()
        copies = value.unsqueeze(0).repeat(count, *([1] * value.dim()))
        if count > 1:
            rms = float(value.double().square().mean().sqrt())
            scale = init_noise * (rms if rms > 0 else 1.0)
            noise = torch.randn((count - 1, *value.shape), generator=generator,
                                dtype=value.dtype, device=generator.device)
            copies[1:] += scale * noise.to(value.device)
        stacks[name] = copies
    return EmpState(shared=shared, components=stacks,
                    buffers={name: value.detach().clone()
                             for name, value in (buffers or {}).items()},
                    variant=variant, order=tuple(params))


def init_model(model: nn.Module, generator: torch.Generator,
               options: EmpOptions | None = None) -> EmpState:
    """:func:`init` from ``model``'s current parameters and buffers with ``options``
    (default :class:`EmpOptions`): the patched layers are ``patched_names(model,
    options.patch)``."""
    options = EmpOptions() if options is None else options
    params = dict(model.named_parameters())
    return init(params, options.components, generator,
                patched=patched_names(model, options.patch),
                buffers=dict(model.named_buffers()), variant=options.variant,
                init_noise=options.init_noise)


# ---------------------------------------------------------------- draws
def draw(state: EmpState, variant: str, generator: torch.Generator) -> dict[str, Tensor]:
    """One mixing assignment: the component index of every patched parameter.

    Parameters
    ----------
    state : EmpState
    variant : {"emp", "ecmp"}
        ``"emp"``: one int64 0-d tensor per patched *layer* (the same tensor for its
        weight and bias), uniform over ``0 .. K-1``; ``"ecmp"``: an int64 tensor shaped
        like each patched parameter, every element independently uniform.
    generator : torch.Generator
        The only source of randomness: EMP draws one ``torch.randint`` per layer, ECMP one
        per parameter, in the parameters' order.

    Returns
    -------
    dict of str to int64 tensor
        Keyed like ``state.components``, on the generator's device.
    """
    check_choice(_what("variant"), variant, VARIANTS)
    count = state.num_components
    indices: dict[str, Tensor] = {}
    layers: dict[str, Tensor] = {}
    for name, stack in state.components.items():
        if variant == "emp":
            layer = _layer_of(name)
            if layer not in layers:
                layers[layer] = torch.randint(count, (), generator=generator,
                                              device=generator.device)
            indices[name] = layers[layer]
        else:
            indices[name] = torch.randint(count, tuple(stack.shape[1:]), generator=generator,
                                          device=generator.device)
    return indices


def _select(stack: Tensor, index: Tensor) -> Tensor:
    """``stack[index]`` for a 0-d index (EMP), element-wise ``stack[index[i], i]`` for
    an index shaped like ``stack[0]`` (ECMP); differentiable with respect to ``stack``."""
    index = index.to(stack.device)
    if index.dim() == 0:
        return stack[index]
    return torch.gather(stack, 0, index.unsqueeze(0)).squeeze(0)


def fold(state: EmpState, indices: Mapping[str, Tensor]) -> Params:
    """The network's parameters for one draw: every patched parameter is its drawn
    components' values, the others are the shared ones; in the model's order.

    Differentiable with respect to ``state.shared`` and ``state.components``.

    Raises
    ------
    InvalidOptionError
        ``indices`` not keyed like ``state.components``, or an index shaped neither 0-d
        nor like its parameter.
    """
    if set(indices) != set(state.components):
        raise InvalidOptionError(f"emp indices must name the patched parameters "
                                 f"{sorted(state.components)}, not {sorted(indices)}")
    params = {}
    for name in state.order:
        if name in state.components:
            stack, index = state.components[name], indices[name]
            if index.dim() != 0 and tuple(index.shape) != tuple(stack.shape[1:]):
                raise InvalidOptionError(f"emp index of {name} has shape "
                                         f"{tuple(index.shape)}, not () or "
                                         f"{tuple(stack.shape[1:])}")
            params[name] = _select(stack, index)
        else:
            params[name] = state.shared[name]
    return params


# ---------------------------------------------------------------- forward and loss
def _copy(buffers: Mapping[str, Tensor]) -> Params:
    return {name: value.clone() for name, value in buffers.items()}


def logits(model: nn.Module, state: EmpState, indices: Mapping[str, Tensor],
           inputs: Tensor) -> Tensor:
    """The logits of the network at one draw (``torch.func.functional_call``).

    The model's mode decides BatchNorm's behaviour (training mode: batch statistics).
    The statistics a training-mode pass updates are a copy's: ``state`` never changes.
    """
    return functional_call(model, (fold(state, indices), _copy(state.buffers)), (inputs,))


def penalty(state: EmpState) -> Tensor:
    """The sum of squares of every shared parameter and of every component of every
    patched parameter (appendix C.1's L2 term before its factor), a 0-d tensor."""
    tensors = [*state.shared.values(), *state.components.values()]
    return torch.stack([value.square().sum() for value in tensors]).sum()


def loss(model: nn.Module, state: EmpState, batch: tuple[Tensor, Tensor],
         indices: Mapping[str, Tensor], weight_decay: float = WEIGHT_DECAY, *,
         buffers: Mapping[str, Tensor] | None = None) -> Tensor:
    """The training loss at one draw: mean cross-entropy of the batch plus
    ``weight_decay / B * penalty(state)`` (``B`` the batch size).

    Differentiable with respect to the tensors of ``state.shared`` and
    ``state.components``. ``buffers``, if given, are the BatchNorm statistics a
    training-mode pass updates in place (the stepper's own); by default a copy of the
    state's.
    """
    check_number(_what("weight_decay"), weight_decay, 0)
    images, labels = batch
    buffers = _copy(state.buffers) if buffers is None else buffers
    output = functional_call(model, (fold(state, indices), {**buffers}), (images,))
    data = nn.functional.cross_entropy(output, labels)
    return data + (weight_decay / images.shape[0]) * penalty(state)


# ---------------------------------------------------------------- training
class EmpStepper:
    """EMP/ECMP training for :func:`train_zoo.loop.fit`: one draw per step
    (:func:`draw`), the :func:`loss` at that draw, and a ``torch.optim.Adam`` step (its
    defaults, no optimiser weight decay) over the shared parameters and the component
    stacks.

    ``lr`` of :meth:`step` is Adam's learning rate for that step (a constant
    :data:`ADAM_LR` schedule is the paper's). The model is put in training mode; its own
    weights are not used or changed. The BatchNorm statistics are the stepper's own
    copy, updated by every step. :meth:`state` is the current :class:`EmpState`.
    """

    def __init__(self, model: nn.Module, state: EmpState, generator: torch.Generator, *,
                 weight_decay: float = WEIGHT_DECAY, lr: float = ADAM_LR,
                 gradient: LossGradient | None = None) -> None:
        self.model = model
        self.gradient = gradient
        self.generator = generator
        self.weight_decay = check_number(_what("weight_decay"), weight_decay, 0)
        self._state = EmpState(
            shared={n: v.detach().clone().requires_grad_(True)
                    for n, v in state.shared.items()},
            components={n: v.detach().clone().requires_grad_(True)
                        for n, v in state.components.items()},
            buffers=_copy(state.buffers), variant=state.variant, order=state.order)
        self.optimizer = torch.optim.Adam(
            [*self._state.shared.values(), *self._state.components.values()],
            lr=check_number(_what("lr"), lr, 0, strict=True))
        self.steps = 0
        self.stopped = False

    def step(self, batch: tuple[Tensor, Tensor], lr: float) -> float:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.gradient is None:  # the kernels' path does not run the module
            self.model.train()
        indices = draw(self._state, self._state.variant, self.generator)
        self.optimizer.zero_grad(set_to_none=True)
        if self.gradient is None:
            value = loss(self.model, self._state, batch, indices, self.weight_decay,
                         buffers=self._state.buffers)
            value.backward()
            result = float(value.detach())
        else:
            result = self._engine_gradients(batch, indices)
        self.optimizer.step()
        self.steps += 1
        self.stopped = not math.isfinite(result)
        return result

    @torch.no_grad()
    def _engine_gradients(self, batch: tuple, indices: Mapping[str, Tensor]) -> float:
        """:func:`loss`'s gradients with the engine's cross-entropy gradient at the folded
        draw: each element's gradient goes to the component it was drawn from (as
        autograd through :func:`fold` sends it), and the L2 term's ``2 lambda p`` to every
        shared parameter and component. Returns the loss."""
        if self.gradient is None:  # step() takes this path only with the engine's gradient
            raise RuntimeError("EMP's engine path needs the engine's loss gradient")
        cross_entropy, grads = self.gradient(fold(self._state, indices), batch)
        factor = self.weight_decay / len(batch[1])
        for name, value in self._state.shared.items():
            value.grad = grads[name].to(value.dtype) + 2 * factor * value
        for name, stack in self._state.components.items():
            drawn = torch.zeros_like(stack)
            index = indices[name].to(stack.device)
            if index.dim() == 0:
                drawn[index] = grads[name].to(stack.dtype)
            else:  # ECMP: one component per element, so each element is written once
                drawn.scatter_(0, index.unsqueeze(0), grads[name].to(stack.dtype).unsqueeze(0))
            stack.grad = drawn + 2 * factor * stack
        return float(cross_entropy) + factor * float(penalty(self._state))

    def arrays(self) -> dict[str, np.ndarray]:
        """The parameters in ``named_parameters`` layout; a patched parameter shows the
        mean of its components (the mixture's mean)."""
        values = {**self._state.shared,
                  **{name: stack.mean(0) for name, stack in self._state.components.items()}}
        return {name: values[name].detach().cpu().numpy() for name in self._state.order}

    def state(self) -> EmpState:
        """The current distribution (detached copies)."""
        current = self._state
        return EmpState(shared={n: v.detach().clone() for n, v in current.shared.items()},
                        components={n: v.detach().clone()
                                    for n, v in current.components.items()},
                        buffers=_copy(current.buffers), variant=current.variant,
                        order=current.order)


# ---------------------------------------------------------------- samples and prediction
def sample(model: nn.Module, state: EmpState, generator: torch.Generator, count: int
           ) -> list[dict[str, Tensor]]:
    """``count`` posterior samples: state_dicts of the base architecture, each one draw
    (:func:`draw` with ``state.variant``) folded in (:func:`fold`) with the shared
    BatchNorm statistics; each loads with ``model.load_state_dict``."""
    count = check_integer(_what("count"), count, 0)
    return [state_dict_of(model, fold(state, draw(state, state.variant, generator)),
                          state.buffers) for _ in range(count)]


def predict(model: nn.Module, state: EmpState, inputs: Tensor, samples: int,
            generator: torch.Generator) -> Tensor:
    """The predictive distribution: the average softmax of ``samples`` passes (the paper's
    :data:`SAMPLES` = 100), each at its own draw (:func:`draw` with ``state.variant``,
    from ``generator``), the model in evaluation mode (BatchNorm's running statistics);
    the model's mode is restored afterwards.

    Returns
    -------
    tensor ``(B, C)``
        Class probabilities; rows sum to 1.
    """
    samples = check_integer(_what("samples"), samples, 1, 100_000)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            total: Tensor | None = None
            for _ in range(samples):
                indices = draw(state, state.variant, generator)
                probabilities = logits(model, state, indices, inputs).softmax(-1)
                total = probabilities if total is None else total + probabilities
    finally:
        model.train(was_training)
    if total is None:  # samples >= 1, checked above
        raise AssertionError("no samples drawn")
    return total / samples


# ---------------------------------------------------------------- the method
@dataclass(frozen=True)
class EmpPosterior:
    """The trained EMP/ECMP distribution and the base architecture it folds into."""

    model: nn.Module
    state: EmpState


class EnsembleModelPatching(Method):
    """EMP or ECMP (``variant``, also the method's name): each mode trains the patched
    network from the mode's initial weights with Adam (:class:`EmpStepper`) for the
    recipe's epochs on its batches; a sample is one draw folded into a checkpoint of the
    base architecture (:func:`sample`). The options are the vocabulary's EMP_OPTIONS (not
    ``variant``, which the name fixes)."""

    trains_base = False

    def __init__(self, variant: str) -> None:
        self.name = check_choice("variant", variant, VARIANTS)
        self.options = declared_options(self.name)
        self.summary = ("Ensemble Model Patching: K components of a few patch layers, one "
                        "draw folded into a sample" if variant == "emp" else
                        "Ensemble Model Patching per element: each element of the patch "
                        "layers drawn from its K components, one draw folded into a sample")

    def fit(self, run: ModeRun) -> Posterior:
        spec, seeds = run.spec, run.seeds
        options = EmpOptions(**spec.method_options, variant=self.name)
        model = run.engine.initial_model()
        start = init_model(model, generator_for(seeds.init), options)
        # The engine's cross-entropy gradient where its kernels cover the network (the
        # method's own draw, scatter, L2 and Adam either way); torch autograd otherwise.
        gradient = run.engine.loss_gradient(model)
        stepper = EmpStepper(model, start, generator_for(seeds.noise),
                             weight_decay=options.weight_decay, lr=options.lr,
                             gradient=gradient)
        result = fit(stepper, run.engine.batches(model, seeds.data,
                                                 torch_only=gradient is None),
                     lambda epoch: options.lr, spec.recipe.epochs, index=run.index,
                     phase=self.name, callbacks=run.callbacks)
        state = stepper.state()
        record = {"method": self.name, "variant": state.variant,
                  "components": state.num_components, "patched": sorted(state.components)}
        return Posterior(EmpPosterior(model, state), result.steps, run.engine.name, record)

    def sample(self, state: EmpPosterior, generator: torch.Generator, count: int
               ) -> list[dict[str, Tensor]]:
        return sample(state.model, state.state, generator, count)


#: The registry's ``emp`` (one component per patched layer and pass) and ``ecmp`` (one per
#: element).
METHOD = EnsembleModelPatching("emp")
ECMP = EnsembleModelPatching("ecmp")
