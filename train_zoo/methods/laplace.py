"""The Laplace approximation as ``init`` / ``sample`` pieces: full GGN, KFAC over every
layer, diagonal GGN or last-layer KFAC.

Around a trained network (the MAP ``theta*``) the posterior is approximated by the Gaussian
``N(theta*, P^-1)`` with posterior precision ``P = G + delta I``: ``G`` is the generalised
Gauss-Newton matrix (GGN) of the summed cross-entropy of the training data and ``delta``
the precision of the isotropic prior ``N(0, delta^-1 I)``. The true Hessian of a network
trained with SGD is indefinite (a third of OptuNet's eigenvalues are negative), so "full
Laplace" means the GGN, which is positive semi-definite by construction.

Four structures (option ``structure``), a ladder from the most to the least faithful:
``full`` -> ``kfac`` -> ``diag`` -> ``last-layer-kfac``.

``"full"``
    All ``D`` parameters vary; ``G = sum_n J_n^T H_n J_n`` with ``J_n`` ``(K, D)`` the
    Jacobian of example ``n``'s logits and ``H_n = diag(p_n) - p_n p_n^T`` the Hessian of the
    softmax cross-entropy in logit space, computed by
    :func:`~train_zoo.methods.laplace_curvature.full_ggn` as ``sum_n M_n^T M_n`` with
    ``M_n = V_n J_n`` ``(K - 1, D)`` and ``H_n = V_n^T V_n`` (``J_n`` is never formed).
    Samples are ``theta* + L^-T z`` with ``P = L L^T`` and ``z ~ N(0, I)``.

``"kfac"``
    All parameters vary (every one must belong to an ``nn.Linear`` or ``nn.Conv2d``);
    ``G`` is block-diagonal, one Kronecker-factored block ``kron(B, A)`` per weight and a
    dense ``B`` per bias, the factors as laplace-torch 0.3 builds them with its BackPACK
    backend (:mod:`train_zoo.methods.laplace_kron`, which also covers grouped
    convolutions). The precision of a block is ``kron(B, A) + delta I``, eigenvalues
    ``beta_o alpha_i + delta``; draws are exact, through the factors' eigendecompositions,
    as for ``"last-layer-kfac"`` below.

``"diag"``
    All ``D`` parameters vary; ``G`` is replaced by its diagonal (the same rows ``M_n`` as
    ``"full"``, squared and summed: :func:`~train_zoo.methods.laplace_curvature.diag_ggn`),
    so it scales past the dense matrix's :data:`MAX_FULL_PARAMETERS`. The precision is
    ``diag(G) + delta``; a draw is ``theta* + z / sqrt(diag(G) + delta)``.

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
the data set has ``N = num_data``. The summed loss, ``G`` (full, diag) and ``B``, ``C`` (KFAC) are
multiplied by ``N / n`` and ``A`` is averaged over the ``n`` examples seen, so they estimate
the full-data values; with ``n = N`` nothing is rescaled and everything equals
laplace-torch's.

Prior precision (option ``prior_precision``):

``"marglik"`` (default)
    ``delta`` maximises the Laplace evidence (laplace-torch's ``log_marginal_likelihood``
    with prior mean ``0``), over the ``D`` varying parameters::

        log Z(delta) = -L - 1/2 (logdet(G + delta I) - D log delta + delta ||theta*||^2)

    with ``L`` the summed cross-entropy. With ``lambda_i`` the eigenvalues of the GGN
    (of ``kron(B, A)`` and ``C``: ``beta_k alpha_f`` and ``gamma_k``; for ``"diag"`` its
    entries; for ``"kfac"`` every block's) this is a closed-form
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
from torch import nn

from posteriorzoo.errors import InvalidOptionError, NonFiniteWeightsError, PosteriorZooError
from posteriorzoo.options import check_choice
from posteriorzoo.vocabulary import (
    AUTO_FULL_LAPLACE_PARAMETERS,
    STRUCTURES,
)
from train_zoo.methods.base import (
    Context,
    Method,
    ModeRun,
    Posterior,
    Resolved,
    declared_options,
)
from train_zoo.methods.common import Params, flatten, parameters_of, state_dict_of, unflatten
from train_zoo.methods.laplace_curvature import (
    Batch,
    DiagCurvature,
    FullCurvature,
    KronCurvature,
    clipped_eigh,
    diag_ggn,
    full_ggn,
    kron_last_layer,
    positive_int,
)
from train_zoo.methods.laplace_kron import (
    LayerKronCurvature,
    kron_layers,
    layer_kron_curvature,
    uncovered_parameters,
)

__all__ = [
    "MAX_FULL_PARAMETERS",
    "STRUCTURES",
    "LaplaceState",
    "draw",
    "init",
    "log_evidence",
    "optimal_prior_precision",
    "posterior_precision",
    "sample",
]

# STRUCTURES: the values of the ``structure`` option (the vocabulary's, with "auto").
#: Every structure's curvature.
Curvature = FullCurvature | LayerKronCurvature | DiagCurvature | KronCurvature
#: Largest parameter count for ``structure="full"`` (a dense ``D x D`` float64 matrix: 3.2 GB).
MAX_FULL_PARAMETERS = 20_000
# Brent's method stops when log(delta) is known to this absolute accuracy.
_LOG_DELTA_TOL = 1e-10


@dataclass(frozen=True)
class LaplaceState:
    """A fitted Laplace approximation ``N(mean, P^-1)`` over the parameters ``names``.

    Attributes
    ----------
    structure : str
        One of :data:`STRUCTURES`.
    names : tuple of str
        The varying parameters, in the order of ``mean`` (all of them for ``"full"``,
        ``"kfac"`` and ``"diag"``; the last layer's ``weight`` and ``bias`` for
        ``"last-layer-kfac"``).
    mean : torch.Tensor
        ``(D,)`` float64, the MAP values of ``names`` flattened (row-major, concatenated).
    params, buffers : dict of str to torch.Tensor
        All MAP parameters and buffers; those not in ``names`` are copied into every sample.
    curvature : FullCurvature, LayerKronCurvature, DiagCurvature or KronCurvature
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
    curvature: Curvature
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

def _positive_real(value: object, option: str) -> float:
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        number = float(value)
        if math.isfinite(number) and number > 0:
            return number
    raise InvalidOptionError(f"laplace option '{option}' must be a finite number > 0, "
                             f"not {value!r}")


def _check_structure(structure: object) -> str:
    return check_choice("laplace option 'structure'", structure, STRUCTURES)


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


# ----------------------------------------------------------------------------- numerics
# A diverged base network (non-finite weights, or outputs that overflow) and a prior
# precision too small for the GGN's rounding would otherwise fail deep inside eigh or
# cholesky (torch's LinAlgError); these say which and what to do, in one line.

def _check_finite_weights(params: Mapping[str, torch.Tensor]) -> None:
    bad = [name for name, value in params.items()
           if value.is_floating_point() and not bool(torch.isfinite(value).all())]
    if bad:
        raise NonFiniteWeightsError(
            f"the base network's weights are not finite ({', '.join(bad[:3])}"
            f"{', ...' if len(bad) > 3 else ''}): its training diverged; lower the recipe's "
            "lr (or weight_decay)")


def _check_finite_curvature(*factors: torch.Tensor) -> None:
    if not all(bool(torch.isfinite(factor).all()) for factor in factors):
        raise NonFiniteWeightsError(
            "the curvature (GGN) at the base network's weights is not finite: its outputs "
            "overflow, so its training diverged; lower the recipe's lr (or weight_decay)")


def _eigen(function, matrix: torch.Tensor):  # noqa: ANN001, ANN202 -- eigh or eigvalsh
    """``function(matrix)``, a LinAlgError as a one-line PosteriorZooError."""
    try:
        return function(matrix)
    except torch.linalg.LinAlgError:
        raise NonFiniteWeightsError(
            "the curvature (GGN) at the base network's weights has no eigendecomposition "
            "(ill-conditioned beyond float64: did its training diverge?); lower the recipe's "
            "lr") from None


def _cholesky(ggn: torch.Tensor, delta: float, source: str) -> torch.Tensor:
    """The Cholesky factor of ``ggn + delta I``, or a one-line error suggesting the
    smallest power of ten that gives a positive-definite posterior precision."""
    eye = torch.eye(len(ggn), dtype=torch.float64)
    factor, info = torch.linalg.cholesky_ex(ggn + delta * eye)
    if int(info) == 0:
        return factor
    values = torch.linalg.eigvalsh(ggn)
    lowest, largest = float(values[0]), float(values[-1])
    # The GGN is PSD only up to rounding (its smallest eigenvalues are slightly negative):
    # delta must outweigh that. Start at ten times the rounding, confirm by factorising.
    suggestion = 10.0 ** math.ceil(math.log10(max(-10 * lowest, 1e-12 * abs(largest),
                                                  delta, 1e-300)))
    for _ in range(40):
        if int(torch.linalg.cholesky_ex(ggn + suggestion * eye)[1]) == 0:
            break
        suggestion *= 10
    given = "the evidence's optimum" if source == "marglik" else "prior_precision"
    raise InvalidOptionError(
        f"the posterior precision GGN + delta I is not positive definite with {given} "
        f"delta = {delta:.3g}: too small next to the GGN's rounding (its eigenvalues run "
        f"from {lowest:.2g} to {largest:.3g}); use laplace option prior_precision >= "
        f"{max(suggestion, 1e-8):g}")


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
    from scipy.optimize import brentq  # here: scipy.optimize costs every worker 0.4 s to import

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
    structure : {"full", "kfac", "diag", "last-layer-kfac"}, default "full"
        Dense GGN over all parameters, Kronecker-factored GGN of every ``Linear`` and
        ``Conv2d`` layer, the GGN's diagonal, or Kronecker-factored GGN of the final
        ``Linear``.
    prior_precision : "marglik", "training" or float, default "marglik"
        How ``delta`` is set (module docstring).
    weight_decay : float, optional
        The training weight decay; needed for and only allowed with ``"training"``.
    chunk_size : int, default 256
        Examples per Jacobian call (not ``"last-layer-kfac"``; ``"diag"`` takes fewer for
        a large network).

    Returns
    -------
    LaplaceState

    Raises
    ------
    InvalidOptionError
        A bad option value, no batch, a ``"full"`` model with more than
        :data:`MAX_FULL_PARAMETERS` parameters, a last layer that is not ``Linear``, a
        ``"kfac"`` network with parameters outside ``Linear`` and ``Conv2d`` layers, a
        ``"marglik"`` evidence without a finite maximiser, or a prior precision too small
        for ``G + delta I`` to be positive definite in float64 (the message suggests one).
    NonFiniteWeightsError
        The base network diverged: non-finite weights, or a curvature that is not finite.
    """
    structure = _check_structure(structure)
    source, delta, decay = _check_prior(prior_precision, weight_decay)
    num_data = positive_int(num_data, "num_data")
    chunk_size = positive_int(chunk_size, "chunk_size")
    params = {name: value.detach().clone() for name, value in params.items()}
    buffers = {name: value.detach().clone() for name, value in buffers.items()}
    _check_finite_weights(params)

    curvature: Curvature
    if structure == "full":
        dim = sum(value.numel() for value in params.values())
        if dim > MAX_FULL_PARAMETERS:
            raise InvalidOptionError(
                f"laplace option 'structure'='full' needs a dense {dim} x {dim} matrix (limit "
                f"{MAX_FULL_PARAMETERS} parameters): use 'kfac', 'diag' or 'last-layer-kfac'")
        ggn, nll, count = full_ggn(model, params, buffers, batches, chunk_size=chunk_size)
        scale = num_data / count
        ggn, nll = ggn * scale, nll * scale
        _check_finite_curvature(ggn)
        eigenvalues = _eigen(torch.linalg.eigvalsh, ggn).clamp_min(0.0)
        names = tuple(params)
    elif structure == "diag":
        diagonal, nll, count = diag_ggn(model, params, buffers, batches,
                                        chunk_size=chunk_size)
        scale = num_data / count
        diagonal, nll = diagonal * scale, nll * scale
        _check_finite_curvature(diagonal)
        diag = DiagCurvature(diagonal)
        eigenvalues = diag.eigenvalues()
        curvature = diag
        names = tuple(params)
    elif structure == "kfac":
        factors, nll, count = kron_layers(model, params, buffers, batches,
                                          chunk_size=chunk_size)
        nll *= num_data / count
        _check_finite_curvature(*(f.out_sum for f in factors),
                                *(a for f in factors for a in f.in_sums))
        curvature = layer_kron_curvature(factors, params, num_data / count, count,
                                         lambda matrix: _eigen(clipped_eigh, matrix))
        eigenvalues = curvature.eigenvalues()
        names = tuple(params)
    else:
        layer, lambda_sum, activation_sum, nll, count = kron_last_layer(
            model, params, buffers, batches)
        scale = num_data / count
        out_factor, in_factor, nll = lambda_sum * scale, activation_sum / count, nll * scale
        _check_finite_curvature(out_factor, in_factor)
        has_bias = f"{layer}.bias" in params
        names = (f"{layer}.weight",) + ((f"{layer}.bias",) if has_bias else ())
        out_eigen = _eigen(clipped_eigh, out_factor)
        kron = KronCurvature(layer, out_factor, in_factor, out_eigen,
                             _eigen(clipped_eigh, in_factor), out_eigen if has_bias else None)
        eigenvalues = kron.eigenvalues()
        curvature = kron

    mean = flatten({name: params[name] for name in names}).double()
    squared_norm = float(mean @ mean)
    if source == "marglik":
        delta = optimal_prior_precision(eigenvalues, squared_norm)
    elif source == "training" and decay is not None:
        delta = num_data * decay
    if delta is None:
        # _check_prior gives a fixed delta, or a weight decay for "training", or "marglik".
        raise ValueError(f"laplace: prior_precision source {source!r} left delta unresolved "
                         f"(weight_decay {decay!r})")
    if structure == "full":
        curvature = FullCurvature(ggn, eigenvalues, _cholesky(ggn, delta, source))
    return LaplaceState(structure, names, mean, params, buffers, curvature, float(delta),
                        source, decay, log_evidence(eigenvalues, nll, squared_norm, delta),
                        float(nll), num_data, count)


def posterior_precision(state: LaplaceState) -> torch.Tensor:
    """The dense posterior precision ``P`` ``(D, D)`` float64, in the order of ``state.mean``.

    For ``"last-layer-kfac"`` this is ``block_diag(kron(B, A) + delta I, C + delta I)``,
    for ``"kfac"`` the same over every layer's blocks, for ``"diag"`` ``diag(G) + delta
    I``; it allocates ``D^2`` floats, so it is meant for checks on small networks.
    """
    delta = state.prior_precision
    curvature = state.curvature
    eye = torch.eye(state.dimension, dtype=torch.float64)
    if isinstance(curvature, FullCurvature):
        return curvature.ggn + delta * eye
    if isinstance(curvature, DiagCurvature):
        return torch.diag(curvature.diagonal + delta)
    if isinstance(curvature, LayerKronCurvature):
        return curvature.matrix() + delta * eye
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
        The only source of randomness. Draws are taken one after another (``"full"``,
        ``"diag"``: ``D`` normals each; ``"last-layer-kfac"``: ``K * F`` for the weight,
        then ``K`` for the bias; ``"kfac"``: each block's in turn), so draw ``s`` does not
        depend on ``count``.
    count : int
        Number of draws (>= 1).

    Returns
    -------
    torch.Tensor
        ``(count, D)`` float64, in the order of ``state.names`` (as :func:`flatten`).
        ``"full"``: ``mean + L^-T z`` with ``P = L L^T``; ``"diag"``: ``mean + z /
        sqrt(diag(G) + delta)``; ``"kfac"``: per block as for the last layer's;
        ``"last-layer-kfac"``: weight
        ``W* + U (Z / sqrt(beta alpha^T + delta)) V^T``, bias ``b* + U_C z / sqrt(gamma +
        delta)`` (module docstring).
    """
    count = positive_int(count, "count")
    if not isinstance(generator, torch.Generator):
        raise InvalidOptionError(f"laplace option 'generator' must be a torch.Generator, "
                                 f"not {type(generator).__name__}")
    curvature, delta = state.curvature, state.prior_precision
    if isinstance(curvature, LayerKronCurvature):
        return state.mean + curvature.draw(generator, count, delta)
    if isinstance(curvature, FullCurvature | DiagCurvature):
        z = torch.stack([torch.randn(state.dimension, generator=generator, dtype=torch.float64)
                         for _ in range(count)])                                 # (S, D)
        if isinstance(curvature, DiagCurvature):
            return state.mean + z * (curvature.diagonal + delta).rsqrt()
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


# ---------------------------------------------------------------- the method
# PRIOR_PRECISION_RANGE (a prior precision delta's, Laplace's and SGHMC's) and
# LAPLACE_STRUCTURES are the vocabulary's. ``structure = "auto"`` takes the full GGN up to
# AUTO_FULL_LAPLACE_PARAMETERS (5,000) parameters and last-layer KFAC above. The full GGN
# is a dense D x D float64 matrix (5,000: 200 MB; the hard limit of MAX_FULL_PARAMETERS is
# 3.2 GB) built from N x (K - 1) Jacobian rows, N (K - 1) D^2 multiply-adds, so its time
# grows as D^2: on Fashion-MNIST, one torch thread of these CPUs, about 24 s for OptuNet's
# 392 parameters and 27 min for an MLP 784-6-10 of 4,780 (``posteriorzoo train
# --dry-run``'s measured estimate), 7 h at the hard limit. OptuNet and its v1 (355) are
# far below, ResNets (millions) and an MNIST MLP of width 32 (25,450) above.
#: Examples per batch when the curvature reads the training set.
READ_BATCH = 500


def _structure_auto(context: Context) -> Resolved:
    count = context.parameter_count()
    bound = AUTO_FULL_LAPLACE_PARAMETERS
    if count <= bound:
        return Resolved("full", f"auto: {context.architecture} has {count:,} parameters, "
                                f"at most {bound:,}")
    return Resolved("last-layer-kfac",
                    f"auto: {context.architecture} has {count:,} parameters, above {bound:,}",
                    f"laplace: structure last-layer-kfac (auto: {context.architecture} has "
                    f"{count:,} parameters, above the {bound:,} up to which the full GGN "
                    "is used)")


def check_dense(what: str, value: str, context: Context, matrix: str, instead: str) -> None:
    """Refuse a dense D x D matrix of the parameters past :data:`MAX_FULL_PARAMETERS`
    (the full GGN here, SGHMC's mass matrix)."""
    count = context.parameter_count()
    if count > MAX_FULL_PARAMETERS:
        raise InvalidOptionError(
            f"{what} is {value!r}, but {context.architecture} has {count:,} parameters: "
            f"{matrix} is limited to {MAX_FULL_PARAMETERS:,} (use {instead})")


def check_kfac(what: str, value: str, context: Context) -> None:
    """Refuse ``"kfac"`` for an architecture with parameters outside ``Linear`` and
    ``Conv2d`` layers (BatchNorm's, ...), from the model built on the ``meta`` device:
    when the spec is read, not after training."""
    from posteriorzoo.models import build

    with torch.device("meta"):
        model = build(context.architecture, context.num_classes, **context.model_options)
    uncovered = uncovered_parameters(model)
    if uncovered:
        name, kind = uncovered[0]
        raise InvalidOptionError(
            f"{what} is {value!r}, but {context.architecture} has parameters outside Linear "
            f"and Conv2d layers ({len(uncovered)}, the first {name!r} of a {kind}), which "
            "kfac does not cover (use 'diag' or 'last-layer-kfac')")


def _structure(what: str, value: object, context: Context) -> object:
    if value == "auto":
        return _structure_auto(context)
    if value == "full":
        check_dense(what, value, context, "a dense GGN",
                    "'kfac', 'diag', 'last-layer-kfac' or 'auto'")
    if value == "kfac":
        check_kfac(what, value, context)
    return value


@dataclass(frozen=True)
class LaplacePosterior:
    """The base network and the Laplace approximation fitted at its weights."""

    model: nn.Module
    state: LaplaceState


class Laplace(Method):
    """The Laplace approximation: no phase of its own; the curvature (GGN) of the trained
    base network, the prior precision by the evidence or the weight decay."""

    name = "laplace"
    summary = "the Laplace approximation (GGN curvature) at each trained base network"
    fits_curvature = True
    #: The vocabulary's options; ``auto`` completed and the dense-matrix and KFAC limits
    #: checked against the model.
    options = declared_options("laplace", checks={"structure": _structure})

    def fit(self, run: ModeRun) -> Posterior:
        spec = run.spec
        model, steps = run.engine.train_base()
        opts = spec.method_options
        params, buffers = parameters_of(model)
        prior = opts["prior_precision"]
        try:
            state = init(model, params, buffers,
                         run.engine.read_batches(run.seeds.method, READ_BATCH),
                         run.num_data, structure=opts["structure"], prior_precision=prior,
                         weight_decay=spec.recipe.weight_decay if prior == "training" else None)
        except PosteriorZooError as error:  # a diverged base network, a too small prior
            raise type(error)(f"laplace mode {run.index}: {error}") from None
        evidence = float(state.log_evidence)
        record = {"method": "laplace", "structure": state.structure,
                  "prior_precision": float(state.prior_precision),
                  "prior_source": state.prior_source,
                  "log_evidence": evidence if math.isfinite(evidence) else None}
        return Posterior(LaplacePosterior(model, state), steps, run.engine.name, record)

    def sample(self, state: LaplacePosterior, generator: torch.Generator, count: int
               ) -> list[dict[str, torch.Tensor]]:
        return sample(state.model, state.state, generator, count)


METHOD = Laplace()
