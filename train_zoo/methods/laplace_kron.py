"""KFAC over every layer for :mod:`train_zoo.methods.laplace` (``structure="kfac"``).

The GGN ``sum_n J_n^T H_n J_n`` is approximated block-diagonally, one block per parameter
tensor of every ``nn.Linear`` and ``nn.Conv2d`` module, each block Kronecker-factored as
laplace-torch 0.3 does it with its BackPACK backend (``KFLR``: the exact GGN square root,
not a sampled one):

``Linear`` (weight ``(O, I)``, bias ``(O,)``; input ``a_n`` ``(I,)``, the GGN factor rows of
the layer's output ``s_nk = V_nk J^out_n`` ``(O,)``, ``k < K - 1``)::

    weight: kron(B, A),  B = sum_n sum_k s_nk s_nk^T  (O, O),  A = sum_n a_n a_n^T / N
    bias:   B

``Conv2d`` (weight ``(O, C / g, kh, kw)``, ``g`` groups; the input unfolded into patches
``x_nt`` ``(C kh kw,)`` at the ``T`` output positions ``t``; ``s_nkt`` ``(O,)`` the rows of
the output at ``t``), the KFC "expansion" of Grosse & Martens (2016) in BackPACK's
scaling, whose output factor is the exact GGN of the bias (the rows summed over the
positions before their outer product)::

    B = sum_n sum_k (sum_t s_nkt)(sum_t s_nkt)^T  (O, O),   A = sum_n sum_t x_nt x_nt^T / N

Both factors sum over the positions, so against the KFC paper's ``Gamma`` (a mean over
positions) this ``B`` is ``T`` times larger, as BackPACK's documentation notes: the
convolutions' curvature is counted up to ``T`` times (on OptuNet's first convolution,
``T = 625``, the diagonal of ``kron(B, A)`` was about 47 times the GGN's, measured), which
makes their blocks of the posterior narrower than the full GGN's. It is kept to match
laplace-torch's numbers.

With ``g > 1`` groups (BackPACK refuses them; Curvlinops averages ``A`` over the groups)
the weight is ``g`` blocks, one per group ``j``: ``kron(B_j, A_j)`` with ``B_j`` the group's
``O / g`` rows and columns of ``B`` and ``A_j`` from the group's ``C / g`` input channels
only; for ``g = 1`` this is BackPACK's block. A weight flattened row-major has index
``o * I + i``, so ``kron(B, A)`` is its block as laplace-torch's ``Kron`` lays it out.

The posterior precision of a block is ``kron(B, A) + delta I`` (laplace-torch's
``KronDecomposed`` without damping): with ``B = U diag(beta) U^T`` and ``A = V diag(alpha)
V^T`` its eigenvalues are ``beta_o alpha_i + delta`` and a draw is
``W* + U (Z / sqrt(beta alpha^T + delta)) V^T``, ``Z ~ N(0, I)`` ``(O, I)``.

Only the parameters of these modules can vary: a network with any other parameter
(BatchNorm's scale and shift, ...) is refused, as is a module run twice in one forward
pass (shared weights) or a ``Linear`` with inputs of more than two dimensions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional

from posteriorzoo.errors import InvalidOptionError
from train_zoo.methods.common import logits
from train_zoo.methods.laplace_curvature import (
    Batch,
    _check_classes,
    _chunks,
    _EvalMode,
    _nll,
    clipped_eigh,
    positive_int,
    softmax_hessian_factor,
)

__all__ = ["KronBlock", "LayerFactors", "LayerKronCurvature", "kron_layers",
           "layer_kron_curvature", "uncovered_parameters"]

_LAYERS = (nn.Linear, nn.Conv2d)
Layer = nn.Linear | nn.Conv2d   # the modules "kfac" covers, as _LAYERS
#: ``(values, vectors)`` of a symmetric factor.
Eigen = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class KronBlock:
    """One diagonal block of the KFAC GGN: ``kron(B, A)`` or, without ``A``, ``B`` itself.

    Attributes
    ----------
    name : str
        The parameter the block belongs to (a grouped convolution's weight has one block
        per group, consecutive in the flattened weight).
    out_factor : torch.Tensor
        ``B`` ``(p, p)`` float64 (scaled to ``num_data``).
    in_factor : torch.Tensor or None
        ``A`` ``(q, q)`` float64 (a mean over the examples), None for a bias.
    out_eigen, in_eigen : tuple of torch.Tensor
        ``(values, vectors)`` of ``B`` and ``A`` (values clipped at 0); ``in_eigen`` None
        for a bias.
    """

    name: str
    out_factor: torch.Tensor
    in_factor: torch.Tensor | None
    out_eigen: tuple[torch.Tensor, torch.Tensor]
    in_eigen: tuple[torch.Tensor, torch.Tensor] | None

    @property
    def size(self) -> int:
        """The block's number of parameters, ``p q`` or ``p``."""
        inner = 1 if self.in_factor is None else len(self.in_factor)
        return len(self.out_factor) * inner

    def eigenvalues(self) -> torch.Tensor:
        """``beta_o alpha_i`` (row-major in ``(o, i)``) or ``beta``, float64."""
        if self.in_eigen is None:
            return self.out_eigen[0]
        return torch.outer(self.out_eigen[0], self.in_eigen[0]).reshape(-1)

    def matrix(self) -> torch.Tensor:
        """The dense block ``kron(B, A)`` or ``B`` (for checks on small layers)."""
        if self.in_factor is None:
            return self.out_factor
        return torch.kron(self.out_factor, self.in_factor)

    def normals(self, generator: torch.Generator) -> torch.Tensor:
        """The block's ``Z ~ N(0, I)`` for one draw: ``(p, q)`` or ``(p,)`` float64."""
        shape = ((len(self.out_factor),) if self.in_factor is None
                 else (len(self.out_factor), len(self.in_factor)))
        return torch.randn(shape, generator=generator, dtype=torch.float64)

    def steps(self, normals: torch.Tensor, delta: float) -> torch.Tensor:
        """``P_block^-1/2 z`` for stacked normals ``(S, p, q)`` or ``(S, p)``: ``(S, size)``."""
        beta, u = self.out_eigen
        if self.in_eigen is None:
            return (normals * (beta + delta).rsqrt()) @ u.T
        alpha, v = self.in_eigen
        scale = (torch.outer(beta, alpha) + delta).rsqrt()
        return (u @ (normals * scale) @ v.T).reshape(len(normals), -1)


@dataclass(frozen=True)
class LayerKronCurvature:
    """KFAC over every ``Linear`` and ``Conv2d`` layer: the blocks in parameter order.

    Attributes
    ----------
    layers : tuple of str
        The modules' names.
    blocks : tuple of KronBlock
        One per parameter tensor (per group for a grouped convolution's weight), in the
        order of the flattened parameters.
    """

    layers: tuple[str, ...]
    blocks: tuple[KronBlock, ...]

    def eigenvalues(self) -> torch.Tensor:
        """The eigenvalues of the block-diagonal GGN approximation, ``(D,)`` float64."""
        return torch.cat([block.eigenvalues() for block in self.blocks])

    def matrix(self) -> torch.Tensor:
        """The dense block-diagonal GGN approximation ``(D, D)`` float64 (small nets only)."""
        return torch.block_diag(*[block.matrix() for block in self.blocks])

    def draw(self, generator: torch.Generator, count: int, delta: float) -> torch.Tensor:
        """``count`` steps ``P^-1/2 z`` ``(count, D)``; each draw takes its normals block
        after block, so draw ``s`` does not depend on ``count``."""
        normals: list[list[torch.Tensor]] = [[] for _ in self.blocks]
        for _ in range(count):
            for held, block in zip(normals, self.blocks, strict=True):
                held.append(block.normals(generator))
        return torch.cat([block.steps(torch.stack(held), delta)
                          for held, block in zip(normals, self.blocks, strict=True)], dim=1)


@dataclass(frozen=True)
class LayerFactors:
    """The unscaled sums of one layer: ``B`` ``(O, O)`` and, per group, ``A_j`` (not yet
    divided by the example count), float64."""

    name: str
    module: nn.Module
    out_sum: torch.Tensor
    in_sums: tuple[torch.Tensor, ...]


def _parameter(layer: str, name: str) -> str:
    return f"{layer}.{name}" if layer else name


def uncovered_parameters(model: nn.Module) -> list[tuple[str, str]]:
    """``(parameter, owning module's type)`` for every parameter of ``model`` outside a
    ``Linear`` or ``Conv2d`` module: what ``"kfac"`` cannot cover (works on the ``meta``
    device, so a spec can be checked before any training)."""
    result: list[tuple[str, str]] = []
    for name, module in model.named_modules():
        if not isinstance(module, _LAYERS):
            result.extend((_parameter(name, p), type(module).__name__)
                          for p, _ in module.named_parameters(recurse=False))
    return result


def _layers(model: nn.Module, params: Mapping[str, torch.Tensor]) -> list[tuple[str, Layer]]:
    """The ``Linear`` and ``Conv2d`` modules, after checking they own every parameter."""
    layers: list[tuple[str, Layer]] = []
    owned: set[str] = set()
    for name, module in model.named_modules():
        if isinstance(module, _LAYERS):
            layers.append((name, module))
            owned.update(_parameter(name, p) for p, _ in module.named_parameters(recurse=False))
    other = [name for name in params if name not in owned]
    if other:
        owners = dict(uncovered_parameters(model))
        kind = f" (of a {owners[other[0]]})" if other[0] in owners else ""
        raise InvalidOptionError(
            f"laplace option 'structure'='kfac' covers Linear and Conv2d layers only, but the "
            f"network also has parameter {other[0]!r}{kind}: use 'diag' or 'last-layer-kfac'")
    return layers


def _patches(module: nn.Conv2d, inputs: torch.Tensor) -> torch.Tensor:
    """The convolution's input patches ``(B, C kh kw, T)``, padded as its forward pass."""
    mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
    padded = functional.pad(inputs, module._reversed_padding_repeated_twice, mode=mode)
    return functional.unfold(padded, module.kernel_size, dilation=module.dilation,
                             stride=module.stride)


def kron_layers(model: nn.Module, params: Mapping[str, torch.Tensor],
                buffers: Mapping[str, torch.Tensor], batches: Iterable[Batch], *,
                chunk_size: int = 256) -> tuple[list[LayerFactors], float, int]:
    """The unscaled Kronecker factors of every ``Linear`` and ``Conv2d`` layer.

    Forward hooks record each layer's input and output; for each of the ``K - 1`` rows of
    the softmax Hessian factor (:func:`softmax_hessian_factor`) one backward pass from the
    logits gives every layer's output rows ``s_nk`` at once (the examples are independent
    in eval mode). Per chunk the sums are taken in the network's dtype, then added in
    float64.

    Returns
    -------
    factors : list of LayerFactors
        One per layer, in ``model.named_modules()`` order.
    nll : float
        Summed cross-entropy, in nats.
    count : int
        Number of examples ``n``.
    """
    chunk_size = positive_int(chunk_size, "chunk_size")
    params = {name: value.detach() for name, value in params.items()}
    buffers = dict(buffers)
    layers = _layers(model, params)
    out_sums: dict[str, torch.Tensor] = {}
    in_sums: dict[str, torch.Tensor] = {}
    nll, count = 0.0, 0
    records: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def hook(module: nn.Module, inputs: tuple, output: torch.Tensor, name: str
             ) -> torch.Tensor:
        if name in records:
            raise InvalidOptionError(f"laplace option 'structure'='kfac' needs each layer to "
                                     f"run once per forward pass; {name!r} runs twice")
        if isinstance(module, nn.Linear) and inputs[0].dim() != 2:
            raise InvalidOptionError(f"laplace option 'structure'='kfac' needs 2-d inputs "
                                     f"to Linear layers; {name!r} gets "
                                     f"{inputs[0].dim()}-d ones")
        records[name] = (inputs[0].detach(), output)
        return output.clone()     # an in-place op after the layer must not change `output`

    handles = [module.register_forward_hook(
        lambda m, i, o, name=name: hook(m, i, o, name)) for name, module in layers]
    try:
        with _EvalMode(model), torch.enable_grad():
            for images, labels in _chunks(batches, chunk_size):
                records.clear()
                x = images.detach().clone().requires_grad_(True)
                out = logits(model, params, buffers, x)
                _check_classes(out)
                factor = softmax_hessian_factor(out.detach()).to(out.dtype)  # (B, K - 1, K)
                names = [name for name, _ in layers if name in records]
                outputs = [records[name][1] for name in names]
                rows: dict[str, list[torch.Tensor]] = {name: [] for name in names}
                for k in range(factor.shape[1]):
                    grads = torch.autograd.grad(out, outputs, grad_outputs=factor[:, k],
                                                retain_graph=True, allow_unused=True)
                    for name, grad, output in zip(names, grads, outputs, strict=True):
                        grad = torch.zeros_like(output) if grad is None else grad
                        rows[name].append(grad.reshape(len(grad), grad.shape[1], -1).sum(-1))
                modules = dict(layers)
                for name in names:
                    stacked = torch.cat(rows[name]).double()              # ((K - 1) B, O)
                    _add(out_sums, name, stacked.T @ stacked)
                    _add(in_sums, name, _input_sum(modules[name], records[name][0]))
                nll += _nll(out.detach(), labels)
                count += len(labels)
                records.clear()
    finally:
        for handle in handles:
            handle.remove()
    factors = []
    for name, module in layers:
        if isinstance(module, nn.Linear):
            out_dim, groups, in_dim = module.out_features, 1, module.in_features
        else:
            out_dim, groups = module.out_channels, module.groups
            in_dim = module.in_channels // groups * module.kernel_size[0] * module.kernel_size[1]
        out_sum = out_sums.get(name, torch.zeros(out_dim, out_dim, dtype=torch.float64))
        in_sum = in_sums.get(name, torch.zeros(groups, in_dim, in_dim, dtype=torch.float64))
        factors.append(LayerFactors(name, module, out_sum, tuple(in_sum)))
    return factors, nll, count


def _add(totals: dict[str, torch.Tensor], name: str, value: torch.Tensor) -> None:
    totals[name] = value if name not in totals else totals[name] + value


def _input_sum(module: Layer, inputs: torch.Tensor) -> torch.Tensor:
    """``sum_n sum_t x_nt x_nt^T`` per group: ``(g, q, q)`` float64."""
    if isinstance(module, nn.Linear):
        flat = inputs.reshape(len(inputs), -1)
        return (flat.T @ flat).double().unsqueeze(0)
    patches = _patches(module, inputs)                                   # (B, C kh kw, T)
    grouped = patches.reshape(len(patches), module.groups, -1, patches.shape[-1])
    return torch.einsum("bgit,bgjt->gij", grouped, grouped).double()


def layer_kron_curvature(factors: list[LayerFactors], params: Mapping[str, torch.Tensor],
                         out_scale: float, count: int,
                         eigen: Callable[[torch.Tensor], Eigen] = clipped_eigh
                         ) -> LayerKronCurvature:
    """The blocks in ``params``' order: ``B`` times ``out_scale`` (``N / n``), ``A`` divided
    by ``count`` (``n``), each eigendecomposed with ``eigen``."""
    blocks: dict[str, list[KronBlock]] = {}
    for layer in factors:
        out_factor = layer.out_sum * out_scale
        out_eigen = eigen(out_factor)
        weight = _parameter(layer.name, "weight")
        groups = len(layer.in_sums)
        size = len(out_factor) // groups
        parts = []
        for j, in_sum in enumerate(layer.in_sums):
            part = out_factor[j * size:(j + 1) * size, j * size:(j + 1) * size]
            in_factor = in_sum / count
            parts.append(KronBlock(weight, part, in_factor,
                                   out_eigen if groups == 1 else eigen(part), eigen(in_factor)))
        blocks[weight] = parts
        if layer.module.bias is not None:
            bias = _parameter(layer.name, "bias")
            blocks[bias] = [KronBlock(bias, out_factor, None, out_eigen, None)]
    return LayerKronCurvature(tuple(layer.name for layer in factors),
                              tuple(block for name in params for block in blocks[name]))
