"""The weight-space symmetry structure of a network, derived by tracing it with torch.fx.

Three kinds of objects are found:

- **Unit spaces** (permutations). A unit space is a set of channels (conv output
  channels, dense units) that one permutation must reorder everywhere at once: on the
  output axis of every tensor that *writes* them (weights, biases, BatchNorm parameters
  and statistics, per-channel PReLU slopes) and on the input axis of every tensor that
  *reads* them. Layers that write into the same residual stream are tied into one space
  by the additions. The network's input and output spaces are fixed.
- **Scale variables** (positive scalings). A scale variable multiplies what a set of
  writers produces by lambda > 0 per unit; its readers then divide by lambda. It exists
  only where everything between writers and readers is positively homogeneous (ReLU,
  LeakyReLU, PReLU, max/average pooling, dropout, flatten, additions; the table is in
  :mod:`posteriorzoo.symmetry.operations`). A normalization layer (one table,
  :func:`normalizations`: BatchNorm, Filter Response Normalization) divides each channel
  by a statistic of degree 1 in that channel, so it normalises away the scale of its
  input: the writers of that input get a scale variable (``through_batchnorm``) read by
  the layer's stored statistics instead of by a next layer (BatchNorm's running mean,
  times lambda, and variance, ``lambda**2 * (var + eps) - eps``, so that the
  normalisation is exactly the same), or by nothing where the layer computes its
  statistic from its input (FRN; a BatchNorm without running statistics). The layer's
  own per-channel parameters start a new scale variable (BatchNorm's weight and bias;
  FRN's ``gamma``, ``beta`` and threshold ``tau``: ``max(lambda y, lambda tau) =
  lambda max(y, tau)``).
- **Sign variables** (sign flips). Where everything between writers and readers is odd
  (tanh, sin, softsign, symmetric hardtanh, linear operations, additions), multiplying
  a unit's incoming weights and bias and its outgoing weights by -1 keeps the function.
  A sign variable is laid out like a scale variable, with values in {+1, -1}; units with
  both (a linear activation) may be multiplied by any nonzero real, sign times scale.
  A normalization layer whose statistic is even absorbs its input's sign by negating
  the parameters listed in its row: FRN's ``gamma`` (``x_hat`` flips with ``x``,
  ``nu2`` does not), exactly, whatever the activation. A BatchNorm could too (negating
  its running mean and its weight); that flip is not used, so that networks without odd
  activations keep exactly their former canonical forms: a BatchNorm fixes its input's
  sign, and its weight and bias start a new sign variable.

**FRN's epsilon.** FRN computes ``x / sqrt(nu2 + eps)`` with ``nu2`` the channel's mean
square over its positions, so ``FRN_eps(a x) = FRN_(eps / a**2)(x)`` exactly: a scale
``a > 0`` of its input is the same network with that channel's eps divided by ``a**2``.
The normalised values ``x_hat`` move by a factor ``r`` with ``|r - 1| <= eps / nu2 *
|1 - 1 / a**2|`` (``r**2 - 1 = eps (1 - a**-2) / (nu2 + eps a**-2)``), so each output
moves by at most ``|gamma| |x_hat| eps / nu2 |1 - 1 / a**2|`` (the threshold is
1-Lipschitz): at most 3e-5 of it for eps = 1e-6, a channel of mean square 0.1 and
``a`` within [0.5, 2], but not small for a channel whose mean square is near eps. Such a scale
variable records the eps (``epsilon``) and a note says it. The canonical representative
(``scaling="norm"``) gives each convolution output channel that feeds an FRN unit norm
over its weights and bias together: the canonical network is the original with that
channel's eps multiplied by its former squared norm.

Anything the tracer does not recognise makes the spaces and variables it touches fixed,
and is reported in :attr:`SymmetryStructure.gaps` (also in :attr:`SymmetryStructure.notes`,
which holds the informational notes too): what is removed is valid, and what is not
removed is said. :func:`warn_coverage` turns the gaps into a
:class:`SymmetryCoverageWarning`.
"""

from __future__ import annotations

import functools
import math
import operator
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import fx, nn

from posteriorzoo.errors import InvalidOptionError
from posteriorzoo.symmetry.operations import (
    OperationProperties,
    is_prelu,
    label,
    operation_properties,
    prelu_slope,
)
from posteriorzoo.symmetry.structure_types import (
    ScaleVariable,
    SignVariable,
    SymmetryCoverageWarning,
    SymmetryStructure,
    TensorAxis,
    UnitSpace,
    warn_coverage,
)

__all__ = ["Normalization", "ScaleVariable", "SignVariable", "SymmetryCoverageWarning",
           "SymmetryStructure", "TensorAxis", "UnitSpace", "trace_structure", "warn_coverage"]

_LAYERS = (nn.Conv1d, nn.Conv2d, nn.Linear)
_ADD = {operator.add, operator.iadd, torch.add}
_KINDS = ("space", "scale", "sign")


class _UnionFind:
    def __init__(self) -> None:
        self.parent: list[int] = []

    def new(self) -> int:
        self.parent.append(len(self.parent))
        return len(self.parent) - 1

    def find(self, item: int) -> int:
        while self.parent[item] != item:
            self.parent[item] = self.parent[self.parent[item]]
            item = self.parent[item]
        return item

    def union(self, a: int, b: int) -> int:
        a, b = self.find(a), self.find(b)
        if a != b:
            self.parent[max(a, b)] = min(a, b)
        return min(a, b)


@dataclass
class _Flow:
    """What a traced value carries: raw ids of its unit space, scale and sign variables,
    the entries per unit, and the bias whose shift (the softmax symmetry) reaches it as
    one constant added to every channel."""

    space: int
    scale: int
    sign: int
    block: int = 1
    bias: str | None = None


@dataclass(frozen=True)
class Normalization:
    """How one normalization layer meets the symmetries of the channels it normalises.

    ``statistics``: ``(suffix, power, epsilon)`` of the stored per-channel statistics that
    read the input's scale (as :class:`TensorAxis`); empty where the statistic is computed
    from the input, which absorbs the scale up to ``epsilon`` (0: exactly). ``parameters``:
    the per-channel tensors that write the output (permuted with the channel, scaled with
    the output, and sign-flipped with it when ``odd``), their channels on
    ``channel_axis``. ``sign_absorbers``: the parameters negated when the input's sign
    flips (none: the input's sign is fixed).
    """

    statistics: tuple[tuple[str, int, float], ...]
    parameters: tuple[str, ...]
    channel_axis: int = 0
    odd: bool = True
    sign_absorbers: tuple[str, ...] = ()
    epsilon: float = 0.0


def _batchnorm(module: nn.Module) -> Normalization:
    # running statistics: exact, read by the input's scale; without them (batch
    # statistics in every mode) the eps breaks the invariance as FRN's does. The sign flip
    # it allows is not used (see the module docstring).
    stored = module.running_mean is not None
    return Normalization(
        (("running_mean", 1, 0.0), ("running_var", 2, module.eps)) if stored else (),
        ("weight", "bias") if module.affine else (),
        epsilon=0.0 if stored else module.eps)


def _filter_response_norm(module: nn.Module) -> Normalization:
    # max(gamma x_hat + beta, tau): homogeneous in (gamma, beta, tau), not odd
    return Normalization((), ("tau", "beta", "gamma"), channel_axis=1, odd=False,
                         sign_absorbers=("gamma",), epsilon=module.eps)


@functools.cache
def normalizations() -> dict[type, Callable[[nn.Module], Normalization]]:
    """The normalization layers the tracer understands: class -> its :class:`Normalization`
    (matched with ``isinstance``; each is traced as one node, not through its forward)."""
    from posteriorzoo.models.resnet20_frn import FilterResponseNorm2d

    return {nn.BatchNorm1d: _batchnorm, nn.BatchNorm2d: _batchnorm,
            FilterResponseNorm2d: _filter_response_norm}


def _normalization(module: nn.Module | None) -> Normalization | None:
    for kind, rule in normalizations().items():
        if isinstance(module, kind):
            return rule(module)
    return None


class _NormalizationLeaves(fx.Tracer):
    """torch.fx's tracer, with every normalization layer kept as one call."""

    def is_leaf_module(self, module: nn.Module, qualified_name: str) -> bool:
        return (_normalization(module) is not None
                or super().is_leaf_module(module, qualified_name))


def _shape(meta: object) -> tuple[int, ...] | None:
    shape = getattr(meta, "shape", None)  # a tuple of outputs has no single shape
    return tuple(int(size) for size in shape) if shape is not None else None


#: torch.fx patches ``nn.Module.__call__`` and ``__getattr__`` for the whole process while
#: it traces, so a module run in another thread meanwhile is traced too, and fails. Tracing
#: holds this lock; code that runs modules while another thread may trace (the report's
#: metrics thread) takes it.
FX_TRACING = threading.RLock()


class _TensorShape(NamedTuple):
    shape: tuple[int, ...]


class _ShapeRecorder(fx.Interpreter):
    """Runs the traced graph once and records each tensor output's shape in
    ``node.meta["tensor_meta"]``, where torch.fx's ShapeProp puts it (a tuple of outputs
    gets none). ShapeProp itself imports torch's symbolic-shape machinery and SymPy on
    its first node, a third of a second of every report."""

    def run_node(self, node: fx.Node) -> object:
        result = super().run_node(node)
        if isinstance(result, torch.Tensor):
            node.meta["tensor_meta"] = _TensorShape(tuple(result.shape))
        return result


def _example_input(model: nn.Module, input_shape: tuple[int, ...]) -> torch.Tensor:
    parameter = next(model.parameters())
    return torch.zeros((2, *input_shape), dtype=parameter.dtype)


def trace_structure(model: nn.Module, input_shape: tuple[int, ...]) -> SymmetryStructure:
    """Derive the symmetry structure of ``model`` for inputs of shape ``input_shape``.

    Parameters
    ----------
    model : nn.Module
        A module torch.fx can trace.
    input_shape : tuple of int
        One input's shape, without the batch axis.

    Returns
    -------
    SymmetryStructure
    """
    with FX_TRACING:
        try:
            leaves = _NormalizationLeaves()
            traced = leaves.trace(model)
            graph = fx.GraphModule(leaves.root, traced, type(model).__name__)
        except Exception as error:  # torch.fx raises many kinds on untraceable code
            raise InvalidOptionError(f"cannot trace the model with torch.fx: {error}"
                                     ) from None
    _ShapeRecorder(graph).run(_example_input(model, input_shape))
    tracer = _Tracer()
    flows: dict[fx.Node, _Flow] = {}
    modules = dict(graph.named_modules())
    for node in graph.graph.nodes:
        module = modules.get(node.target) if node.op == "call_module" else None
        sources = [arg for arg in node.all_input_nodes if arg in flows]
        flow = tracer.visit(node, module, sources, [flows[arg] for arg in sources])
        if flow is not None:
            flows[node] = flow
    return tracer.assemble()


class _Tracer:
    """Raw ids (merged by union-find) and the tensors that write and read them."""

    def __init__(self) -> None:
        self.union = {kind: _UnionFind() for kind in _KINDS}
        self.home: dict[str, dict[int, int]] = {"scale": {}, "sign": {}}
        self.sizes: dict[int, int] = {}
        self.origin: dict[int, str] = {}
        self.writers: dict[str, list[tuple[int, TensorAxis]]] = {kind: [] for kind in _KINDS}
        self.readers: dict[str, list[tuple[int, TensorAxis]]] = {kind: [] for kind in _KINDS}
        self.fixed: dict[str, set[int]] = {kind: set() for kind in _KINDS}
        self.group_constraints: list[tuple[int, str, str, int]] = []
        #: scale variables a normalization absorbs, and the largest epsilon of those that
        #: absorb them only approximately (0: exactly)
        self.normalized: dict[int, float] = {}
        #: (layer type, epsilon) -> the layers that absorb their input's scale up to it
        self.approximate: dict[tuple[str, float], list[str]] = {}
        self.inputs: set[int] = set()
        self.notes: list[str] = []
        self.gaps: list[tuple[str, list[int]]] = []
        self.output_bias: str | None = None

    # ------------------------------------------------------------ raw ids
    def variable(self, kind: str, space: int) -> int:
        raw = self.union[kind].new()
        self.home[kind][raw] = space
        return raw

    def fresh(self, size: int, origin: str) -> _Flow:
        space = self.union["space"].new()
        self.sizes[space], self.origin[space] = size, origin
        return _Flow(space, self.variable("scale", space), self.variable("sign", space))

    def fix(self, flow: _Flow, kinds: tuple[str, ...] = _KINDS) -> None:
        for kind in kinds:
            self.fixed[kind].add(getattr(flow, kind))

    def write(self, flow: _Flow, key: str) -> None:
        for kind in _KINDS:
            self.writers[kind].append((getattr(flow, kind), TensorAxis(key, 0)))

    def read(self, flow: _Flow, key: str, groups: int) -> None:
        self.readers["space"].append((flow.space, TensorAxis(key, 1, flow.block, groups)))
        for kind in ("scale", "sign"):
            self.readers[kind].append((getattr(flow, kind),
                                       TensorAxis(key, 1, flow.block, groups, power=-1)))

    # ------------------------------------------------------------ nodes
    def visit(self, node: fx.Node, module: nn.Module | None, sources: list[fx.Node],
              inputs: list[_Flow]) -> _Flow | None:
        shape = _shape(node.meta.get("tensor_meta"))
        channels = shape[1] if shape is not None and len(shape) > 1 else 0
        if node.op == "placeholder":
            flow = self.fresh(channels, node.name)
            self.fix(flow)
            self.inputs.add(flow.space)
            return flow
        if node.op == "output":
            for flow in inputs:
                self.fix(flow)
                self.output_bias = flow.bias or self.output_bias
            return None
        if node.op == "get_attr":
            # A PReLU's slope read by F.prelu is handled with the PReLU.
            if not all(is_prelu(user) and node not in user.args[:1] for user in node.users):
                self.notes.append(f"{node.target}: a tensor used directly in the graph; "
                                  "its uses are fixed")
            return None
        if isinstance(module, _LAYERS) and len(inputs) == 1:
            return self.layer(node, module, inputs[0], channels)
        normalization = _normalization(module) if node.op == "call_module" else None
        if normalization is not None and len(inputs) == 1:
            return self.normalize(node, module, inputs[0], normalization)
        if node.target in _ADD and len(inputs) == 2:
            first, second = inputs
            return _Flow(self.union["space"].union(first.space, second.space),
                         self.union["scale"].union(first.scale, second.scale),
                         self.union["sign"].union(first.sign, second.sign), first.block,
                         first.bias or second.bias)  # a shift of either summand shifts the sum
        properties = operation_properties(node, module)
        if properties is not None and len(inputs) == 1:
            flow = self.channelwise(node, module, inputs[0], properties,
                                    _shape(sources[0].meta.get("tensor_meta")), shape)
            if flow is not None:
                return flow
        if not inputs:
            return None
        self.gaps.append((f"{node.name} ({label(node, module)})", [f.space for f in inputs]))
        for flow in inputs:
            self.fix(flow)
        if shape is None:
            return None
        flow = self.fresh(channels, node.name)
        self.fix(flow)
        return flow

    def layer(self, node: fx.Node, module: nn.Module, source: _Flow, channels: int) -> _Flow:
        groups = getattr(module, "groups", 1)
        self.read(source, f"{node.target}.weight", groups)
        flow = self.fresh(channels, node.name)
        self.write(flow, f"{node.target}.weight")
        if module.bias is not None:
            self.write(flow, f"{node.target}.bias")
            flow.bias = f"{node.target}.bias"
        if groups > 1:
            self.group_constraints.append((source.space, str(node.target), "in", groups))
            self.group_constraints.append((flow.space, str(node.target), "out", groups))
        return flow

    def normalize(self, node: fx.Node, module: nn.Module, source: _Flow,
                  rule: Normalization) -> _Flow:
        """A normalization layer: its input's scale is normalised away (read by its stored
        statistics, if any), its parameters write a new scale (and sign) variable."""
        name = str(node.target)
        for suffix, power, epsilon in rule.statistics:
            self.readers["scale"].append((source.scale, TensorAxis(
                f"{name}.{suffix}", 0, power=power, epsilon=epsilon)))
        self.normalized[source.scale] = max(self.normalized.get(source.scale, 0.0),
                                            rule.epsilon)
        for suffix in rule.sign_absorbers:
            self.readers["sign"].append((source.sign, TensorAxis(
                f"{name}.{suffix}", rule.channel_axis, power=-1)))
        if not rule.sign_absorbers:
            self.fixed["sign"].add(source.sign)  # see the module docstring
        flow = _Flow(source.space, self.variable("scale", source.space),
                     self.variable("sign", source.space))
        self.writers["space"] += [(source.space, TensorAxis(f"{name}.{suffix}", 0))
                                  for suffix, _, _ in rule.statistics]
        for suffix in rule.parameters:
            axis = TensorAxis(f"{name}.{suffix}", rule.channel_axis)
            for kind in _KINDS if rule.odd else ("space", "scale"):
                self.writers[kind].append((getattr(flow, kind), axis))
        if not rule.parameters:
            self.fix(flow, ("scale", "sign"))
        elif not rule.odd:
            self.fixed["sign"].add(flow.sign)
        if rule.epsilon:
            self.approximate.setdefault((label(node, module), rule.epsilon), []).append(name)
        return flow

    def channelwise(self, node: fx.Node, module: nn.Module | None, source: _Flow,
                    properties: OperationProperties, before: tuple[int, ...] | None,
                    after: tuple[int, ...] | None) -> _Flow | None:
        """The flow after a table operation, or None where it moves channels around."""
        if before is None or after is None or len(before) < 2 or len(after) < 2:
            return None
        if after[1] == before[1]:
            block = source.block
        elif len(after) == 2 and after[1] == math.prod(before[1:]):
            # a flatten: each channel becomes a block of its spatial positions
            block = source.block * math.prod(before[2:])
        else:
            return None
        flow = _Flow(source.space, source.scale, source.sign, block,
                     source.bias if properties.shift else None)
        if is_prelu(node, module):
            slope = prelu_slope(node, module)
            if slope is None or slope[1] not in (1, before[1]):
                return None
            if slope[1] > 1:  # one slope per channel: permuted with the channel
                self.writers["space"].append((source.space,
                                              TensorAxis(slope[0], 0, block=source.block)))
        for kind, kept in (("scale", properties.homogeneous), ("sign", properties.odd)):
            if not kept:  # the units before it keep their scale (sign); so do those after
                self.fixed[kind].add(getattr(source, kind))
                setattr(flow, kind, self.variable(kind, source.space))
                self.fixed[kind].add(getattr(flow, kind))
        if not properties.homogeneous:
            kept = "permuted and sign-flipped" if properties.odd else "permuted"
            lost = "scaled" if properties.odd else "scaled or sign-flipped"
            what = "odd but not positively homogeneous" if properties.odd else \
                "neither positively homogeneous nor odd"
            self.notes.append(f"{node.name} ({label(node, module)}): {what}; the units "
                              f"before it are {kept}, not {lost}")
        return flow

    # ------------------------------------------------------------ result
    def assemble(self) -> SymmetryStructure:
        find = self.union["space"].find
        space_ids: dict[int, int] = {}
        spaces: list[UnitSpace] = []
        for raw in sorted(self.sizes):
            root = find(raw)
            if root not in space_ids:
                space_ids[root] = len(spaces)
                spaces.append(UnitSpace(self.sizes[root]))
        for raw in self.fixed["space"]:
            spaces[space_ids[find(raw)]].fixed = True
        for raw, axis in self.writers["space"]:
            _append_unique(spaces[space_ids[find(raw)]].writers, axis)
        for raw, axis in self.readers["space"]:
            _append_unique(spaces[space_ids[find(raw)]].readers, axis)
        for raw, layer, side, groups in self.group_constraints:
            spaces[space_ids[find(raw)]].group_constraints.append((layer, side, groups))
        scales, scale_ids = self.variables("scale", ScaleVariable, space_ids)
        for raw, epsilon in self.normalized.items():
            variable = scales[scale_ids[self.union["scale"].find(raw)]]
            variable.through_batchnorm = True
            variable.epsilon = max(variable.epsilon, epsilon)
        signs, _ = self.variables("sign", SignVariable, space_ids)
        notes, gaps = list(self.notes), []
        for (kind, epsilon), names in self.approximate.items():
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3
                                            else "")
            notes.append(f"{shown} ({kind}): normalise their input's scale away up to their "
                         f"eps = {epsilon:g}: scaling a channel by a > 0 moves its normalised "
                         "values by at most eps / nu2 * |1 - 1/a^2| of themselves (nu2: the "
                         "channel's mean square)")
        for name, raws in self.gaps:
            text, lost = self.gap(name, raws, spaces, space_ids)
            notes.append(text)
            if lost:
                gaps.append(text)
        return SymmetryStructure(spaces, scales, self.output_bias, notes, signs, gaps)

    def variables(self, kind: str, factory: type, space_ids: dict[int, int]
                  ) -> tuple[list, dict[int, int]]:
        """Scale or sign variables, numbered in graph order, and their ids by root."""
        union, find_space = self.union[kind], self.union["space"].find
        ids: dict[int, int] = {}
        result: list = []

        def variable(raw: int):
            root = union.find(raw)
            if root not in ids:  # a variable belongs to the space of its first tensor
                ids[root] = len(result)
                result.append(factory(space_ids[find_space(self.home[kind][raw])]))
            return result[ids[root]]

        for raw, axis in self.writers[kind]:
            _append_unique(variable(raw).writers, axis)
        for raw, axis in self.readers[kind]:
            _append_unique(variable(raw).readers, axis)
        fixed_roots = {union.find(raw) for raw in self.fixed[kind]}
        for root, index in ids.items():
            if root in fixed_roots or not result[index].writers:
                result[index].fixed = True
        return result, ids

    def gap(self, name: str, raws: list[int], spaces: list[UnitSpace],
            space_ids: dict[int, int]) -> tuple[str, bool]:
        """The sentence for an unsupported operation reading the spaces ``raws``, and
        whether it leaves units untouched that could otherwise move."""
        find = self.union["space"].find
        inputs = {find(raw) for raw in self.inputs}
        owners: dict[str, None] = {}
        for root in dict.fromkeys(find(raw) for raw in raws):
            if root in inputs:
                continue  # the network's input is fixed anyway
            layers = [axis.key.rsplit(".", 1)[0] for axis in spaces[space_ids[root]].writers]
            owners.update(dict.fromkeys(layers or [f"the output of {self.origin[root]}"]))
        if not owners:
            return (f"{name} is not supported; it reads only the network's input, "
                    "which is fixed anyway"), False
        return (f"{name} is not supported, so the units of {', '.join(owners)} are neither "
                "permuted, scaled nor sign-flipped"), True


def _append_unique(items: list[TensorAxis], axis: TensorAxis) -> None:
    if axis not in items:
        items.append(axis)
