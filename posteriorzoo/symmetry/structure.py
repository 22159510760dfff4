"""The weight-space symmetry structure of a network, derived by tracing it with torch.fx.

Two kinds of objects are found:

- **Unit spaces** (permutations). A unit space is a set of channels (conv output
  channels, dense units) that one permutation must reorder everywhere at once: on the
  output axis of every tensor that *writes* them (weights, biases, BatchNorm parameters
  and statistics) and on the input axis of every tensor that *reads* them. Layers that
  write into the same residual stream are tied into one space by the additions.
  The network's input and output spaces are fixed.
- **Scale variables** (positive scalings). A scale variable multiplies what a set of
  writers produces by lambda > 0 per unit; its readers then divide by lambda. It exists
  only where everything between writers and readers is positively homogeneous (ReLU,
  max/average pooling, dropout, flatten, additions). A BatchNorm normalises away the scale
  of its input: the writers of that input get a scale variable read by the BatchNorm's
  running mean (times lambda) and variance (``lambda**2 * (var + eps) - eps``, so that
  the normalisation is exactly the same) instead of by a next layer. The BatchNorm's own
  weight and bias
  start a new scale variable.

Anything the tracer does not recognise makes the spaces and variables it touches fixed,
and is reported in :attr:`SymmetryStructure.notes`: what is removed is valid, and what is
not removed is said.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp

from posteriorzoo.errors import InvalidOptionError

_HOMOGENEOUS = (nn.ReLU, nn.MaxPool1d, nn.MaxPool2d, nn.AvgPool1d, nn.AvgPool2d,
                nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.Dropout, nn.Identity,
                nn.Flatten)
_HOMOGENEOUS_FUNCTIONS = {torch.relu, torch.nn.functional.relu, torch.flatten,
                          torch.nn.functional.max_pool2d, torch.nn.functional.avg_pool2d,
                          torch.nn.functional.adaptive_avg_pool2d,
                          torch.nn.functional.dropout}
_ADD = {operator.add, operator.iadd, torch.add}
_PASSTHROUGH_METHODS = {"relu", "relu_", "flatten", "view", "reshape"}


@dataclass(frozen=True)
class TensorAxis:
    """One axis of one state tensor, indexed by the units of a space.

    ``block``: each unit owns ``block`` consecutive entries (a flattened C x H x W input
    read by a dense layer). ``groups``: the tensor is a grouped convolution's weight read
    on its input axis, whose entries are local to each of ``groups`` blocks. ``power``:
    how the tensor scales with the unit's scale (1 for weights, 2 for a running variance,
    -1 for readers). ``epsilon``: a BatchNorm's epsilon, for its running variance, which
    maps to ``lambda**2 * (var + eps) - eps`` so that ``sqrt(var + eps)`` scales exactly
    by lambda (for ``lambda**2 < eps / (var + eps)`` the stored value is negative, which
    BatchNorm accepts: it only uses ``var + eps``, still positive).
    """

    key: str
    axis: int
    block: int = 1
    groups: int = 1
    power: int = 1
    epsilon: float = 0.0


@dataclass
class UnitSpace:
    """Units that one permutation reorders everywhere (see the module docstring)."""

    size: int
    writers: list[TensorAxis] = field(default_factory=list)
    readers: list[TensorAxis] = field(default_factory=list)
    fixed: bool = False
    #: grouped convolutions this space feeds (in) or leaves (out): (layer, groups).
    group_constraints: list[tuple[str, str, int]] = field(default_factory=list)


@dataclass
class ScaleVariable:
    """Units whose writers may be multiplied by lambda > 0 and readers divided by it."""

    space: int
    writers: list[TensorAxis] = field(default_factory=list)
    readers: list[TensorAxis] = field(default_factory=list)
    fixed: bool = False
    through_batchnorm: bool = False


@dataclass
class SymmetryStructure:
    """Unit spaces, scale variables, the softmax bias, and what could not be handled."""

    spaces: list[UnitSpace]
    scales: list[ScaleVariable]
    output_bias: str | None
    notes: list[str]

    def permutable(self) -> list[int]:
        """Indices of the spaces that may be permuted."""
        return [i for i, space in enumerate(self.spaces) if not space.fixed and space.size > 1]

    def fixed_group_layers(self) -> set[str]:
        """Grouped layers with a fixed space on either side: their groups may not be swapped."""
        return {layer for space in self.spaces if space.fixed
                for layer, _, _ in space.group_constraints}

    def scalable(self) -> list[int]:
        """Indices of the scale variables that may be scaled."""
        return [i for i, var in enumerate(self.scales)
                if not var.fixed and not self.spaces[var.space].fixed and var.readers]


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
    """What a traced value carries: its unit space and scale variable (raw ids)."""

    space: int
    scale: int
    block: int = 1


def _example_input(model: nn.Module, input_shape: tuple[int, ...]) -> torch.Tensor:
    parameter = next(model.parameters())
    return torch.zeros((2, *input_shape), dtype=parameter.dtype)


def trace_structure(model: nn.Module, input_shape: tuple[int, ...]) -> SymmetryStructure:
    """Derive the symmetry structure of ``model`` for inputs of shape ``input_shape``."""
    try:
        graph = fx.symbolic_trace(model)
    except Exception as error:  # torch.fx raises many kinds on untraceable code
        raise InvalidOptionError(f"cannot trace the model with torch.fx: {error}") from None
    ShapeProp(graph).propagate(_example_input(model, input_shape))
    spaces, scales = _UnionFind(), _UnionFind()
    sizes: dict[int, int] = {}
    writers: dict[str, list[tuple[int, TensorAxis]]] = {"space": [], "scale": []}
    readers: dict[str, list[tuple[int, TensorAxis]]] = {"space": [], "scale": []}
    fixed_spaces: set[int] = set()
    fixed_scales: set[int] = set()
    group_constraints: list[tuple[int, str, str, int]] = []
    batchnorm_scales: set[int] = set()
    notes: list[str] = []
    flows: dict[fx.Node, _Flow] = {}
    modules = dict(graph.named_modules())
    bias_of_space: dict[int, str] = {}
    output_bias = None

    scale_home: dict[int, int] = {}

    def new_scale(space: int) -> int:
        scale = scales.new()
        scale_home[scale] = space
        return scale

    def fresh(size: int) -> _Flow:
        space = spaces.new()
        sizes[space] = size
        return _Flow(space, new_scale(space))

    def write(flow: _Flow, key: str, power: int = 1, scale: bool = True) -> None:
        writers["space"].append((flow.space, TensorAxis(key, 0)))
        if scale:
            writers["scale"].append((flow.scale, TensorAxis(key, 0, power=power)))

    for node in graph.graph.nodes:
        meta = node.meta.get("tensor_meta")
        channels = int(meta.shape[1]) if meta is not None and len(meta.shape) > 1 else 0
        inputs = [flows[arg] for arg in node.all_input_nodes if arg in flows]
        if node.op == "placeholder":
            flows[node] = fresh(channels)
            fixed_spaces.add(flows[node].space)
            fixed_scales.add(flows[node].scale)
            continue
        if node.op == "output":
            for flow in inputs:
                fixed_spaces.add(flow.space)
                fixed_scales.add(flow.scale)
                output_bias = bias_of_space.get(flow.space, output_bias)
            continue
        if node.op == "get_attr":
            notes.append(f"{node.target}: a tensor used directly in the graph; its uses are fixed")
            continue
        module = modules.get(node.target) if node.op == "call_module" else None
        if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Linear)) and len(inputs) == 1:
            source = inputs[0]
            groups = getattr(module, "groups", 1)
            reader = TensorAxis(f"{node.target}.weight", 1, block=source.block, groups=groups)
            readers["space"].append((source.space, reader))
            readers["scale"].append((source.scale, TensorAxis(reader.key, 1, source.block,
                                                              groups, power=-1)))
            flow = fresh(channels)
            write(flow, f"{node.target}.weight")
            if module.bias is not None:
                write(flow, f"{node.target}.bias")
                bias_of_space[flow.space] = f"{node.target}.bias"
            if groups > 1:
                group_constraints.append((source.space, node.target, "in", groups))
                group_constraints.append((flow.space, node.target, "out", groups))
            flows[node] = flow
        elif isinstance(module, (nn.BatchNorm1d, nn.BatchNorm2d)) and len(inputs) == 1:
            source = inputs[0]
            name = node.target
            # The input's scale is normalised away: the running statistics read it.
            readers["scale"].append((source.scale, TensorAxis(f"{name}.running_mean", 0,
                                                              power=1)))
            readers["scale"].append((source.scale, TensorAxis(f"{name}.running_var", 0,
                                                              power=2, epsilon=module.eps)))
            batchnorm_scales.add(source.scale)
            flow = _Flow(source.space, new_scale(source.space))
            writers["space"] += [(source.space, TensorAxis(f"{name}.{suffix}", 0))
                                 for suffix in ("running_mean", "running_var")]
            if module.affine:
                write(flow, f"{name}.weight")
                write(flow, f"{name}.bias")
            else:
                fixed_scales.add(flow.scale)
            flows[node] = flow
        elif (isinstance(module, _HOMOGENEOUS) or node.target in _HOMOGENEOUS_FUNCTIONS
              or (node.op == "call_method" and node.target in _PASSTHROUGH_METHODS)):
            flows[node] = _passthrough(node, inputs, meta)
        elif node.target in _ADD and len(inputs) == 2:
            space = spaces.union(inputs[0].space, inputs[1].space)
            scale = scales.union(inputs[0].scale, inputs[1].scale)
            flows[node] = _Flow(space, scale, inputs[0].block)
        elif inputs:
            label = type(module).__name__ if module is not None else str(node.target)
            # A permutation still commutes with any elementwise activation, but a scaling
            # does not; anything else fixes both.
            if module is not None and _elementwise(module):
                notes.append(f"{node.name} ({label}): not positively homogeneous; "
                             "units before it are permuted but not scaled")
                for flow in inputs:
                    fixed_scales.add(flow.scale)
                flow = _Flow(inputs[0].space, new_scale(inputs[0].space), inputs[0].block)
                fixed_scales.add(flow.scale)
                flows[node] = flow
            else:
                notes.append(f"{node.name} ({label}): unsupported operation; the units "
                             "around it are neither permuted nor scaled")
                for flow in inputs:
                    fixed_spaces.add(flow.space)
                    fixed_scales.add(flow.scale)
                if meta is not None:
                    flow = fresh(channels)
                    fixed_spaces.add(flow.space)
                    fixed_scales.add(flow.scale)
                    flows[node] = flow
    return _assemble(spaces, scales, sizes, scale_home, writers, readers, fixed_spaces,
                     fixed_scales, group_constraints, batchnorm_scales, output_bias, notes)


def _elementwise(module: nn.Module) -> bool:
    return isinstance(module, (nn.Tanh, nn.Sigmoid, nn.GELU, nn.ELU, nn.SiLU, nn.LeakyReLU,
                               nn.Softplus, nn.Hardtanh))


def _passthrough(node: fx.Node, inputs: list[_Flow], meta: object) -> _Flow:
    source = inputs[0]
    input_meta = node.all_input_nodes[0].meta.get("tensor_meta")
    block = source.block
    if input_meta is not None and meta is not None and len(input_meta.shape) > len(meta.shape):
        # flatten: each channel becomes a block of its spatial positions
        spatial = 1
        for size in input_meta.shape[2:]:
            spatial *= int(size)
        block = source.block * spatial
    return _Flow(source.space, source.scale, block)


def _assemble(spaces: _UnionFind, scales: _UnionFind, sizes: dict[int, int],
              scale_home: dict[int, int], writers: dict, readers: dict,
              fixed_spaces: set[int], fixed_scales: set[int],
              group_constraints: list, batchnorm_scales: set[int], output_bias: str | None,
              notes: list[str]) -> SymmetryStructure:
    space_ids: dict[int, int] = {}
    result_spaces: list[UnitSpace] = []
    for raw in sorted(sizes):
        root = spaces.find(raw)
        if root not in space_ids:
            space_ids[root] = len(result_spaces)
            result_spaces.append(UnitSpace(sizes[root]))
    for raw in fixed_spaces:
        result_spaces[space_ids[spaces.find(raw)]].fixed = True
    for raw, axis in writers["space"]:
        _append_unique(result_spaces[space_ids[spaces.find(raw)]].writers, axis)
    for raw, axis in readers["space"]:
        _append_unique(result_spaces[space_ids[spaces.find(raw)]].readers, axis)
    for raw, layer, side, groups in group_constraints:
        result_spaces[space_ids[spaces.find(raw)]].group_constraints.append((layer, side, groups))

    # a scale variable belongs to the space of the tensors that write it
    scale_ids: dict[int, int] = {}
    result_scales: list[ScaleVariable] = []

    def variable(raw: int) -> ScaleVariable:
        root = scales.find(raw)
        if root not in scale_ids:
            scale_ids[root] = len(result_scales)
            result_scales.append(ScaleVariable(space_ids[spaces.find(scale_home[raw])]))
        return result_scales[scale_ids[root]]

    for raw, axis in writers["scale"]:
        _append_unique(variable(raw).writers, axis)
    for raw, axis in readers["scale"]:
        target = variable(raw)
        _append_unique(target.readers, axis)
        if scales.find(raw) in {scales.find(b) for b in batchnorm_scales}:
            target.through_batchnorm = True
    fixed_roots = {scales.find(raw) for raw in fixed_scales}
    for root, index in scale_ids.items():
        var = result_scales[index]
        if root in fixed_roots or not var.writers:
            var.fixed = True
    return SymmetryStructure(result_spaces, result_scales, output_bias, notes)


def _append_unique(items: list[TensorAxis], axis: TensorAxis) -> None:
    if axis not in items:
        items.append(axis)
