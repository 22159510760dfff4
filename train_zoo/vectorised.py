"""Many small models trained in lockstep on one device (torch.func over stacked parameters).

The vectorised engine trains a group of checkpoints of one spec together: the parameters
of the M models are stacked along a new leading axis, and one call of
``vmap(grad_and_value(loss))`` computes the M losses and gradients on a batch tensor of
shape ``(M, B, C, H, W)``. Everything else reproduces :mod:`train_zoo.torch_engine`:

* model m starts from ``initial_model(spec, checkpoint_seeds(base_seed, i_m).init)``;
* its batches come from its own ``iterate_batches(..., seed=seeds.data, epoch=epoch)``
  with the recipe's augmentation (all models have the same N, so the last, smaller batch
  of an epoch has the same size B' for every model);
* dropout masks are drawn as ``torch.nn.functional.dropout`` draws them on CPU (one
  ``bernoulli_(1 - p)`` of the input's shape per call, then ``div_(1 - p)``), from a
  per-model ``torch.Generator`` seeded with ``seeds.noise``, the same stream the torch
  engine's ``torch.manual_seed(seeds.noise)`` gives;
* the update is ``torch.optim.SGD``'s single-tensor rule (weight decay, momentum,
  dampening 0, Nesterov) applied elementwise to the stacked tensors, with the learning rate
  of :meth:`Recipe.learning_rate` per epoch;
* a model whose mini-batch loss is non-finite takes that step and is then frozen, as the
  torch engine stops training such a checkpoint;
* each trained model is loaded into a module and packaged by
  :func:`train_zoo.torch_engine.finish` (same metrics, same result format).

Weights agree with the torch engine's to rounding, not bit for bit: under ``vmap`` a
convolution becomes one grouped convolution over all models and a linear layer a batched
matrix product, whose summation order differs from the single-model kernels. On a GPU the
same code fills the device with OptuNets (pass ``device="cuda"``).

Supported: architectures without buffers (no BatchNorm) whose only random layer is
``nn.Dropout``: ``optunet``, ``optunet-v1`` and ``mlp``. Everything else falls back to
the torch engine (``supports`` returns False).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

import numpy as np
import torch
from torch import Tensor, nn
from torch.func import functional_call, grad_and_value, vmap

from posteriorzoo.data import iterate_batches
from posteriorzoo.errors import InvalidOptionError
from train_zoo.data import TrainingData, train_transform
from train_zoo.loop import fit
from train_zoo.result import CheckpointResult
from train_zoo.seeds import CheckpointSeeds, checkpoint_seeds
from train_zoo.spec import ZooSpec
from train_zoo.torch_engine import finish, initial_model

__all__ = ["supports", "train_vectorised", "unsupported_reason"]

#: Architectures whose forward pass is known to draw randomness only through nn.Dropout
#: modules (a forward calling torch.nn.functional.dropout directly could not be replayed).
VERIFIED_ARCHITECTURES = frozenset({"optunet", "optunet-v1", "mlp"})

#: Module types with a deterministic forward and no state besides parameters.
_DETERMINISTIC = (nn.Conv1d, nn.Conv2d, nn.Linear, nn.ReLU, nn.MaxPool2d,
                  nn.AdaptiveAvgPool2d, nn.AvgPool2d, nn.Flatten, nn.Identity)
_CONTAINERS = (nn.Sequential, nn.ModuleList)


def unsupported_reason(spec: ZooSpec) -> str | None:
    """Why the vectorised engine cannot train ``spec`` exactly as the torch engine, or None."""
    if spec.architecture not in VERIFIED_ARCHITECTURES:
        return (f"{spec.architecture} is not one of the verified architectures "
                f"{', '.join(sorted(VERIFIED_ARCHITECTURES))}")
    with torch.device("meta"):
        model = initial_model(spec, 0)
    if any(True for _ in model.buffers()):
        return "the model has buffers (e.g. BatchNorm running statistics)"
    for name, module in model.named_modules():
        if module is model or isinstance(module, _CONTAINERS + _DETERMINISTIC):
            continue
        if type(module) is nn.Dropout:
            continue
        return f"module {name!r} of type {type(module).__name__} is not supported"
    return None


def supports(spec: ZooSpec) -> bool:
    """Whether ``spec`` can be trained by the vectorised engine (see :func:`unsupported_reason`)."""
    return unsupported_reason(spec) is None


# ----------------------------------------------------------------------------- dropout


@dataclass
class _MaskTape:
    """Dropout masks of one forward pass, consumed in call order.

    In ``recording`` mode (a probe forward of one model, no vmap) each dropout call
    records ``(shape, dtype, p)`` of its input instead of dropping anything.
    """

    recording: bool = False
    calls: list[tuple[torch.Size, torch.dtype, float]] = field(default_factory=list)
    masks: Sequence[Tensor] = ()
    position: int = 0

    def drop(self, x: Tensor, p: float) -> Tensor:
        if p == 1.0:  # torch: input * 0, no random draw
            return x * torch.zeros((), dtype=x.dtype, device=x.device)
        if self.recording:
            self.calls.append((x.shape, x.dtype, p))
            return x
        mask = self.masks[self.position]
        self.position += 1
        return x * mask


class _ReplayDropout(nn.Module):
    """Stands in for ``nn.Dropout(p)``: multiplies by the next mask of a shared tape."""

    def __init__(self, p: float, tape: _MaskTape) -> None:
        super().__init__()
        self.p = float(p)
        self.tape = tape

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0 or x.numel() == 0:
            return x
        return self.tape.drop(x, self.p)


def _replay_skeleton(model: nn.Module, tape: _MaskTape) -> nn.Module:
    """A copy of ``model`` whose ``nn.Dropout`` modules read masks from ``tape``."""
    skeleton = copy.deepcopy(model)
    targets = [name for name, module in skeleton.named_modules()
               if type(module) is nn.Dropout]
    for name in targets:
        parent_name, _, child = name.rpartition(".")
        parent = skeleton.get_submodule(parent_name)
        dropout = cast(nn.Dropout, parent.get_submodule(child))  # targets are nn.Dropout
        setattr(parent, child, _ReplayDropout(dropout.p, tape))
    return skeleton.train()


def _draw_masks(calls: Sequence[tuple[torch.Size, torch.dtype, float]],
                generators: Sequence[torch.Generator], device: torch.device) -> list[Tensor]:
    """Per call k, the stacked masks ``(M, *shape_k)`` of the M models.

    Model m's masks are drawn from ``generators[m]`` in call order, exactly as the CPU
    kernel of ``torch.nn.functional.dropout`` draws them from the global generator:
    ``empty(shape).bernoulli_(1 - p)`` then ``div_(1 - p)``.
    """
    per_call: list[list[Tensor]] = [[] for _ in calls]
    for generator in generators:
        for k, (shape, dtype, p) in enumerate(calls):
            noise = torch.empty(shape, dtype=dtype).bernoulli_(1 - p, generator=generator)
            per_call[k].append(noise.div_(1 - p))
    return [torch.stack(masks).to(device) for masks in per_call]


# ----------------------------------------------------------------------------- SGD


@dataclass
class _StackedSGD:
    """``torch.optim.SGD`` (single-tensor path, dampening 0) on stacked parameters.

    Every tensor has shape ``(M, *parameter_shape)``; the update is elementwise, so model
    m's slice follows exactly the rule torch applies to model m alone.
    """

    momentum: float
    nesterov: bool
    weight_decay: float
    buffers: dict[str, Tensor] = field(default_factory=dict)

    def step(self, params: dict[str, Tensor], grads: dict[str, Tensor], lr: float,
             active: Tensor | None) -> dict[str, Tensor]:
        """New parameters after one step; ``active`` (bool, shape (M,)) freezes the others."""
        updated = {}
        for key, param in params.items():
            grad = grads[key]
            if self.weight_decay != 0:
                grad = grad.add(param, alpha=self.weight_decay)
            if self.momentum != 0:
                buf = self.buffers.get(key)
                if buf is None:
                    buf = grad.detach().clone()
                    self.buffers[key] = buf
                else:
                    buf.mul_(self.momentum).add_(grad, alpha=1)
                grad = grad.add(buf, alpha=self.momentum) if self.nesterov else buf
            new = param.add(grad, alpha=-lr)
            if active is not None:
                new = torch.where(active.view(-1, *([1] * (param.ndim - 1))), new, param)
            updated[key] = new
        return updated


class _StackedStepper:
    """M stacked models as one stepper of :func:`train_zoo.loop.fit`.

    A batch is the M models' own batches (one per model, same size B); ``step`` returns
    their mean loss. A model whose loss is non-finite takes that step and is then frozen,
    as the torch engine stops such a checkpoint; the stepper stops when all are frozen.
    """

    def __init__(self, batched_step, params: dict[str, Tensor], optimizer: _StackedSGD,
                 probe, generators: list[torch.Generator], device: torch.device) -> None:
        self.batched_step = batched_step
        self.params = params
        self.optimizer = optimizer
        self.probe = probe
        self.generators = generators
        self.device = device
        count = len(generators)
        self.steps = torch.zeros(count, dtype=torch.int64)
        self.active = torch.ones(count, dtype=torch.bool)
        self.stopped = False
        self._dropout_calls: dict[int, list[tuple[torch.Size, torch.dtype, float]]] = {}

    def step(self, batches, lr: float) -> float:
        images = torch.stack([b[0] for b in batches]).to(self.device)  # (M, B, C, H, W)
        labels = torch.stack([b[1] for b in batches]).to(self.device)  # (M, B)
        size = images.shape[1]
        if size not in self._dropout_calls:  # shapes of the dropout inputs for batch size B
            self._dropout_calls[size] = self.probe(size, images[0, :1])
        masks = _draw_masks(self._dropout_calls[size], self.generators, self.device)
        grads, losses = self.batched_step(self.params, images, labels, masks)
        self.params = self.optimizer.step(self.params, grads, lr,
                                          None if bool(self.active.all())
                                          else self.active.to(self.device))
        self.steps += self.active
        self.active &= torch.isfinite(losses.detach()).cpu()
        self.stopped = not bool(self.active.any())
        return float(losses.detach().mean())

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: value.detach().cpu().numpy() for name, value in self.params.items()}


# ----------------------------------------------------------------------------- training


def train_vectorised(spec: ZooSpec, indices: Sequence[int], data: TrainingData,
                     device: str | torch.device = "cpu") -> list[CheckpointResult]:
    """Train checkpoints ``indices`` of ``spec`` together; results in the order of ``indices``.

    Parameters
    ----------
    spec : ZooSpec
        A spec for which :func:`supports` is true.
    indices : sequence of int
        The M checkpoints of the group (any order; each result depends only on its index).
    data : TrainingData
        Train and test splits (CPU arrays); batches are built on CPU and moved to ``device``.
    device : str or torch.device, default "cpu"
        Where the stacked parameters (M, ...) and batches (M, B, C, H, W) live.

    Returns
    -------
    list of CheckpointResult
        ``engine == "vectorised"``; ``wall_time`` is the group's training time divided by
        M plus the checkpoint's own evaluation time.
    """
    reason = unsupported_reason(spec)
    if reason is not None:
        raise InvalidOptionError(f"the vectorised engine cannot train this spec: {reason}")
    indices = [int(i) for i in indices]
    if not indices:
        return []
    started = time.perf_counter()
    device = torch.device(device)
    recipe = spec.recipe
    seeds: list[CheckpointSeeds] = [checkpoint_seeds(spec.base_seed, i) for i in indices]
    models = [initial_model(spec, s.init) for s in seeds]
    tape = _MaskTape()
    skeleton = _replay_skeleton(models[0], tape).to(device)
    names = [name for name, _ in models[0].named_parameters()]
    # (M, *shape) per parameter name.
    params = {name: torch.stack([dict(m.named_parameters())[name].detach() for m in models])
              .to(device) for name in names}
    generators = []
    for s in seeds:
        generator = torch.Generator()
        generator.manual_seed(s.noise)
        generators.append(generator)

    def loss(model_params: dict[str, Tensor], images: Tensor, labels: Tensor,
             masks: list[Tensor]) -> Tensor:
        # One model: images (B, C, H, W), labels (B,), masks[k] of the k-th dropout call.
        tape.recording, tape.masks, tape.position = False, masks, 0
        logits = functional_call(skeleton, model_params, (images,))
        return nn.functional.cross_entropy(logits, labels)

    stepper: _StackedStepper  # its probe below reads stepper.params
    stepper = _StackedStepper(vmap(grad_and_value(loss), in_dims=(0, 0, 0, 0)), params,
                              _StackedSGD(recipe.momentum, recipe.nesterov,
                                          recipe.weight_decay),
                              lambda size, images: _probe_dropout(skeleton, tape, stepper.params,
                                                                  images, size),
                              generators, device)
    augment = train_transform(recipe, data.train)

    def batches(epoch: int):
        streams = [iterate_batches(data.train, recipe.batch_size, seed=s.data, epoch=epoch,
                                   transform=augment) for s in seeds]
        return zip(*streams, strict=True)

    fit(stepper, batches, recipe.learning_rate, recipe.epochs)
    params, steps, count = stepper.params, stepper.steps, len(indices)

    share = (time.perf_counter() - started) / count
    results = []
    for m, (index, model) in enumerate(zip(indices, models, strict=True)):
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(params[name][m].cpu())
        results.append(finish(spec, index, model, seeds[m], int(steps[m]),
                              time.perf_counter() - share, "vectorised", data))
    return results


def _probe_dropout(skeleton: nn.Module, tape: _MaskTape, params: dict[str, Tensor],
                   example: Tensor, size: int) -> list[tuple[torch.Size, torch.dtype, float]]:
    """The (shape, dtype, p) of every dropout call of one model's forward on ``size`` inputs.

    ``example`` is one input ``(1, C, H, W)``; it is repeated to a batch of ``size``.
    """
    tape.recording, tape.calls = True, []
    try:
        with torch.no_grad():
            single = {name: value[0] for name, value in params.items()}
            functional_call(skeleton, single, (example.expand(size, *example.shape[1:]),))
        return list(tape.calls)
    finally:
        tape.recording = False
