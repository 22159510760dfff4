"""The Laplace structures ``kfac`` (every Linear and Conv2d layer) and ``diag`` beside
``full`` and ``last-layer-kfac`` (train_zoo.methods.laplace, laplace_curvature,
laplace_kron): known answers, sampling, the evidence and laplace-torch 0.3 as the oracle.

Known answers: ``diag`` sums the very same GGN rows as ``full`` (so the two diagonals
differ by summation rounding only); for one example and a layer with one output position
the GGN block of a weight *is* ``kron(B, a a^T)``, so ``kfac`` must equal the full GGN's
blocks there (also per group of a grouped convolution).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from rounding_bounds import U32, U64, cross_entropy_rounding, forward_terms, gamma
from torch import nn
from zoo_helpers import run

from posteriorzoo.errors import InvalidOptionError
from posteriorzoo.models import build
from posteriorzoo.zoo import open_zoo
from train_zoo.methods import laplace, laplace_curvature
from train_zoo.methods.common import parameters_of

# Whitened statistical check (as in test_method_laplace): float64 normals from a seeded
# generator moved by float64 algebra, so each z-score is a fixed number; Z_BOUND standard
# deviations fail a seed with probability < 1e-4 over all entries.
Z_BOUND = 5.0


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: one intra-op thread avoids thread barriers on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def digits():
    """200 sklearn digits images ``(200, 1, 8, 8)`` in [0, 1] and their labels."""
    from sklearn.datasets import load_digits
    data = load_digits()
    x = torch.tensor(data.images[:200], dtype=torch.float32).unsqueeze(1) / 16
    return x, torch.tensor(data.target[:200])


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(3, 4, 3, stride=2), nn.ReLU(), nn.Flatten(),
                         nn.Linear(36, 10))


def _mlp() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 8), nn.ReLU(), nn.Linear(8, 10))


def _optunet_sequential(model: nn.Module) -> nn.Module:
    """OptuNet's modules (the same parameters) as the Sequential BackPACK needs."""
    return nn.Sequential(model.conv1, model.relu1, model.pool1, model.conv2, model.relu2,
                         model.pool2, model.flatten, model.dropout, model.fc)


def _optunet(x: torch.Tensor) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(2)
    return build("optunet"), nn.functional.interpolate(x, size=28)


def _whitened_check(draws: torch.Tensor, mean: torch.Tensor, precision: torch.Tensor) -> None:
    """Assert ``draws`` ``(S, D)`` look like ``N(mean, precision^-1)``: in ``w = L^T
    (theta - mean)`` a sample mean has standard deviation ``1/sqrt(S)``, a covariance
    entry ``1/sqrt(S)`` off the diagonal and ``sqrt(2/S)`` on it."""
    count, dim = draws.shape
    white = (draws - mean) @ torch.linalg.cholesky(precision)
    assert (white.mean(0) * math.sqrt(count)).abs().max() < Z_BOUND
    cov = white.T @ white / count
    sd = torch.full((dim, dim), 1 / math.sqrt(count), dtype=torch.float64)
    sd.diagonal().fill_(math.sqrt(2 / count))
    z = (cov - torch.eye(dim, dtype=torch.float64)) / sd
    assert z.abs().max() < Z_BOUND, float(z.abs().max())


# --- known answers --------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_diag_is_the_diagonal_of_the_full_ggn(digits, dtype):
    """Both sum ``m_i^2`` over the same rows ``m`` (:func:`ggn_rows`); ``diag`` squares
    them exactly in float64 (a float32 square fits in 53 bits) and sums in float64:
    within ``gamma(R, u64)`` of the exact sum of these squares, a sum of ``R = n (K - 1)``
    non-negative terms. ``full`` sums float32 rows with ``ssyrk`` in float32 blocks of at
    most 8,192 rows and the blocks in float64 (``gamma(min(R, 8192)) + gamma(R, u64)``),
    float64 rows with ``dsyrk`` (``gamma(R, u64)``). So entrywise
    ``|full_ii - diag_i| <= (that + gamma(R, u64)) diag_i``: relative 5e-4 in float32,
    2e-13 in float64 for the OptuNet / MLP here; a missing example or row moves an entry
    by ~1/R, 4e-3."""
    x, y = digits
    if dtype == torch.float32:
        model, x = _optunet(x)                       # the layer-formula row path
    else:
        model, x = _mlp().double(), x.double()       # the generic vmap path
    params, buffers = parameters_of(model)
    batches = [(x[:90], y[:90]), (x[90:], y[90:])]
    ggn, nll, count = laplace_curvature.full_ggn(model, params, buffers, batches,
                                                 chunk_size=64)
    diagonal, diag_nll, diag_count = laplace_curvature.diag_ggn(model, params, buffers,
                                                                batches, chunk_size=64)
    rows = count * 9
    rel = (gamma(min(rows, laplace_curvature.GRAM_BLOCK_ROWS)) if dtype == torch.float32
           else 0.0) + 2 * gamma(rows, U64)
    assert diag_count == count == 200 and diag_nll == nll
    assert bool((diagonal >= 0).all())
    assert bool(((ggn.diagonal() - diagonal).abs() <= rel * diagonal).all()), float(
        ((ggn.diagonal() - diagonal).abs() / diagonal.clamp_min(1e-300)).max())


def _one_layer(kind: str) -> tuple[nn.Module, torch.Tensor]:
    """A float64 single-layer network and one example whose layer has one output
    position (T = 1), where KFAC's ``kron(B, a a^T)`` is the GGN block exactly."""
    torch.manual_seed(3)
    if kind == "linear":
        return nn.Sequential(nn.Linear(5, 4)).double(), torch.randn(1, 5, dtype=torch.float64)
    groups = 2 if kind == "grouped" else 1
    conv = nn.Conv2d(2, 4, 3, groups=groups)
    return (nn.Sequential(conv, nn.Flatten()).double(),
            torch.randn(1, 2, 3, 3, dtype=torch.float64))


@pytest.mark.parametrize("kind", ["linear", "conv", "grouped"])
def test_kfac_of_one_example_is_the_exact_ggn_block(kind):
    """One example, one output position: the weight's GGN block is ``sum_k (s_k s_k^T)
    (x) (a a^T) = kron(B, A)`` (per group ``j`` for a grouped convolution: ``kron(B_j,
    a_j a_j^T)``, the cross-group blocks dropped) and the bias's is ``B``. Both sides are
    float64 sums of products of the same quantities: ``B`` sums ``K - 1`` products of
    rows, ``A`` one product, each entry of a row carries the backward pass's ``F + K + 8``
    roundings (``F`` the layer's fan-in) and ``P``'s scale is its largest entry:
    ``4 gamma(F + 2K + 10, u64)`` of it. A wrong group's inputs, a missing factor or the
    bias's block left out moves entries by O(1) of it."""
    model, x = _one_layer(kind)
    y = torch.tensor([1])
    params, buffers = parameters_of(model)
    full = laplace.init(model, params, buffers, [(x, y)], 1, prior_precision=0.5)
    kfac = laplace.init(model, params, buffers, [(x, y)], 1, structure="kfac",
                        prior_precision=0.5)
    ours, exact = laplace.posterior_precision(kfac), laplace.posterior_precision(full)
    layer = model[0]
    weight = layer.weight.numel()
    groups = getattr(layer, "groups", 1)
    size = weight // groups
    mask = torch.zeros_like(exact, dtype=torch.bool)
    for j in range(groups):
        mask[j * size:(j + 1) * size, j * size:(j + 1) * size] = True
    mask[weight:, weight:] = True
    fan_in = weight // layer.weight.shape[0]
    tolerance = 4 * gamma(fan_in + 2 * 4 + 10, U64) * float(exact.abs().max())
    torch.testing.assert_close(ours[mask], exact[mask], rtol=0, atol=tolerance)
    assert bool((ours[~mask] == 0).all())
    # and the cross blocks it drops are not zero in the GGN: the test sees the structure
    assert float(exact[~mask].abs().max()) > 100 * tolerance


# --- samples --------------------------------------------------------------------------

@pytest.mark.parametrize("structure", ["kfac", "diag"])
def test_samples_follow_the_structure_gaussian(structure):
    """20,000 draws of a 17-parameter MLP have the structure's inverse precision as
    covariance (whitened check) and the MAP as mean; draws are reproducible and draw
    ``s`` does not depend on how many are taken."""
    torch.manual_seed(4)
    model = build("mlp", widths=(3, 2, 3)).double()
    x = torch.randn(30, 3, dtype=torch.float64)
    y = torch.randint(0, 3, (30,))
    params, buffers = parameters_of(model)
    state = laplace.init(model, params, buffers, [(x, y)], 30, structure=structure,
                         prior_precision=0.3)
    draws = laplace.draw(state, torch.Generator().manual_seed(0), 20_000)
    assert draws.shape == (20_000, 17)
    _whitened_check(draws, state.mean, laplace.posterior_precision(state))
    again = laplace.draw(state, torch.Generator().manual_seed(0), 3)
    assert torch.equal(again, draws[:3])
    checkpoints = laplace.sample(model, state, torch.Generator().manual_seed(0), 2)
    assert set(checkpoints[0]) == set(model.state_dict())


def test_a_wrong_covariance_fails_the_check():
    """The whitened check can fail: draws with a doubled variance are refused."""
    torch.manual_seed(4)
    model = build("mlp", widths=(3, 2, 3)).double()
    x, y = torch.randn(30, 3, dtype=torch.float64), torch.randint(0, 3, (30,))
    params, buffers = parameters_of(model)
    state = laplace.init(model, params, buffers, [(x, y)], 30, structure="diag",
                         prior_precision=0.3)
    draws = laplace.draw(state, torch.Generator().manual_seed(0), 20_000)
    wrong = state.mean + (draws - state.mean) * math.sqrt(2)
    with pytest.raises(AssertionError):
        _whitened_check(wrong, state.mean, laplace.posterior_precision(state))


# --- the evidence ---------------------------------------------------------------------

@pytest.mark.parametrize("structure", ["kfac", "diag"])
def test_marglik_prior_precision_maximises_the_structure_evidence(digits, structure):
    """The marglik delta beats a grid around it on the structure's own evidence, and the
    evidence is the dense formula ``-L - 1/2 (logdet P - D log delta + delta |theta|^2)``
    on ``P`` from :func:`posterior_precision` (``slogdet``, float64: within ``gamma(D^2)
    cond(P)`` of each log-eigenvalue, 1e-9 here, against the eigenvalue form; differences
    from the grid's neighbours are 1e-4 and more)."""
    x, y = digits
    model = _mlp()
    params, buffers = parameters_of(model)
    state = laplace.init(model, params, buffers, [(x, y)], len(y), structure=structure)
    assert state.prior_source == "marglik"
    eigenvalues = state.curvature.eigenvalues()
    squared = float(state.mean @ state.mean)
    best = laplace.log_evidence(eigenvalues, state.nll, squared, state.prior_precision)
    assert best == state.log_evidence
    for factor in (0.5, 0.8, 0.95, 0.99, 1.01, 1.05, 1.25, 2.0):
        other = laplace.log_evidence(eigenvalues, state.nll, squared,
                                     state.prior_precision * factor)
        assert other < best
    delta, dim = state.prior_precision, state.dimension
    precision = laplace.posterior_precision(state)
    logdet = float(torch.linalg.slogdet(precision)[1])
    dense = -state.nll - 0.5 * (logdet - dim * math.log(delta) + delta * squared)
    cond = float(torch.linalg.cond(precision))
    bound = dim * gamma(dim * dim, U64) * cond + gamma(dim + 2, U64) * (
        abs(logdet) + dim * abs(math.log(delta)) + delta * squared + state.nll)
    assert abs(dense - state.log_evidence) <= bound


# --- oracle: laplace-torch 0.3 with BackPACK ------------------------------------------

def _oracle():
    return pytest.importorskip(
        "laplace", reason="laplace-torch 0.3 (the oracle) is not installed: `make test` "
                          "installs it (Makefile, oracle step)")


def _tolerances(model: nn.Module, x: torch.Tensor, ours: torch.Tensor, state,
                classes: int) -> tuple[float, float]:
    """How far laplace-torch's precision and evidence may lie from ours, from rounding:
    ``(bound on max |P_theirs - P_ours| relative to max |P_ours|, bound on the log
    evidence)``.

    The factors are sums of products: ``B`` of ``n K`` rows (theirs: ``K`` square-root
    columns per example; ours ``K - 1``, summed in float64), each a sum of ``T`` output
    positions; ``A`` (and ``diag``) of ``n T`` products. A sum of products is within
    ``gamma(length)`` of the sum of the absolute products, which bounds the largest
    entry (Cauchy-Schwarz: ``|B_ij| <= max_i B_ii``), and each factor of a product carries
    its own pass's roundings: ``k = 2 F + K + 10 + T`` for a row (forward and backward,
    :func:`forward_terms` ``F``, the softmax's ``K + 10``, a weight's sum over the ``T``
    positions), ``F`` for an input; ``T`` is the most output positions of any
    convolution. A Kronecker entry adds the relative errors of its two factors. Two
    implementations: twice each. Here ``n = 200``, ``T = 64`` (the CNN) or 625
    (OptuNet): 1.8e-3 and 1.6e-2 of the largest entry, against measured 6e-7-1.1e-6
    (kfac) and 6e-8-9e-8 (diag); a convolution's ``A`` as a mean over the positions
    instead of their sum (Curvlinops' scaling) is off by 2.7 of it.

    The evidence (as in test_method_laplace's last-layer oracle): the log-likelihood
    moves by ``n`` times the cross-entropy's rounding and the logits' ``2 gamma(F)``;
    ``log det P`` by ``sum |P^-1| |dP|`` plus their float32 eigendecompositions /
    logarithms (``tr(P^-1) 2 gamma(q^2) ||P - delta I||_2``, ``q`` the largest factor's
    order; ``(4 u + gamma(D)) sum |log eig|``); ``D log delta`` and ``delta |theta|^2``
    ``gamma(D + 1)`` of themselves.
    """
    terms = forward_terms(model, x[:1])
    n, positions = len(x), _positions(model, x[:1])
    row, patch = gamma(2 * terms + classes + 10 + positions), gamma(terms)
    out_rel = gamma(n * classes + positions) + 2 * row
    in_rel = gamma(n * positions) + 2 * patch
    rel = 2 * (out_rel + in_rel + out_rel * in_rel) + 2 * U32
    bound = rel * float(ours.abs().max())
    with torch.no_grad():
        out = model(x)
    loglik = n * (2 * gamma(terms) * float(out.abs().max()) + cross_entropy_rounding(out))
    delta, dim = state.prior_precision, len(ours)
    inverse = torch.linalg.inv(ours)
    order = max(max(p.shape) if p.dim() else 1 for p in model.parameters())
    order = max(order, max(p[0].numel() for p in model.parameters()))
    curvature = float(torch.linalg.matrix_norm(
        ours - delta * torch.eye(dim, dtype=ours.dtype), 2))
    logs = float(torch.linalg.eigvalsh(ours).log().abs().sum())
    log_det = (float(inverse.abs().sum()) * bound
               + float(inverse.diagonal().sum()) * 2 * gamma(order ** 2) * curvature
               + (4 * U32 + gamma(dim)) * logs)
    prior = 2 * gamma(dim + 1) * (delta * float(state.mean @ state.mean)
                                  + dim * abs(math.log(delta)))
    return rel, loglik + (log_det + prior) / 2


def _positions(model: nn.Module, x: torch.Tensor) -> int:
    """The most output positions ``T`` of any ``Conv2d`` of ``model`` on ``x`` (1 without)."""
    found = [1]
    handles = [m.register_forward_hook(lambda m, i, o: found.append(o[0, 0].numel()))
               for m in model.modules() if isinstance(m, nn.Conv2d)]
    with torch.no_grad():
        model(x)
    for handle in handles:
        handle.remove()
    return max(found)


@pytest.mark.parametrize(("net", "structure"), [
    ("cnn", "kfac"), ("mlp", "kfac"), ("cnn", "diag"), ("mlp", "diag"), ("optunet", "diag"),
])
def test_oracle_precision_and_evidence(digits, net, structure):
    """laplace-torch's KronLaplace / DiagLaplace (BackPackGGN: KFLR, DiagGGNExact) on the
    same network and data: the posterior precision and the log evidence at our marglik
    delta agree within :func:`_tolerances`, and its Adam-fitted delta lands near ours.
    (BackPACK refuses OptuNet's grouped convolution for ``kron``; the grouped blocks are
    checked against the exact GGN above.)"""
    lt = _oracle()
    from laplace.curvature import BackPackGGN
    from torch.utils.data import DataLoader, TensorDataset
    x, y = digits
    if net == "optunet":
        model, x = _optunet(x)
    else:
        model = _cnn() if net == "cnn" else _mlp()
    params, buffers = parameters_of(model)
    state = laplace.init(model, params, buffers, [(x[:130], y[:130]), (x[130:], y[130:])],
                         len(y), structure=structure)
    ours = laplace.posterior_precision(state)
    theirs_model = copy.deepcopy(_optunet_sequential(model) if net == "optunet" else model)
    la = lt.Laplace(theirs_model, "classification", subset_of_weights="all",
                    hessian_structure="kron" if structure == "kfac" else "diag",
                    backend=BackPackGGN, prior_precision=state.prior_precision)
    la.fit(DataLoader(TensorDataset(x, y), batch_size=64))
    precision = la.posterior_precision
    theirs = (precision.to_matrix() if structure == "kfac" else torch.diag(precision)).double()
    rel, evidence_bound = _tolerances(model, x, ours, state, 10)
    measured = float((theirs - ours).abs().max() / ours.abs().max())
    assert measured <= rel, (measured, rel)
    evidence = float(la.log_marginal_likelihood())
    assert abs(state.log_evidence - evidence) <= evidence_bound, (
        state.log_evidence, evidence, evidence_bound)
    # their marglik: 100 Adam steps of 0.1 on log delta from 1, an optimiser's stop, not
    # rounding; half a step (0.05) is asked of it
    la.optimize_prior_precision(pred_type="glm", method="marglik", prior_structure="scalar")
    assert abs(math.log(float(la.prior_precision) / state.prior_precision)) < 0.05


# --- bad input ------------------------------------------------------------------------

def _spec(architecture: str, structure: object):
    from train_zoo import make_spec
    return make_spec("optunet-mnist", dataset="digits", method="laplace", checkpoints=2,
                     architecture=architecture, method_options={"structure": structure})


def test_unknown_structure_and_unsupported_layers_are_one_clear_error():
    model = build("mlp", widths=(3, 3))
    params, buffers = parameters_of(model)
    batch = [(torch.randn(4, 3), torch.tensor([0, 1, 2, 0]))]
    for bad in ("kron", "diagonal", "", None, 3):
        with pytest.raises(InvalidOptionError, match="structure") as info:
            laplace.init(model, params, buffers, batch, 4, structure=bad)
        assert "\n" not in str(info.value)
        with pytest.raises(InvalidOptionError, match="structure") as info:
            _spec("optunet", bad)
        assert "\n" not in str(info.value)
    for good in ("kfac", "diag"):
        assert _spec("optunet", good).method_options["structure"] == good
        assert good in laplace.Laplace.options[0].help
    # kfac on an architecture with BatchNorm parameters: refused when the spec is read
    with pytest.raises(InvalidOptionError, match="kfac") as info:
        _spec("resnet18", "kfac")
    assert "\n" not in str(info.value) and "'diag'" in str(info.value)
    assert _spec("resnet18", "diag").method_options["structure"] == "diag"
    batchnorm = build("mlp-bn", widths=(3, 4, 3))
    params, buffers = parameters_of(batchnorm)
    with pytest.raises(InvalidOptionError, match="kfac.*Linear and Conv2d") as info:
        laplace.init(batchnorm, params, buffers, batch, 4, structure="kfac")
    assert "\n" not in str(info.value) and "diag" in str(info.value)
    # diag takes any parameter
    state = laplace.init(batchnorm, params, buffers, batch, 4, structure="diag")
    assert state.dimension == sum(v.numel() for v in params.values())


# --- end to end -----------------------------------------------------------------------

@pytest.mark.parametrize("structure", ["kfac", "diag"])
def test_train_fits_the_structure_and_records_it(tmp_path, capsys, structure):
    """``posteriorzoo train`` with the structure: the collection holds the samples and
    the record names the structure and a finite marglik evidence."""
    spec = tmp_path / "spec.toml"
    spec.write_text('recipe = "optunet-mnist"\ndataset = "digits"\nmethod = "laplace"\n'
                    "checkpoints = 2\nbase_seed = 7\n\n[recipe_overrides]\nepochs = 1\n\n"
                    f'[method_options]\nstructure = "{structure}"\n')
    out = tmp_path / "zoo.h5"
    code, _, err = run(capsys, "train", spec, "--out", out, "--backend", "serial",
                       "--no-progress")
    assert code == 0, err
    with open_zoo(out) as zoo:
        assert len(zoo) == 2
        records = zoo.training_records()
    assert len(records) == 1     # one mode, two samples of it
    for record in records.values():
        assert record["structure"] == structure and record["prior_source"] == "marglik"
        assert math.isfinite(record["log_evidence"]) and record["prior_precision"] > 0
