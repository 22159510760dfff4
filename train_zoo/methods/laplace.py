"""The Laplace approximation as ``init`` / ``sample`` pieces: full GGN or last-layer KFAC.

Around a trained network (the MAP ``theta*``) the posterior is approximated by the Gaussian
``N(theta*, P^-1)`` with posterior precision ``P = G + delta I``: ``G`` is the generalised
Gauss-Newton matrix (GGN) of the summed cross-entropy of the training data and ``delta``
the precision of the isotropic prior ``N(0, delta^-1 I)``. The true Hessian of a network
trained with SGD is indefinite (a third of OptuNet's eigenvalues are negative), so "full
Laplace" means the GGN, which is positive semi-definite by construction.

Two structures (option ``structure``):

``"full"``
    All ``D`` parameters vary; ``G = sum_n J_n^T H_n J_n`` with ``J_n`` ``(K, D)`` the
    Jacobian of example ``n``'s logits and ``H_n = diag(p_n) - p_n p_n^T`` the Hessian of the
    softmax cross-entropy in logit space. ``H_n`` has rank ``K - 1`` and a closed-form
    factor ``H_n = V_n^T V_n``, ``V_n`` ``(K - 1, K)`` (:func:`softmax_hessian_factor`), so
    ``J_n^T H_n J_n = M_n^T M_n`` with ``M_n = V_n J_n``: the ``K - 1`` rows of ``M_n`` are
    vector-Jacobian products of the logits with the rows of ``V_n`` (``vmap`` over examples
    of ``vmap`` over cotangents of ``torch.func.vjp``, in chunks of ``chunk_size`` examples;
    ``J_n`` itself is never formed), and each chunk adds ``M^T M`` as one float64 matrix
    product. Samples are ``theta* + L^-T z`` with ``P = L L^T`` and ``z ~ N(0, I)``.

``"last-layer-kfac"``
    Only the network's final ``Linear`` layer (weight ``W`` ``(K, F)``, bias ``b`` ``(K,)``)
    varies; every other parameter and buffer stays at the MAP. The weight block of ``G`` is
    approximated by the Kronecker product (flattening ``W`` row-major, index ``k * F + f``)::

        G_W ~ kron(B, A),   B = sum_n Lambda_n  (K, K),   A = sum_n a_n a_n^T / N  (F, F)

    (sums over the ``N`` training examples)
    with ``Lambda_n = H_n`` (the logits *are* the layer's output) and ``a_n`` the layer's
    input (the pooled features). The bias is a separate block ``C = sum_n Lambda_n``; the
    weight-bias cross terms are dropped. This is the convention of laplace-torch 0.3 (its
    ``kfacs`` are ``[B, A]`` and ``[C]``). It is ``N`` times the expectation approximation
    ``E[kron(Lambda, a a^T)] ~ kron(E[Lambda], E[a a^T])``, so the output factor carries the
    data-set size and the input factor is a mean; for one example it is the exact GGN
    block. With the eigendecompositions
    ``B = U diag(beta) U^T`` and ``A = V diag(alpha) V^T`` the weight block of ``P`` is
    ``kron(U, V) diag(beta (x) alpha + delta) kron(U, V)^T``, so a sample is
    ``W* + U (Z / sqrt(beta alpha^T + delta)) V^T`` with ``Z ~ N(0, I)`` ``(K, F)`` and the
    bias ``b* + U_C (z / sqrt(gamma + delta))``: exact draws from the Kronecker-factored
    Gaussian without forming any ``KF x KF`` matrix.

Data that do not cover the data set: ``init`` sees ``n`` examples from ``batches`` while
the data set has ``N = num_data``. The summed loss, ``G`` (full) and ``B``, ``C`` (KFAC) are
multiplied by ``N / n`` and ``A`` is averaged over the ``n`` examples seen, so they estimate
the full-data values; with ``n = N`` nothing is rescaled and everything equals
laplace-torch's.

Prior precision (option ``prior_precision``):

``"marglik"`` (default)
    ``delta`` maximises the Laplace evidence (laplace-torch's ``log_marginal_likelihood``
    with prior mean ``0``), over the ``D`` varying parameters::

        log Z(delta) = -L - 1/2 (logdet(G + delta I) - D log delta + delta ||theta*||^2)

    with ``L`` the summed cross-entropy. With ``lambda_i`` the eigenvalues of the GGN
    (of ``kron(B, A)`` and ``C``: ``beta_k alpha_f`` and ``gamma_k``) this is a closed-form
    function of ``delta``, and ``d log Z / d log delta = 0`` is
    ``h(delta) = delta ||theta*||^2 - sum_i lambda_i / (lambda_i + delta) = 0``. ``h`` is
    strictly increasing (from ``-rank G`` at ``0`` to ``+inf``), so the evidence has exactly
    one maximiser, its root, found by bracketing and Brent's method on ``log delta``
    (:func:`optimal_prior_precision`). laplace-torch instead runs 100 Adam steps on
    ``log delta``; it lands near the same root.
``"training"``
    ``delta = N * weight_decay``: the Gaussian prior that SGD's weight decay on the mean
    loss corresponds to.
a positive number
    ``delta`` itself.

>>> import torch
>>> from posteriorzoo.models import build
>>> from train_zoo.methods.common import parameters_of
>>> torch.manual_seed(0)  # doctest: +ELLIPSIS
<torch._C.Generator object at ...>
>>> model = build("optunet")
>>> params, buffers = parameters_of(model)
>>> batch = (torch.randn(32, 1, 28, 28), torch.randint(0, 10, (32,)))
>>> state = init(model, params, buffers, [batch], 32)
>>> state.prior_source, state.dimension
('marglik', 392)
>>> draws = sample(model, state, torch.Generator().manual_seed(0), 2)
>>> build("optunet").load_state_dict(draws[0])
<All keys matched successfully>
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import torch
from scipy.optimize import brentq
from torch import nn
from torch.func import vjp, vmap

from posteriorzoo.errors import InvalidOptionError
from train_zoo.methods.common import Params, flatten, logits, state_dict_of, unflatten

__all__ = [
    "MAX_FULL_PARAMETERS",
    "STRUCTURES",
    "FullCurvature",
    "KronCurvature",
    "LaplaceState",
    "draw",
    "full_ggn",
    "init",
    "kron_last_layer",
    "last_layer_features",
    "log_evidence",
    "optimal_prior_precision",
    "posterior_precision",
    "sample",
    "softmax_hessian_factor",
]

#: The values of the ``structure`` option.
STRUCTURES = ("full", "last-layer-kfac")
#: Largest parameter count for ``structure="full"`` (a dense ``D x D`` float64 matrix: 3.2 GB).
MAX_FULL_PARAMETERS = 20_000
# Brent's method stops when log(delta) is known to this absolute accuracy.
_LOG_DELTA_TOL = 1e-10

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


@dataclass(frozen=True)
class LaplaceState:
    """A fitted Laplace approximation ``N(mean, P^-1)`` over the parameters ``names``.

    Attributes
    ----------
    structure : str
        One of :data:`STRUCTURES`.
    names : tuple of str
        The varying parameters, in the order of ``mean`` (all of them for ``"full"``; the
        last layer's ``weight`` and ``bias`` for ``"last-layer-kfac"``).
    mean : torch.Tensor
        ``(D,)`` float64, the MAP values of ``names`` flattened (row-major, concatenated).
    params, buffers : dict of str to torch.Tensor
        All MAP parameters and buffers; those not in ``names`` are copied into every sample.
    curvature : FullCurvature or KronCurvature
        The GGN (approximation) and the factorisation of ``P`` used for sampling.
    prior_precision : float
        ``delta`` of the prior ``N(0, delta^-1 I)`` on the varying parameters.
    prior_source : str
        ``"marglik"``, ``"training"`` (``num_data * weight_decay``) or ``"fixed"``.
    weight_decay : float or None
        The training weight decay behind ``"training"``.
    log_evidence : float
        The Laplace log marginal likelihood at ``prior_precision``.
    nll : float
        Summed cross-entropy ``L`` of the data, in nats (scaled to ``num_data``).
    num_data : int
        ``N``, the size of the training set.
    num_seen : int
        ``n``, the examples the curvature was computed from.
    """

    structure: str
    names: tuple[str, ...]
    mean: torch.Tensor
    params: Params
    buffers: Params
    curvature: FullCurvature | KronCurvature
    prior_precision: float
    prior_source: str
    weight_decay: float | None
    log_evidence: float
    nll: float
    num_data: int
    num_seen: int

    @property
    def dimension(self) -> int:
        """``D``, the number of parameters that vary."""
        return int(self.mean.numel())


# ----------------------------------------------------------------------------- validation

def _positive_int(value: object, option: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise InvalidOptionError(f"laplace option '{option}' must be an integer >= 1, "
                                 f"not {value!r}")
    return int(value)


def _positive_real(value: object, option: str) -> float:
    ok = (isinstance(value, numbers.Real) and not isinstance(value, bool)
          and math.isfinite(float(value)) and float(value) > 0)
    if not ok:
        raise InvalidOptionError(f"laplace option '{option}' must be a finite number > 0, "
                                 f"not {value!r}")
    return float(value)


def _check_structure(structure: object) -> str:
    if not isinstance(structure, str) or structure not in STRUCTURES:
        raise InvalidOptionError(f"laplace option 'structure' must be one of "
                                 f"{', '.join(map(repr, STRUCTURES))}, not {structure!r}")
    return structure


def _check_prior(prior_precision: object, weight_decay: object
                 ) -> tuple[str, float | None, float | None]:
    """``(source, fixed delta or None, weight decay or None)``."""
    if isinstance(prior_precision, str) and prior_precision == "training":
        if weight_decay is None:
            raise InvalidOptionError("laplace option 'weight_decay' is needed with "
                                     "prior_precision='training'")
        return "training", None, _positive_real(weight_decay, "weight_decay")
    if weight_decay is not None:
        raise InvalidOptionError("laplace option 'weight_decay' is only used with "
                                 "prior_precision='training'")
    if isinstance(prior_precision, str) and prior_precision == "marglik":
        return "marglik", None, None
    if isinstance(prior_precision, str):
        raise InvalidOptionError(f"laplace option 'prior_precision' must be 'marglik', "
                                 f"'training' or a number > 0, not {prior_precision!r}")
    return "fixed", _positive_real(prior_precision, "prior_precision"), None


# ----------------------------------------------------------------------------- curvature

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


def full_ggn(model: nn.Module, params: Mapping[str, torch.Tensor],
             buffers: Mapping[str, torch.Tensor], batches: Iterable[Batch], *,
             chunk_size: int = 256) -> tuple[torch.Tensor, float, int]:
    """The GGN of the summed softmax cross-entropy over all parameters, unscaled.

    ``G = sum_n J_n^T H_n J_n = sum_n M_n^T M_n`` with ``M_n = V_n J_n`` ``(K - 1, D)`` and
    ``V_n`` from :func:`softmax_hessian_factor`. The rows of ``M_n`` are vector-Jacobian
    products of example ``n``'s logits with the cotangents ``V_n``: ``K - 1`` backward
    passes per example (``vmap`` over examples of ``vmap`` over cotangents of ``vjp``), no
    ``(K, D)`` Jacobian is formed. Each chunk's ``M^T M`` is a float64 matrix product.

    Parameters
    ----------
    model : torch.nn.Module
        The architecture (its own weights unused); evaluated in eval mode.
    params, buffers : Mapping[str, torch.Tensor]
        Where to evaluate; the GGN's rows follow ``params``' order (as :func:`flatten`).
    batches : iterable of (images, labels)
        Images ``(B, ...)`` and int64 labels ``(B,)``.
    chunk_size : int, default 256
        Examples per vectorised call; memory is about ``chunk_size * K * D`` floats plus
        ``K`` copies of the network's activations per example.

    Returns
    -------
    ggn : torch.Tensor
        ``sum_n J_n^T H_n J_n`` ``(D, D)`` float64, symmetric.
    nll : float
        Summed cross-entropy of the examples, in nats.
    count : int
        Number of examples ``n``.
    """
    chunk_size = _positive_int(chunk_size, "chunk_size")
    params = {name: value.detach() for name, value in params.items()}
    buffers = dict(buffers)

    def rows_of(p: Params, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, pullback = vjp(lambda q: logits(model, q, buffers, image.unsqueeze(0)), p)
        _check_classes(out)
        factor = softmax_hessian_factor(out).to(out.dtype)          # (1, K - 1, K)
        (grads,) = vmap(pullback, in_dims=1)(factor)
        rows = torch.cat([g.reshape(g.shape[0], -1) for g in grads.values()], dim=1)
        return rows, out.squeeze(0)

    per_example = vmap(rows_of, in_dims=(None, 0))
    dim = sum(value.numel() for value in params.values())
    ggn = torch.zeros(dim, dim, dtype=torch.float64)
    nll, count = 0.0, 0
    with _EvalMode(model):
        for x, y in _chunks(batches, chunk_size):
            rows, out = per_example(params, x)                      # (B, K - 1, D), (B, K)
            rows = rows.reshape(-1, dim).double()
            ggn.addmm_(rows.T, rows)
            nll += _nll(out, y)
            count += len(y)
    return (ggn + ggn.T) / 2, nll, count


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
    calls: list[tuple[str, nn.Module, torch.Tensor, torch.Tensor]] = []
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
    return layer, lambda_sum, activation_sum, nll, count


def _eigh(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    values, vectors = torch.linalg.eigh((matrix + matrix.T) / 2)
    return values.clamp_min(0.0), vectors


# ----------------------------------------------------------------------------- evidence

def log_evidence(eigenvalues: torch.Tensor, nll: float, squared_norm: float,
                 prior_precision: float) -> float:
    """The Laplace log marginal likelihood with the isotropic prior ``N(0, delta^-1 I)``.

    Parameters
    ----------
    eigenvalues : torch.Tensor
        ``(D,)`` eigenvalues ``lambda_i >= 0`` of the GGN (approximation).
    nll : float
        Summed cross-entropy ``L`` at the MAP.
    squared_norm : float
        ``||theta*||^2`` over the ``D`` varying parameters.
    prior_precision : float
        ``delta > 0``.

    Returns
    -------
    float
        ``-L - 1/2 (sum_i log(lambda_i + delta) - D log delta + delta ||theta*||^2)``;
        laplace-torch's ``log_marginal_likelihood`` for a scalar prior precision.
    """
    lam = eigenvalues.double().clamp_min(0.0)
    delta = float(prior_precision)
    log_ratio = float(torch.log1p(lam / delta).sum())       # logdet P - logdet P_0
    return -nll - 0.5 * (log_ratio + delta * squared_norm)


def optimal_prior_precision(eigenvalues: torch.Tensor, squared_norm: float) -> float:
    """The prior precision that maximises :func:`log_evidence`.

    Parameters
    ----------
    eigenvalues : torch.Tensor
        ``(D,)`` eigenvalues ``lambda_i >= 0`` of the GGN (approximation).
    squared_norm : float
        ``||theta*||^2`` over the varying parameters.

    Returns
    -------
    float
        The unique root ``delta*`` of ``h(delta) = delta ||theta*||^2 -
        sum_i lambda_i / (lambda_i + delta)`` (``delta d log Z / d delta = -h / 2``), found
        with Brent's method on ``log delta`` to an absolute accuracy of 1e-10.

    Raises
    ------
    InvalidOptionError
        If the evidence has no finite maximiser (``G = 0`` or ``theta* = 0``).
    """
    lam = eigenvalues.double().clamp_min(0.0).numpy()
    lam = lam[lam > 0]
    if lam.size == 0 or not squared_norm > 0:
        raise InvalidOptionError("laplace option 'prior_precision'='marglik' has no finite "
                                 "optimum here (zero curvature or zero weights)")

    def h(log_delta: float) -> float:
        delta = math.exp(log_delta)
        return delta * squared_norm - float(np.sum(lam / (lam + delta)))

    # h >= 0 once delta * ||theta||^2 >= rank G; h -> -rank G < 0 as delta -> 0.
    upper = math.log(lam.size / squared_norm)
    lower = upper - 10.0
    while h(lower) >= 0:
        lower -= 10.0
    return math.exp(brentq(h, lower, upper, xtol=_LOG_DELTA_TOL, rtol=4 * np.finfo(float).eps))


# ----------------------------------------------------------------------------- pieces

def init(model: nn.Module, params: Mapping[str, torch.Tensor],
         buffers: Mapping[str, torch.Tensor], batches: Iterable[Batch], num_data: int, *,
         structure: str = "full", prior_precision: float | str = "marglik",
         weight_decay: float | None = None, chunk_size: int = 256) -> LaplaceState:
    """Fit the Laplace approximation at the trained weights ``params``.

    Parameters
    ----------
    model : torch.nn.Module
        The base architecture (its own weights unused); evaluated in eval mode.
    params, buffers : Mapping[str, torch.Tensor]
        The MAP parameters and buffers, keyed like ``model.named_parameters()`` /
        ``named_buffers()``.
    batches : iterable of (images, labels)
        Normalised images ``(B, C, H, W)`` (no augmentation) and int64 labels ``(B,)``;
        iterated once.
    num_data : int
        ``N``, the size of the training set (``n`` examples seen are rescaled to ``N``).
    structure : {"full", "last-layer-kfac"}, default "full"
        Dense GGN over all parameters, or Kronecker-factored GGN of the final ``Linear``.
    prior_precision : "marglik", "training" or float, default "marglik"
        How ``delta`` is set (module docstring).
    weight_decay : float, optional
        The training weight decay; needed for and only allowed with ``"training"``.
    chunk_size : int, default 256
        Examples per Jacobian call (``"full"`` only).

    Returns
    -------
    LaplaceState

    Raises
    ------
    InvalidOptionError
        A bad option value, no batch, a ``"full"`` model with more than
        :data:`MAX_FULL_PARAMETERS` parameters, a last layer that is not ``Linear``, or a
        ``"marglik"`` evidence without a finite maximiser.
    """
    structure = _check_structure(structure)
    source, delta, decay = _check_prior(prior_precision, weight_decay)
    num_data = _positive_int(num_data, "num_data")
    chunk_size = _positive_int(chunk_size, "chunk_size")
    params = {name: value.detach().clone() for name, value in params.items()}
    buffers = {name: value.detach().clone() for name, value in buffers.items()}
    if source == "training":
        delta = num_data * decay

    if structure == "full":
        dim = sum(value.numel() for value in params.values())
        if dim > MAX_FULL_PARAMETERS:
            raise InvalidOptionError(
                f"laplace option 'structure'='full' needs a dense {dim} x {dim} matrix (limit "
                f"{MAX_FULL_PARAMETERS} parameters): use 'last-layer-kfac'")
        ggn, nll, count = full_ggn(model, params, buffers, batches, chunk_size=chunk_size)
        scale = num_data / count
        ggn, nll = ggn * scale, nll * scale
        eigenvalues = torch.linalg.eigvalsh(ggn).clamp_min(0.0)
        names = tuple(params)
    else:
        layer, lambda_sum, activation_sum, nll, count = kron_last_layer(
            model, params, buffers, batches)
        scale = num_data / count
        out_factor, in_factor, nll = lambda_sum * scale, activation_sum / count, nll * scale
        has_bias = f"{layer}.bias" in params
        names = (f"{layer}.weight",) + ((f"{layer}.bias",) if has_bias else ())
        out_eigen = _eigh(out_factor)
        kron = KronCurvature(layer, out_factor, in_factor, out_eigen, _eigh(in_factor),
                             out_eigen if has_bias else None)
        eigenvalues = kron.eigenvalues()

    mean = flatten({name: params[name] for name in names}).double()
    squared_norm = float(mean @ mean)
    if source == "marglik":
        delta = optimal_prior_precision(eigenvalues, squared_norm)
    if structure == "full":
        eye = torch.eye(len(mean), dtype=torch.float64)
        curvature: FullCurvature | KronCurvature = FullCurvature(
            ggn, eigenvalues, torch.linalg.cholesky(ggn + delta * eye))
    else:
        curvature = kron
    return LaplaceState(structure, names, mean, params, buffers, curvature, float(delta),
                        source, decay, log_evidence(eigenvalues, nll, squared_norm, delta),
                        float(nll), num_data, count)


def posterior_precision(state: LaplaceState) -> torch.Tensor:
    """The dense posterior precision ``P`` ``(D, D)`` float64, in the order of ``state.mean``.

    For ``"last-layer-kfac"`` this is ``block_diag(kron(B, A) + delta I, C + delta I)``;
    it allocates ``D^2`` floats, so it is meant for checks on small layers.
    """
    delta = state.prior_precision
    curvature = state.curvature
    if isinstance(curvature, FullCurvature):
        return curvature.ggn + delta * torch.eye(state.dimension, dtype=torch.float64)
    blocks = [torch.kron(curvature.out_factor, curvature.in_factor)]
    if curvature.bias_eigen is not None:
        blocks.append(curvature.out_factor)
    precision = torch.block_diag(*blocks)
    return precision + delta * torch.eye(len(precision), dtype=torch.float64)


def draw(state: LaplaceState, generator: torch.Generator, count: int) -> torch.Tensor:
    """``count`` draws of the varying parameters from ``N(mean, P^-1)``, as flat vectors.

    Parameters
    ----------
    state : LaplaceState
        From :func:`init`.
    generator : torch.Generator
        The only source of randomness. Draws are taken one after another (``"full"``: ``D``
        normals each; ``"last-layer-kfac"``: ``K * F`` for the weight, then ``K`` for the
        bias), so draw ``s`` does not depend on ``count``.
    count : int
        Number of draws (>= 1).

    Returns
    -------
    torch.Tensor
        ``(count, D)`` float64, in the order of ``state.names`` (as :func:`flatten`).
        ``"full"``: ``mean + L^-T z`` with ``P = L L^T``; ``"last-layer-kfac"``: weight
        ``W* + U (Z / sqrt(beta alpha^T + delta)) V^T``, bias ``b* + U_C z / sqrt(gamma +
        delta)`` (module docstring).
    """
    count = _positive_int(count, "count")
    if not isinstance(generator, torch.Generator):
        raise InvalidOptionError(f"laplace option 'generator' must be a torch.Generator, "
                                 f"not {type(generator).__name__}")
    curvature, delta = state.curvature, state.prior_precision
    if isinstance(curvature, FullCurvature):
        z = torch.stack([torch.randn(state.dimension, generator=generator, dtype=torch.float64)
                         for _ in range(count)])                                 # (S, D)
        steps = torch.linalg.solve_triangular(curvature.cholesky.T, z.T, upper=True).T
        return state.mean + steps
    (beta, u), (alpha, v) = curvature.out_eigen, curvature.in_eigen
    bias = curvature.bias_eigen
    weights, biases = [], []
    for _ in range(count):
        weights.append(torch.randn(len(beta), len(alpha), generator=generator,
                                   dtype=torch.float64))
        if bias is not None:
            biases.append(torch.randn(len(bias[0]), generator=generator, dtype=torch.float64))
    scale = (torch.outer(beta, alpha) + delta).rsqrt()
    parts = [(u @ (torch.stack(weights) * scale) @ v.T).reshape(count, -1)]     # (S, K F)
    if bias is not None:
        gamma, w = bias
        parts.append((torch.stack(biases) * (gamma + delta).rsqrt()) @ w.T)      # (S, K)
    return state.mean + torch.cat(parts, dim=1)


def sample(model: nn.Module, state: LaplaceState, generator: torch.Generator, count: int
           ) -> list[dict[str, torch.Tensor]]:
    """``count`` draws from the Laplace approximation, as base-architecture checkpoints.

    Parameters
    ----------
    model : torch.nn.Module
        The base architecture; fixes the state_dict's keys, order and dtypes.
    state : LaplaceState
        From :func:`init`.
    generator : torch.Generator
        The only source of randomness (see :func:`draw`).
    count : int
        Number of samples (>= 1).

    Returns
    -------
    list of dict of str to torch.Tensor
        ``count`` state_dicts: the varying parameters are the rows of
        :func:`draw` (same generator state), everything else (other parameters, BatchNorm
        buffers) is at the MAP.
    """
    like = {name: state.params[name] for name in state.names}
    return [state_dict_of(model, {**state.params, **unflatten(row, like)}, state.buffers)
            for row in draw(state, generator, count)]
