"""The curvature behind :mod:`train_zoo.methods.laplace`: the full GGN, its diagonal and
last-layer KFAC (KFAC over every layer: :mod:`train_zoo.methods.laplace_kron`).

Full GGN (:func:`full_ggn`)
    ``G = sum_n J_n^T H_n J_n`` over all ``D`` parameters, with ``J_n`` ``(K, D)`` the
    Jacobian of example ``n``'s logits and ``H_n = diag(p_n) - p_n p_n^T`` the Hessian of
    the softmax cross-entropy in logit space. ``H_n`` has rank ``K - 1`` and a closed-form
    factor ``H_n = V_n^T V_n``, ``V_n`` ``(K - 1, K)`` (:func:`softmax_hessian_factor`), so
    ``J_n^T H_n J_n = M_n^T M_n`` with ``M_n = V_n J_n``: ``K - 1`` rows per example, the
    vector-Jacobian products of the logits with the rows of ``V_n`` (``J_n`` itself is
    never formed). ``G`` is the sum of ``m m^T`` over all rows ``m``, a symmetric rank-k
    update (``?syrk``): float32 rows are summed in float32 over blocks of
    :data:`GRAM_BLOCK_ROWS` rows and the blocks in float64; float64 rows in float64.

    The rows come from one of two paths, which agree to float32 rounding:

    - OptuNet-shaped networks (:mod:`train_zoo.fast.laplace_optunet`): the backward
      pass of the ``K - 1`` cotangents written out layer by layer for a whole chunk of
      examples;
    - any other network: ``vmap`` over examples of ``vmap`` over cotangents of
      ``torch.func.vjp``.

Diagonal GGN (:func:`diag_ggn`)
    ``diag(G)``: the same rows as the full GGN, squared and summed in float64 (memory
    ``O(chunk * K * D)``, no ``D x D`` matrix).

Last-layer KFAC (:func:`kron_last_layer`)
    The unscaled Kronecker factors ``sum_n Lambda_n`` ``(K, K)`` and ``sum_n a_n a_n^T``
    ``(F, F)`` of the final ``Linear`` layer (inputs ``a_n`` found with forward hooks).

Every function evaluates the network in eval mode (BatchNorm running statistics, no
dropout) and gives each submodule back its own mode afterwards.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
from threadpoolctl import threadpool_limits
from torch import nn
from torch.func import vjp, vmap

from posteriorzoo.errors import InvalidOptionError
from train_zoo.methods.common import Params, logits

if TYPE_CHECKING:
    from train_zoo.fast.layout import NetLayout

__all__ = [
    "DIAG_ROW_BUDGET",
    "GRAM_BLOCK_ROWS",
    "DiagCurvature",
    "FullCurvature",
    "KronCurvature",
    "clipped_eigh",
    "diag_ggn",
    "full_ggn",
    "ggn_rows",
    "kron_last_layer",
    "last_layer_features",
    "positive_int",
    "softmax_hessian_factor",
]

#: Rows summed in float32 before a block is added to the float64 GGN (float32 rows only).
#: 8192 rows of 392 columns keep the ``?syrk`` call efficient; measured on OptuNet, the
#: result is within 2e-7 (relative to its largest entry) of an all-float64 sum.
GRAM_BLOCK_ROWS = 8192

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class FullCurvature:
    """The dense GGN over all parameters.

    Attributes
    ----------
    ggn : torch.Tensor
        ``G`` ``(D, D)`` float64, symmetric positive semi-definite (scaled to ``num_data``).
    eigenvalues : torch.Tensor
        ``(D,)`` float64, eigenvalues of ``G``, ascending, clipped at 0.
    cholesky : torch.Tensor
        ``L`` ``(D, D)`` float64, lower-triangular with ``G + delta I = L L^T``.
    """

    ggn: torch.Tensor
    eigenvalues: torch.Tensor
    cholesky: torch.Tensor


@dataclass(frozen=True)
class DiagCurvature:
    """The diagonal of the GGN over all parameters.

    Attributes
    ----------
    diagonal : torch.Tensor
        ``diag(G)`` ``(D,)`` float64, non-negative (scaled to ``num_data``); the posterior
        precision is ``diag(G) + delta``, so these are also its eigenvalues less ``delta``.
    """

    diagonal: torch.Tensor

    def eigenvalues(self) -> torch.Tensor:
        """The eigenvalues of the diagonal GGN: its entries, ``(D,)`` float64."""
        return self.diagonal


@dataclass(frozen=True)
class KronCurvature:
    """Kronecker factors of the last layer's GGN and their eigendecompositions.

    Attributes
    ----------
    layer : str
        Name of the last ``Linear`` module (``"fc"`` for OptuNet and ResNet-18).
    out_factor : torch.Tensor
        ``B = sum_n Lambda_n`` ``(K, K)`` float64 (scaled to ``num_data``).
    in_factor : torch.Tensor
        ``A = sum_n a_n a_n^T / n`` ``(F, F)`` float64.
    out_eigen, in_eigen : tuple of torch.Tensor
        ``(values, vectors)`` of ``B`` and ``A``: ``(K,), (K, K)`` and ``(F,), (F, F)``,
        values clipped at 0.
    bias_eigen : tuple of torch.Tensor or None
        ``(values, vectors)`` of the bias block ``C = B``, or None without a bias.
    """

    layer: str
    out_factor: torch.Tensor
    in_factor: torch.Tensor
    out_eigen: tuple[torch.Tensor, torch.Tensor]
    in_eigen: tuple[torch.Tensor, torch.Tensor]
    bias_eigen: tuple[torch.Tensor, torch.Tensor] | None

    def eigenvalues(self) -> torch.Tensor:
        """Eigenvalues of the (block-diagonal) GGN approximation, ``(D,)`` float64:
        ``beta_k alpha_f`` in the weight's row-major order, then the bias block's."""
        values = [torch.outer(self.out_eigen[0], self.in_eigen[0]).reshape(-1)]
        if self.bias_eigen is not None:
            values.append(self.bias_eigen[0])
        return torch.cat(values)


# ----------------------------------------------------------------------------- helpers

def positive_int(value: object, option: str) -> int:
    """``value`` as an int, or :class:`InvalidOptionError` naming the laplace ``option``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise InvalidOptionError(f"laplace option '{option}' must be an integer >= 1, "
                                 f"not {value!r}")
    return int(value)


class _EvalMode:
    """Put ``model`` in eval mode (BatchNorm running statistics, no dropout) for a block,
    then give every submodule back its own mode."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.modes = [(module, module.training) for module in model.modules()]

    def __enter__(self) -> None:
        self.model.eval()

    def __exit__(self, *exc: object) -> None:
        for module, training in self.modes:
            module.training = training


def _batches(batches: Iterable[Batch]) -> Iterable[Batch]:
    """The batches, refusing an iterable without any example."""
    count = 0
    for images, labels in batches:
        if len(labels):
            count += len(labels)
            yield images, labels
    if count == 0:
        raise InvalidOptionError("laplace option 'batches' holds no example")


def _chunks(batches: Iterable[Batch], size: int) -> Iterable[Batch]:
    """The examples of ``batches`` regrouped into chunks of ``size`` (the last one shorter)."""
    pending: list[Batch] = []
    held = 0
    for images, labels in _batches(batches):
        pending.append((images, labels))
        held += len(labels)
        if held >= size:
            images = torch.cat([x for x, _ in pending])
            labels = torch.cat([y for _, y in pending])
            stop = held - held % size
            for start in range(0, stop, size):
                yield images[start:start + size], labels[start:start + size]
            pending = [(images[stop:], labels[stop:])] if stop < held else []
            held -= stop
    if held:
        yield torch.cat([x for x, _ in pending]), torch.cat([y for _, y in pending])


def _check_classes(out: torch.Tensor) -> None:
    if out.shape[-1] < 2:
        raise InvalidOptionError("laplace option 'model' must output K >= 2 logits (softmax "
                                 f"cross-entropy), not {out.shape[-1]}")


def _nll(out: torch.Tensor, labels: torch.Tensor) -> float:
    """Summed cross-entropy of logits ``out`` ``(B, K)``, in float64."""
    if labels.numel() and (labels.min() < 0 or labels.max() >= out.shape[1]):
        raise InvalidOptionError(f"laplace option 'batches' has labels outside "
                                 f"[0, {out.shape[1]})")
    log_p = torch.log_softmax(out.detach().double(), dim=1)
    return float(-log_p.gather(1, labels.reshape(-1, 1)).sum())


def clipped_eigh(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, vectors)`` of the symmetric part of ``matrix`` ``(n, n)``, values
    ascending and clipped at 0 (the factors are PSD up to rounding)."""
    values, vectors = torch.linalg.eigh((matrix + matrix.T) / 2)
    return values.clamp_min(0.0), vectors


# ----------------------------------------------------------------------------- full GGN

def softmax_hessian_factor(out: torch.Tensor) -> torch.Tensor:
    """A ``(K - 1)``-row factor of the softmax cross-entropy Hessian in logit space.

    Parameters
    ----------
    out : torch.Tensor
        Logits ``(..., K)``.

    Returns
    -------
    torch.Tensor
        ``V`` ``(..., K - 1, K)`` float64 with ``V^T V = diag(p) - p p^T``, ``p =
        softmax(out)``: the Cholesky factor of the multinomial covariance. With the tail
        masses ``q_k = sum_{j >= k} p_j``, row ``k`` is
        ``sqrt(p_k q_{k+1} / q_k) (e_k - sum_{j > k} p_j e_j / q_{k+1})``; every entry is
        bounded by 1 in size and exact zeros (saturated softmax) give zero rows.
    """
    p = torch.log_softmax(out.double(), dim=-1).exp()
    classes = p.shape[-1]
    tiny = torch.finfo(torch.float64).tiny
    q = p.flip(-1).cumsum(-1).flip(-1)
    q_next = q[..., 1:].clamp_min(tiny)
    lead = (p[..., :-1] * q[..., 1:] / q[..., :-1].clamp_min(tiny)).sqrt()
    row = torch.arange(classes - 1, device=out.device).unsqueeze(1)
    col = torch.arange(classes, device=out.device).unsqueeze(0)
    tail = torch.where(col > row, -p.unsqueeze(-2) / q_next.unsqueeze(-1), 0.0)
    return lead.unsqueeze(-1) * (tail + (col == row).double())


class _Gram:
    """``sum_r m_r m_r^T`` over rows ``m_r`` ``(D,)``, by symmetric rank-k updates.

    Rows are buffered and summed a block at a time with ``?syrk`` (half the work of
    ``M^T M`` as a general matrix product): float32 rows with ``ssyrk`` in blocks of
    :data:`GRAM_BLOCK_ROWS`, each block's float32 result added to a float64 total;
    float64 rows with ``dsyrk`` straight into the total. Only the upper triangle is kept.
    """

    def __init__(self, dim: int) -> None:
        self.upper = np.zeros((dim, dim), order="F")          # float64, upper triangle
        self.pending: list[torch.Tensor] = []
        self.held = 0

    def add(self, rows: torch.Tensor) -> None:
        """Add the rows ``(R, D)`` (any float dtype; float64 stays float64)."""
        self.pending.append(rows.detach())
        self.held += len(rows)
        if self.held >= GRAM_BLOCK_ROWS:
            self.flush()

    def flush(self) -> None:
        """Sum the buffered rows into the float64 total."""
        if not self.pending:
            return
        block = torch.cat(self.pending) if len(self.pending) > 1 else self.pending[0]
        self.pending, self.held = [], 0
        # block.T of a C-ordered (R, D) array is the Fortran-ordered (D, R) array BLAS
        # wants, so no copy is made; trans=0 then computes block^T block. (Imported here:
        # scipy.linalg would cost every training worker 0.13 s at start-up.)
        from scipy.linalg.blas import dsyrk, ssyrk

        if block.dtype == torch.float64:
            self.upper = dsyrk(1.0, block.numpy().T, beta=1.0, c=self.upper, overwrite_c=1)
        else:
            self.upper += ssyrk(1.0, block.float().contiguous().numpy().T)

    def total(self) -> torch.Tensor:
        """The symmetric sum ``(D, D)`` float64."""
        self.flush()
        upper = torch.from_numpy(np.triu(self.upper))
        return upper + torch.triu(upper, diagonal=1).T


RowsFunction = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def _vmap_rows(model: nn.Module, params: Params, buffers: Params) -> RowsFunction:
    """Any network: rows by ``vmap`` over examples of ``vmap`` over cotangents of ``vjp``."""
    def rows_of(p: Params, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # vjp's hint covers has_aux=True too; without it the result is (out, pullback).
        out, pullback = cast(tuple[Any, Callable[..., Any]],
                             vjp(lambda q: logits(model, q, buffers, image.unsqueeze(0)), p))
        _check_classes(out)
        factor = softmax_hessian_factor(out).to(out.dtype)          # (1, K - 1, K)
        (grads,) = vmap(pullback, in_dims=1)(factor)
        rows = torch.cat([g.reshape(g.shape[0], -1) for g in grads.values()], dim=1)
        return rows, out.squeeze(0)

    per_example = vmap(rows_of, in_dims=(None, 0))
    return lambda images: per_example(params, images)


def _optunet_rows(layout: NetLayout, params: Params) -> RowsFunction:
    """OptuNet-shaped networks: rows from the layers' own formulas (laplace_optunet)."""
    from train_zoo.fast import laplace_optunet

    def rows(images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, tape = laplace_optunet.forward(layout, params, images)
        _check_classes(out)
        factor = softmax_hessian_factor(out).to(out.dtype)
        return laplace_optunet.factor_rows(layout, params, tape, factor), out

    return rows


def full_ggn(model: nn.Module, params: Mapping[str, torch.Tensor],
             buffers: Mapping[str, torch.Tensor], batches: Iterable[Batch], *,
             chunk_size: int = 256, generic: bool = False) -> tuple[torch.Tensor, float, int]:
    """The GGN of the summed softmax cross-entropy over all parameters, unscaled.

    ``G = sum_n J_n^T H_n J_n = sum_n M_n^T M_n`` with ``M_n = V_n J_n`` ``(K - 1, D)`` and
    ``V_n`` from :func:`softmax_hessian_factor` (module docstring for the two ways the
    rows are computed and how they are summed).

    Parameters
    ----------
    model : torch.nn.Module
        The architecture (its own weights unused); evaluated in eval mode.
    params, buffers : Mapping[str, torch.Tensor]
        Where to evaluate; the GGN's rows follow ``params``' order (as ``flatten``).
    batches : iterable of (images, labels)
        Images ``(B, ...)`` and int64 labels ``(B,)``.
    chunk_size : int, default 256
        Examples per vectorised call; memory is about ``chunk_size * K * D`` floats plus
        ``K`` copies of the network's activations per example.
    generic : bool, default False
        Take the generic ``vmap`` path even for an OptuNet-shaped network (for checks and
        benchmarks; the result is the same to float32 rounding).

    Returns
    -------
    ggn : torch.Tensor
        ``sum_n J_n^T H_n J_n`` ``(D, D)`` float64, symmetric.
    nll : float
        Summed cross-entropy of the examples, in nats.
    count : int
        Number of examples ``n``.
    """
    params = {name: value.detach() for name, value in params.items()}
    gram = _Gram(sum(value.numel() for value in params.values()))
    nll, count = 0.0, 0
    # BLAS gets torch's thread budget: OpenBLAS's own default (all cores) contends with
    # torch's threads and, on a busy machine, made the update ten times slower.
    with threadpool_limits(torch.get_num_threads(), user_api="blas"):
        for rows, out, y in ggn_rows(model, params, buffers, batches, chunk_size=chunk_size,
                                     generic=generic):
            gram.add(rows.reshape(-1, rows.shape[-1]))
            nll += _nll(out, y)
            count += len(y)
        ggn = gram.total()
    return ggn, nll, count


def ggn_rows(model: nn.Module, params: Mapping[str, torch.Tensor],
             buffers: Mapping[str, torch.Tensor], batches: Iterable[Batch], *,
             chunk_size: int = 256, generic: bool = False
             ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The GGN's factor rows ``M_n = V_n J_n``, chunk by chunk (in eval mode).

    Yields ``(rows, out, labels)``: rows ``(B, K - 1, D)`` in the network's dtype (columns
    in ``params``' order), the logits ``(B, K)`` and the labels ``(B,)`` of ``B <=
    chunk_size`` examples. :func:`full_ggn` sums ``m m^T`` over the rows,
    :func:`diag_ggn` ``m * m``; both see the very same rows.
    """
    chunk_size = positive_int(chunk_size, "chunk_size")
    params = {name: value.detach() for name, value in params.items()}
    buffers = dict(buffers)
    rows_of: RowsFunction | None = None
    with _EvalMode(model):
        for x, y in _chunks(batches, chunk_size):
            if rows_of is None:
                from train_zoo.fast import laplace_optunet

                layout = None if generic else laplace_optunet.layout_for(
                    model, params, buffers, tuple(x.shape[1:]))
                rows_of = (_vmap_rows(model, params, buffers) if layout is None
                           else _optunet_rows(layout, params))
            rows, out = rows_of(x)                              # (B, K - 1, D), (B, K)
            yield rows, out, y


#: Factor-row entries held at once by :func:`diag_ggn` (``chunk * (K - 1) * D``, sized for
#: K <= 11 classes; more classes hold proportionally more): 2^26 float32 numbers, 256 MiB,
#: so that the diagonal scales to networks whose full GGN would not fit.
DIAG_ROW_BUDGET = 1 << 26


def diag_ggn(model: nn.Module, params: Mapping[str, torch.Tensor],
             buffers: Mapping[str, torch.Tensor], batches: Iterable[Batch], *,
             chunk_size: int = 256, generic: bool = False) -> tuple[torch.Tensor, float, int]:
    """The diagonal of :func:`full_ggn`'s GGN, without forming the ``D x D`` matrix.

    ``diag(G)_i = sum_n sum_k (M_n)_{ki}^2`` over the same factor rows as the full GGN
    (:func:`ggn_rows`), each squared and summed in float64. The chunk is shrunk so that a
    chunk's rows hold at most :data:`DIAG_ROW_BUDGET` entries.

    Returns
    -------
    diagonal : torch.Tensor
        ``(D,)`` float64, non-negative, in ``params``' order.
    nll : float
        Summed cross-entropy of the examples, in nats.
    count : int
        Number of examples ``n``.
    """
    chunk_size = positive_int(chunk_size, "chunk_size")
    dim = sum(value.numel() for value in params.values())
    chunk = max(1, min(chunk_size, DIAG_ROW_BUDGET // (10 * max(dim, 1))))
    total = torch.zeros(dim, dtype=torch.float64)
    nll, count = 0.0, 0
    for rows, out, y in ggn_rows(model, params, buffers, batches, chunk_size=chunk,
                                 generic=generic):
        total += rows.double().square().sum(dim=(0, 1))
        nll += _nll(out, y)
        count += len(y)
    return total, nll, count


# ----------------------------------------------------------------------------- last layer

def last_layer_features(model: nn.Module, params: Mapping[str, torch.Tensor],
                        buffers: Mapping[str, torch.Tensor], images: torch.Tensor
                        ) -> tuple[str, torch.Tensor, torch.Tensor]:
    """The final ``Linear`` layer, its inputs and the logits, from one forward pass.

    The last leaf module the forward pass executes must be an ``nn.Linear`` whose output
    is the network's output (found with forward hooks, as laplace-torch does).

    Parameters
    ----------
    model : torch.nn.Module
        The architecture, evaluated as it is (call under eval mode for BatchNorm).
    params, buffers : Mapping[str, torch.Tensor]
        Where to evaluate.
    images : torch.Tensor
        ``(B, ...)`` inputs.

    Returns
    -------
    layer : str
        The module's name.
    features : torch.Tensor
        ``a`` ``(B, F)``, the layer's input.
    out : torch.Tensor
        Logits ``(B, K)``.

    Raises
    ------
    InvalidOptionError
        If the network's output is not produced by its last-executed ``Linear`` module.
    """
    calls: list[tuple[str, nn.Module, torch.Tensor | None, torch.Tensor]] = []
    handles = []
    for name, module in model.named_modules():
        if not list(module.children()):
            def hook(module: nn.Module, inputs: tuple, output: torch.Tensor,
                     name: str = name) -> None:
                calls.append((name, module, inputs[0] if inputs else None, output))
            handles.append(module.register_forward_hook(hook))
    try:
        with torch.no_grad():
            out = logits(model, params, buffers, images)
    finally:
        for handle in handles:
            handle.remove()
    if calls:
        name, module, features, output = calls[-1]
        if (isinstance(module, nn.Linear) and isinstance(output, torch.Tensor)
                and output.shape == out.shape and torch.equal(output, out)):
            if features is None:
                # A forward hook sees positional inputs only: linear(input=x) gives none.
                raise InvalidOptionError(
                    f"laplace option 'structure'='last-layer-kfac' needs the last Linear "
                    f"module '{name}' called with its input as a positional argument")
            return name, features.reshape(len(out), -1), out
    raise InvalidOptionError("laplace option 'structure'='last-layer-kfac' needs a network "
                             "whose output is produced by its last Linear module")


def kron_last_layer(model: nn.Module, params: Mapping[str, torch.Tensor],
                    buffers: Mapping[str, torch.Tensor], batches: Iterable[Batch]
                    ) -> tuple[str, torch.Tensor, torch.Tensor, float, int]:
    """The unscaled Kronecker factors of the last layer's GGN.

    Parameters
    ----------
    model : torch.nn.Module
        The architecture (its own weights unused); evaluated in eval mode.
    params, buffers : Mapping[str, torch.Tensor]
        Where to evaluate.
    batches : iterable of (images, labels)
        Images ``(B, ...)`` and int64 labels ``(B,)``.

    Returns
    -------
    layer : str
        Name of the last ``Linear`` module.
    lambda_sum : torch.Tensor
        ``sum_n Lambda_n`` ``(K, K)`` float64, ``Lambda_n = diag(p_n) - p_n p_n^T``.
    activation_sum : torch.Tensor
        ``sum_n a_n a_n^T`` ``(F, F)`` float64 (not yet divided by ``n``).
    nll : float
        Summed cross-entropy, in nats.
    count : int
        Number of examples ``n``.
    """
    layer, lambda_sum, activation_sum = "", None, None
    nll, count = 0.0, 0
    with _EvalMode(model):
        for images, labels in _batches(batches):
            layer, features, out = last_layer_features(model, params, buffers, images)
            _check_classes(out)
            probs = torch.softmax(out.double(), dim=1)
            lam = torch.diag(probs.sum(0)) - probs.T @ probs
            act = features.double().T @ features.double()
            lambda_sum = lam if lambda_sum is None else lambda_sum + lam
            activation_sum = act if activation_sum is None else activation_sum + act
            nll += _nll(out, labels)
            count += len(labels)
    if lambda_sum is None or activation_sum is None:
        raise InvalidOptionError("laplace option 'batches' holds no example")  # _batches did
    return layer, lambda_sum, activation_sum, nll, count
