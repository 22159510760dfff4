"""Bootstrap Your Own Variance (BYOV, seed 004): BYOL with a Bayes-by-Backprop student.

The student (encoder, projector, predictor: :class:`ByolNetwork`) has a mean-field
Gaussian posterior ``q(w) = N(mu, diag(exp(log_var)))`` over every parameter; the
teacher (encoder and projector) is the exponential moving average (EMA) of the student's
*means* (the paper's Fig. 1a: "the EMA of the MAP student parameters"). The loss of a
step (the generalised ELBO of the paper's Eq. 2, per training image)::

    L = BYOL(w) + beta(step) * KL(q || p) / N,    w = mu + exp(log_var / 2) * eps

with ONE weight draw ``eps ~ N(0, I)`` per batch (used for both views), ``BYOL`` the
symmetrised BYOL loss (:func:`symmetric_byol_loss`, a mean over the batch) and ``N`` the
number of training images: the BYOL loss is a per-image mean, so the KL is divided by
``N`` as in Blundell et al.'s minibatch ELBO (the paper does not say how it scales the
KL; with ``1/N`` its ``beta = 1`` is the generalised posterior of Bissiri et al.).

- ``beta`` rises from 0 to 1 along a single-cycle cosine (:func:`beta_at`; appendix C
  and Fig. 6: "all schedules start from 0.0 and follow a single cycle cosine").
- Variances are ``exp(log_var)``, ``log_var`` initialised at -10 (``sigma = exp(-5)``,
  about 0.0067); means of Conv and Linear weights start trunc-normal with standard
  deviation 0.02 (appendix C, after DeiT), truncated at two standard deviations (the
  truncated-normal initialiser of BYOL's Haiku code and TensorFlow); biases start at 0,
  normalisation weights at 1 (DeiT's ``_init_weights``).
- No weight decay (appendix C: it interferes with BBB; the KL is the regulariser).
- Priors (:data:`PRIORS`, section 3): ``standard`` N(0, I); ``teacher`` N(mu_T, I), the
  teacher's weights as prior means; ``teacher-variance`` N(mu_T, Sigma_T) with
  ``Sigma_T = diag(E[mu_S^2] - mu_T^2)``, the variance of the student means over the
  EMA window (the paper's ``theta_T^2 - bar theta_T^2`` with the second moment kept as
  its own EMA, ``bar theta_T^2 = gamma bar theta_T^2 + (1 - gamma) mu_S^2``, at the
  teacher's rate ``gamma = tau``). That variance is 0 at the start (teacher = student)
  and can round below 0, so it is floored at :data:`TEACHER_VARIANCE_FLOOR` =
  exp(-10), the posterior's initial variance (the paper does not say how it keeps
  Sigma_T positive). The predictor has no teacher: its prior is N(0, I) under every
  choice. The teacher enters the prior as a constant (no gradient).
- The teacher's rate follows BYOL: ``tau = 1 - (1 - tau_base) (cos(pi k / K) + 1) / 2``
  (:func:`tau_at`), here from ``tau_base = 0.99`` (BYOL's 0.996 is for runs of
  hundreds of thousands of steps).
- Optimiser: Adam (the paper follows BYOL's LARS at ImageNet scale): learning rate
  ``lr`` for the means, ``log_variance_lr`` (default 10 x ``lr``) for the log-variances:
  Adam moves a parameter by about its learning rate per step, and at 1e-3 the
  log-variances could move by less than 1 in the few hundred steps of a CPU run.

Deterministic BYOL (the baseline) is the same code with ``prior=None``: the weights are
the means (no draw, no KL), trained by the same optimiser from the same initialisation.

After training: :func:`snr` (``|mu| / sigma`` per weight), :func:`keep_mask` and
:func:`prune` (per layer, keep the given fraction of weights with the largest score:
SNR pruning (Graves 2011, Blundell et al. 2015, the paper's section 4.4) or magnitude
pruning ``|mu|``, no retraining), :func:`encoder_draws` (posterior samples of the
encoder as state_dicts of the registered architecture, one seed per draw).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.func import functional_call, grad_and_value

from posteriorzoo.data.transforms import (
    Compose,
    Normalize,
    RandomCrop,
    RandomHorizontalFlip,
    Transform,
)
from posteriorzoo.errors import InvalidOptionError
from posteriorzoo.options import check_choice, check_integer, check_number

__all__ = [
    "ENCODER",
    "LOG_VARIANCE_INIT",
    "MEAN_INIT_STD",
    "PRIORS",
    "PRIOR_LABELS",
    "TEACHER_VARIANCE_FLOOR",
    "ByolNetwork",
    "ByovConfig",
    "ByovRun",
    "ByovStepper",
    "GaussianNoise",
    "Posterior",
    "Teacher",
    "TwoViews",
    "augmentation",
    "beta_at",
    "byol_loss",
    "draw_noise",
    "draw_seed",
    "encoder_draws",
    "encoder_features",
    "encoder_parameters",
    "initial_posterior",
    "initial_teacher",
    "keep_mask",
    "kl_divergence",
    "layer_statistics",
    "prior_moments",
    "prune",
    "pruned_keys",
    "sample_parameters",
    "sigma",
    "snr",
    "symmetric_byol_loss",
    "tau_at",
    "teacher_update",
    "teacher_variance",
    "train_byov",
]

#: The registered encoder (:class:`posteriorzoo.models.SmallCNN`).
ENCODER = "small-cnn"
#: Initial log-variance of every parameter (appendix C): sigma = exp(-5), about 0.0067.
LOG_VARIANCE_INIT = -10.0
#: Standard deviation of the trunc-normal initial means of Conv and Linear weights.
MEAN_INIT_STD = 0.02
#: The lower bound of Sigma_T (module docstring): the posterior's initial variance.
TEACHER_VARIANCE_FLOOR = math.exp(LOG_VARIANCE_INIT)
#: The paper's three priors (section 3).
PRIORS = ("standard", "teacher", "teacher-variance")
PRIOR_LABELS = {"standard": "N(0, I)", "teacher": "N(mu_T, I)",
                "teacher-variance": "N(mu_T, Sigma_T)"}
#: Parameters the teacher has (the predictor's have none).
TEACHER_PREFIXES = ("encoder.", "projector.")

Params = dict[str, Tensor]


# --- the network ------------------------------------------------------------------------


class ByolNetwork(nn.Module):
    """BYOL's online network: the registered encoder, a projector and a predictor.

    Parameters
    ----------
    widths : sequence of int
        The encoder's block widths (:class:`posteriorzoo.models.SmallCNN`); the
        representation has ``widths[-1]`` features.
    in_channels : int
        Channels of the input images.
    hidden : int
        Hidden width of the projector and the predictor.
    projection : int
        Output width of the projector and the predictor.

    norm : {"batch", "layer"}
        The normalisation of the projector and predictor's hidden layer.

    Notes
    -----
    Projector and predictor are ``Linear - BatchNorm1d - ReLU - Linear``, BYOL's MLPs.
    The BatchNorm keeps no running statistics (``track_running_stats=False``): it always
    normalises with the batch's own, in the student and the teacher alike, so the network
    has no buffers and runs under ``torch.func.functional_call`` unchanged; only the
    encoder (GroupNorm, no batch statistics) is used after training. With LayerNorm
    instead (``norm="layer"``) this small BYOL collapsed: its loss fell to 1e-4 within
    two epochs (Fashion-MNIST, 10,000 images), where BatchNorm's stays near 0.2.
    Parameter names start with ``encoder.``, ``projector.`` and ``predictor.``; the
    encoder's are those of the registered model after the prefix. Images
    ``(B, C, H, W)`` -> :meth:`forward` the predictions ``(B, projection)``,
    :meth:`target` the projections ``(B, projection)``.
    """

    def __init__(self, widths: Sequence[int] = (16, 32, 64), in_channels: int = 1,
                 hidden: int = 128, projection: int = 32, norm: str = "batch") -> None:
        super().__init__()
        from posteriorzoo.models import build

        self.encoder_options: dict[str, Any] = {"widths": tuple(int(w) for w in widths),
                                "in_channels": int(in_channels)}
        self.encoder = build(ENCODER, **self.encoder_options)
        features = self.encoder_options["widths"][-1]
        self.projector = _mlp(features, hidden, projection, norm)
        self.predictor = _mlp(projection, hidden, projection, norm)

    def target(self, images: Tensor) -> Tensor:
        """Projections ``(B, projection)`` (what the teacher computes)."""
        return self.projector(self.encoder(images))

    def forward(self, images: Tensor) -> Tensor:
        """Predictions ``(B, projection)`` (what the student computes)."""
        return self.predictor(self.target(images))


def _mlp(inputs: int, hidden: int, outputs: int, norm: str = "batch") -> nn.Sequential:
    check_choice("norm", norm, ("batch", "layer"))
    layer = (nn.BatchNorm1d(hidden, track_running_stats=False) if norm == "batch"
             else nn.LayerNorm(hidden))
    return nn.Sequential(nn.Linear(inputs, hidden), layer, nn.ReLU(),
                         nn.Linear(hidden, outputs))


def encoder_parameters(params: Mapping[str, Tensor]) -> Params:
    """The encoder's entries of a network's parameters, keyed as the registered model's
    state_dict (the ``encoder.`` prefix removed)."""
    return {key[len("encoder."):]: value for key, value in params.items()
            if key.startswith("encoder.")}


def _call(network: ByolNetwork, params: Mapping[str, Tensor], images: Tensor,
          method: str = "forward") -> Tensor:
    """``network.<method>(images)`` with ``params`` in place of its parameters."""
    if method == "forward":
        return functional_call(network, dict(params), (images,))
    # functional_call runs forward(); the target (no predictor) needs only part of the
    # parameters, so run its two modules on their own entries.
    projector = {key[len("projector."):]: value for key, value in params.items()
                 if key.startswith("projector.")}
    features = functional_call(network.encoder, encoder_parameters(params), (images,))
    return functional_call(network.projector, projector, (features,))


# --- the posterior ---------------------------------------------------------------------


@dataclass
class Posterior:
    """A mean-field Gaussian over a network's parameters.

    Attributes
    ----------
    means, log_variances : dict of str to Tensor
        Keyed like ``network.named_parameters()``, each of its parameter's shape;
        ``sigma = exp(log_variances / 2)``.
    """

    means: Params
    log_variances: Params


def sigma(log_variances: Mapping[str, Tensor]) -> Params:
    """Standard deviations ``exp(log_var / 2)`` (same keys and shapes)."""
    return {key: torch.exp(0.5 * value) for key, value in log_variances.items()}


def initial_posterior(network: nn.Module, seed: int, *,
                      log_variance: float = LOG_VARIANCE_INIT,
                      mean_std: float = MEAN_INIT_STD) -> Posterior:
    """The starting posterior of ``network`` (appendix C).

    Weights of Conv and Linear layers: means trunc-normal ``N(0, mean_std^2)`` cut at
    ``+-2 mean_std`` (drawn in the order of ``named_parameters`` from one generator
    seeded with ``seed``); their biases 0; normalisation layers' weights 1 and biases 0.
    Every log-variance is ``log_variance``.

    Returns
    -------
    Posterior
        float32 tensors, shapes of the parameters.
    """
    generator = torch.Generator().manual_seed(int(seed))
    owners = {f"{name}.{key}" if name else key: module for name, module in network.named_modules()
              for key, _ in module.named_parameters(recurse=False)}
    means, log_variances = {}, {}
    for key, parameter in network.named_parameters():
        module = owners[key]
        value = torch.zeros(parameter.shape, dtype=torch.float32)
        if key.endswith("weight") and isinstance(module, (nn.Conv2d, nn.Linear)):
            torch.nn.init.trunc_normal_(value, 0.0, mean_std, -2 * mean_std, 2 * mean_std,
                                        generator=generator)
        elif key.endswith("weight") and isinstance(module, (nn.GroupNorm, nn.LayerNorm,
                                                               nn.BatchNorm1d)):
            value.fill_(1.0)
        means[key] = value
        log_variances[key] = torch.full(parameter.shape, float(log_variance))
    return Posterior(means, log_variances)


def sample_parameters(posterior: Posterior, noise: Mapping[str, Tensor]) -> Params:
    """One reparameterised draw ``mu + exp(log_var / 2) * noise`` (``noise`` standard
    normal, same keys and shapes)."""
    return {key: mean + torch.exp(0.5 * posterior.log_variances[key]) * noise[key]
            for key, mean in posterior.means.items()}


def draw_noise(shapes: Mapping[str, Tensor | torch.Size], generator: torch.Generator
               ) -> Params:
    """Standard normal noise of every entry's shape, drawn in key order from
    ``generator``."""
    return {key: torch.randn(tuple(value.shape) if isinstance(value, Tensor) else value,
                             generator=generator)
            for key, value in shapes.items()}


# --- priors and the KL -------------------------------------------------------------------


@dataclass
class Teacher:
    """The EMA teacher: the means of the student's encoder and projector
    (``encoder.*``, ``projector.*`` keys) and the EMA of their squares (for Sigma_T)."""

    means: Params
    second_moments: Params


def initial_teacher(posterior: Posterior) -> Teacher:
    """The teacher at the start: a copy of the student's means (BYOL), second moment
    their squares (so Sigma_T starts at 0, floored)."""
    means = {key: value.clone() for key, value in posterior.means.items()
             if key.startswith(TEACHER_PREFIXES)}
    return Teacher(means, {key: value.square() for key, value in means.items()})


def teacher_update(teacher: Teacher, student_means: Mapping[str, Tensor], tau: float
                   ) -> Teacher:
    """One EMA step: ``mu_T <- tau mu_T + (1 - tau) mu_S`` and
    ``m_T <- tau m_T + (1 - tau) mu_S^2`` for every teacher entry (new tensors)."""
    means = {key: tau * value + (1 - tau) * student_means[key]
             for key, value in teacher.means.items()}
    second = {key: tau * value + (1 - tau) * student_means[key].square()
              for key, value in teacher.second_moments.items()}
    return Teacher(means, second)


def teacher_variance(teacher: Teacher, floor: float = TEACHER_VARIANCE_FLOOR) -> Params:
    """Sigma_T's diagonal, ``max(m_T - mu_T^2, floor)`` per teacher entry."""
    return {key: (teacher.second_moments[key] - value.square()).clamp_min(floor)
            for key, value in teacher.means.items()}


def prior_moments(prior: str, shapes: Mapping[str, Tensor], teacher: Teacher | None = None
                  ) -> tuple[Params, Params]:
    """Means and variances of ``prior`` for every entry of ``shapes``.

    Parameters
    ----------
    prior : {"standard", "teacher", "teacher-variance"}
    shapes : dict of str to Tensor
        The posterior's means (only their keys and shapes are read).
    teacher : Teacher, optional
        Needed by the teacher priors; entries without a teacher (the predictor) get
        N(0, 1).

    Returns
    -------
    means, variances : dict of str to Tensor
        Detached, of each entry's shape.
    """
    check_choice("prior", prior, PRIORS)
    if prior != "standard" and teacher is None:
        raise InvalidOptionError(f"prior {prior!r} needs the teacher")
    means, variances = {}, {}
    # teacher is not None whenever the prior is not "standard" (refused above otherwise)
    taught = teacher.means if prior != "standard" and teacher is not None else {}
    covariance = (teacher_variance(teacher)
                  if prior == "teacher-variance" and teacher is not None else {})
    for key, value in shapes.items():
        zero, one = torch.zeros_like(value), torch.ones_like(value)
        has_teacher = key in taught
        means[key] = taught[key].detach() if has_teacher else zero
        variances[key] = covariance[key].detach() if key in covariance else one
    return means, variances


def kl_divergence(posterior: Posterior, prior_means: Mapping[str, Tensor],
                  prior_variances: Mapping[str, Tensor]) -> Tensor:
    """``KL(q || p)`` in nats, summed over every parameter, closed form.

    For each scalar with posterior ``N(mu, s^2)`` (``s^2 = exp(log_var)``) and prior
    ``N(m, v)``: ``(log v - log_var + (s^2 + (mu - m)^2) / v - 1) / 2``.

    Returns
    -------
    Tensor
        A scalar (float32), differentiable in the posterior's means and log-variances.
    """
    total = torch.zeros((), dtype=torch.float32)
    for key, mean in posterior.means.items():
        log_var, variance = posterior.log_variances[key], prior_variances[key]
        total = total + 0.5 * (torch.log(variance) - log_var
                               + (torch.exp(log_var) + (mean - prior_means[key]).square())
                               / variance - 1).sum()
    return total


# --- the BYOL loss and the schedules -------------------------------------------------------


def byol_loss(predictions: Tensor, targets: Tensor) -> Tensor:
    """BYOL's loss ``mean_b (2 - 2 cos(p_b, z_b))``, in [0, 4].

    Parameters
    ----------
    predictions, targets : Tensor
        ``(B, D)``; the targets are detached (no gradient flows into the teacher).
    """
    p = torch.nn.functional.normalize(predictions, dim=1)
    z = torch.nn.functional.normalize(targets.detach(), dim=1)
    return (2 - 2 * (p * z).sum(dim=1)).mean()


def symmetric_byol_loss(student_1: Tensor, student_2: Tensor, teacher_1: Tensor,
                        teacher_2: Tensor) -> Tensor:
    """BYOL's symmetrised loss: the student's prediction of view 1 against the teacher's
    projection of view 2, plus the other way round, in [0, 8]."""
    return byol_loss(student_1, teacher_2) + byol_loss(student_2, teacher_1)


def beta_at(step: int, total_steps: int, start: float = 0.0, end: float = 1.0) -> float:
    """The KL weight at ``step`` of ``total_steps``: a single-cycle (half) cosine from
    ``start`` (step 0) to ``end`` (the last step),
    ``end + (start - end) (1 + cos(pi step / total_steps)) / 2``."""
    fraction = min(max(step / total_steps, 0.0), 1.0) if total_steps > 0 else 1.0
    return end + (start - end) * (1 + math.cos(math.pi * fraction)) / 2


def tau_at(step: int, total_steps: int, base: float) -> float:
    """BYOL's teacher rate: ``1 - (1 - base) (cos(pi step / total_steps) + 1) / 2``,
    ``base`` at step 0 rising to 1 at the end."""
    fraction = min(max(step / total_steps, 0.0), 1.0) if total_steps > 0 else 1.0
    return 1 - (1 - base) * (math.cos(math.pi * fraction) + 1) / 2


# --- augmentations -------------------------------------------------------------------------


class GaussianNoise(Transform):
    """Add ``N(0, std^2)`` noise to every pixel and clip to [0, 1].

    A uint8 input (0..255) is first divided by 255; a floating input is taken to be in
    [0, 1]. Output float32, same shape. The noise is one ``torch.randn`` of the batch's
    shape from the generator (:meth:`sample`), added by :meth:`apply`.
    """

    def __init__(self, std: float) -> None:
        self.std = check_number("noise std", std, 0.0)

    def sample(self, shape: Sequence[int], generator: torch.Generator) -> Tensor:
        """Standard normal noise of ``shape`` (the batch's), float32."""
        return torch.randn(tuple(shape), generator=generator)

    def apply(self, images: Tensor, noise: Tensor) -> Tensor:
        """``clip(images + std * noise, 0, 1)``, images in [0, 1] (uint8 scaled)."""
        x = images.float() / 255.0 if images.dtype == torch.uint8 else images.float()
        return (x + self.std * noise).clamp(0.0, 1.0)

    def __call__(self, images: Tensor, generator: torch.Generator | None = None) -> Tensor:
        if generator is None:
            raise InvalidOptionError("GaussianNoise needs an explicit torch.Generator")
        return self.apply(images, self.sample(images.shape, generator))

    def __repr__(self) -> str:
        return f"GaussianNoise(std={self.std})"


class TwoViews(Transform):
    """Two augmented views of a batch, ``(2B, C, H, W)``: the first B rows are view 1,
    the last B view 2, drawn one after the other from the same generator."""

    def __init__(self, augment: Transform) -> None:
        self.augment = augment

    def __call__(self, images: Tensor, generator: torch.Generator | None = None) -> Tensor:
        return torch.cat([self.augment(images, generator), self.augment(images, generator)])


def augmentation(mean: Sequence[float], std: Sequence[float], *, padding: int = 4,
                 flip: float = 0.5, noise: float = 0.1, size: int = 28) -> Compose:
    """BYOL's augmentations at Fashion-MNIST's size: a random crop of ``size`` from the
    image zero-padded by ``padding`` pixels, a horizontal flip with probability
    ``flip``, Gaussian pixel noise of standard deviation ``noise`` (pixel units, [0, 1]
    scale, clipped), then normalisation with the dataset's ``mean`` and ``std``."""
    return Compose([RandomCrop(size, padding), RandomHorizontalFlip(flip),
                    GaussianNoise(noise), Normalize(mean, std)])


# --- training --------------------------------------------------------------------------


@dataclass(frozen=True)
class ByovConfig:
    """Training settings shared by BYOV and the deterministic baseline.

    Attributes
    ----------
    widths, hidden, projection
        The network (:class:`ByolNetwork`).
    epochs, batch_size : int
        Budget (every run of a study gets the same).
    lr, log_variance_lr : float
        Adam's learning rates of the means and of the log-variances.
    beta_start, beta_end : float
        The KL weight's single-cycle cosine (:func:`beta_at`).
    tau_base : float
        The teacher's initial EMA rate (:func:`tau_at`).
    crop_padding, augment_noise : int, float
        The augmentation (:func:`augmentation`).
    """

    widths: tuple[int, ...] = (16, 32, 64)
    hidden: int = 128
    projection: int = 32
    epochs: int = 6
    batch_size: int = 128
    lr: float = 1e-3
    log_variance_lr: float = 1e-2
    beta_start: float = 0.0
    beta_end: float = 1.0
    tau_base: float = 0.99
    crop_padding: int = 4
    augment_noise: float = 0.1

    def check(self) -> None:
        """Raise :class:`InvalidOptionError` for a value out of its range."""
        check_integer("epochs", self.epochs, 1, 10_000)
        check_integer("batch_size", self.batch_size, 2, 65_536)
        check_integer("hidden", self.hidden, 1, 65_536)
        check_integer("projection", self.projection, 1, 65_536)
        for width in self.widths:
            check_integer("every encoder width", width, 1, 4096)
        for name in ("lr", "log_variance_lr"):
            check_number(name, getattr(self, name), 0.0, strict=True, maximum=10.0)
        for name in ("beta_start", "beta_end"):
            check_number(name, getattr(self, name), 0.0, maximum=1e6)
        check_number("tau_base", self.tau_base, 0.0, maximum=1.0)
        check_integer("crop_padding", self.crop_padding, 0, 28)
        check_number("augment_noise", self.augment_noise, 0.0, maximum=1.0)


@dataclass
class ByovRun:
    """A trained student.

    Attributes
    ----------
    prior : str or None
        The prior (None: deterministic BYOL).
    network : ByolNetwork
        The architecture (its own parameters are not the trained ones).
    posterior : Posterior
        The trained means and log-variances (deterministic BYOL: its weights as the
        means, log-variances left at their initial value and unused).
    teacher : Teacher
    history : list of dict
        One row per epoch: mean BYOL loss, mean KL (nats, whole network), beta and tau
        at the epoch's end, and per encoder layer the mean and largest sigma and SNR.
    steps : int
    seconds : float
    """

    prior: str | None
    network: ByolNetwork
    posterior: Posterior
    teacher: Teacher
    history: list[dict[str, Any]] = field(default_factory=list)
    steps: int = 0
    seconds: float = 0.0

    @property
    def variational(self) -> bool:
        return self.prior is not None


class ByovStepper:
    """One BYOV (or BYOL) update per batch, as a stepper of :func:`train_zoo.loop.fit`.

    A batch is ``(views, labels)`` with ``views`` ``(2B, C, H, W)`` (:class:`TwoViews`);
    the labels are not used. ``step`` returns the step's objective (BYOL loss plus the
    weighted KL per image) before the update.
    """

    stopped = False

    def __init__(self, network: ByolNetwork, posterior: Posterior, prior: str | None,
                 config: ByovConfig, total_steps: int, num_images: int,
                 generator: torch.Generator) -> None:
        self.network, self.prior, self.config = network, prior, config
        self.total_steps, self.kl_scale = total_steps, 1.0 / num_images
        self.generator = generator
        self.means = {k: v.clone().requires_grad_(True) for k, v in posterior.means.items()}
        self.log_variances = {k: v.clone().requires_grad_(prior is not None)
                              for k, v in posterior.log_variances.items()}
        groups = [{"params": list(self.means.values()), "lr": config.lr}]
        if prior is not None:
            groups.append({"params": list(self.log_variances.values()),
                           "lr": config.log_variance_lr})
        # No weight decay (appendix C): the KL is the regulariser.
        self.optimizer = torch.optim.Adam(groups, weight_decay=0.0)
        self.teacher = initial_teacher(posterior)
        self.step_count = 0
        self.epoch_rows: list[dict[str, float]] = []
        self._sums = {"byol": 0.0, "kl": 0.0, "batches": 0}

    def _objective(self, means: Params, log_variances: Params, noise: Params | None,
                   views: Tensor, beta: float) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        posterior = Posterior(means, log_variances)
        weights = means if noise is None else sample_parameters(posterior, noise)
        # Each view is its own batch (BatchNorm statistics per view, as BYOL).
        first, second = views.chunk(2)
        with torch.no_grad():
            targets = [_call(self.network, self.teacher.means, view, "target")
                       for view in (first, second)]
        loss = symmetric_byol_loss(_call(self.network, weights, first),
                                   _call(self.network, weights, second), *targets)
        if self.prior is None:
            return loss, (loss.detach(), torch.zeros(()))
        prior_means, prior_variances = prior_moments(self.prior, means, self.teacher)
        kl = kl_divergence(posterior, prior_means, prior_variances)
        return loss + beta * self.kl_scale * kl, (loss.detach(), kl.detach())

    def step(self, batch: tuple[Tensor, Tensor], lr: float) -> float:
        views, _ = batch
        beta = (beta_at(self.step_count, self.total_steps, self.config.beta_start,
                        self.config.beta_end) if self.prior is not None else 0.0)
        # One weight draw per batch, shared by both views.
        noise = (draw_noise(self.means, self.generator) if self.prior is not None else None)
        means = {k: v.detach() for k, v in self.means.items()}
        log_variances = {k: v.detach() for k, v in self.log_variances.items()}
        (grad_means, grad_log_variances), (objective, (loss, kl)) = grad_and_value(
            self._objective, argnums=(0, 1), has_aux=True)(means, log_variances, noise,
                                                            views, beta)
        if not torch.isfinite(objective):
            self.stopped = True
            return float(objective)
        for key, value in self.means.items():
            value.grad = grad_means[key]
        if self.prior is not None:
            for key, value in self.log_variances.items():
                value.grad = grad_log_variances[key]
        self.optimizer.step()
        self.step_count += 1
        tau = tau_at(self.step_count, self.total_steps, self.config.tau_base)
        with torch.no_grad():
            self.teacher = teacher_update(self.teacher, self.means, tau)
        self.beta, self.tau = beta, tau
        self._sums["byol"] += float(loss)
        self._sums["kl"] += float(kl)
        self._sums["batches"] += 1
        return float(objective)

    def posterior(self) -> Posterior:
        return Posterior({k: v.detach().clone() for k, v in self.means.items()},
                         {k: v.detach().clone() for k, v in self.log_variances.items()})

    def arrays(self) -> dict[str, np.ndarray]:
        return {key: value.detach().numpy() for key, value in self.means.items()}

    def on_epoch_end(self, info: Any, weights: Any) -> None:
        batches = max(self._sums["batches"], 1)
        row: dict[str, float] = {"epoch": info.epoch + 1, "step": self.step_count,
                                 "byol_loss": self._sums["byol"] / batches,
                                 "kl": self._sums["kl"] / batches if self.prior else 0.0,
                                 "beta": getattr(self, "beta", 0.0),
                                 "tau": getattr(self, "tau", self.config.tau_base)}
        if self.prior is not None:
            row.update(layer_statistics(self.posterior()))
        self.epoch_rows.append(row)
        self._sums = {"byol": 0.0, "kl": 0.0, "batches": 0}


def layer_statistics(posterior: Posterior) -> dict[str, float]:
    """Per encoder weight tensor: mean and largest sigma and SNR, keyed
    ``sigma_mean/<key>``, ``sigma_max/<key>``, ``snr_mean/<key>``, ``snr_max/<key>``."""
    stats = {}
    sigmas = sigma(posterior.log_variances)
    ratios = snr(posterior)
    for key in pruned_keys(posterior.means):
        stats[f"sigma_mean/{key}"] = float(sigmas[key].mean())
        stats[f"sigma_max/{key}"] = float(sigmas[key].max())
        stats[f"snr_mean/{key}"] = float(ratios[key].mean())
        stats[f"snr_max/{key}"] = float(ratios[key].max())
    return stats


def train_byov(images: Any, config: ByovConfig, prior: str | None, seed: int, *,
               mean: Sequence[float], std: Sequence[float], progress: Any = None
               ) -> ByovRun:
    """Train a BYOV student under ``prior`` (None: deterministic BYOL) on ``images``.

    Parameters
    ----------
    images : ArrayDataset
        The training images (uint8 ``(N, C, H, W)``; labels unused).
    config : ByovConfig
    prior : {"standard", "teacher", "teacher-variance"} or None
    seed : int
        Seeds everything: the initial means (``SeedSequence(seed)`` word 0), the batch
        order and augmentation (word 1, :func:`posteriorzoo.data.iterate_batches`) and the
        weight draws (word 2). Runs with the same seed start from the same means and see
        the same batches.
    mean, std : sequence of float
        Normalisation of the inputs (the dataset's statistics).
    progress : tqdm-like, optional
        Updated once per step.

    Returns
    -------
    ByovRun
    """
    from posteriorzoo.data import iterate_batches
    from train_zoo.loop import fit

    config.check()
    if prior is not None:
        check_choice("prior", prior, PRIORS)
    if len(images) < config.batch_size:
        raise InvalidOptionError(f"{len(images)} training images are fewer than one batch "
                                 f"of {config.batch_size}")
    started = time.perf_counter()
    init_seed, data_seed, noise_seed = (int(s) for s in
                                        np.random.SeedSequence(seed).generate_state(3))
    network = ByolNetwork(config.widths, images.images.shape[1], config.hidden,
                          config.projection)
    posterior = initial_posterior(network, init_seed)
    steps_per_epoch = len(images) // config.batch_size       # drop_last: equal batches
    total = steps_per_epoch * config.epochs
    generator = torch.Generator().manual_seed(noise_seed)
    stepper = ByovStepper(network, posterior, prior, config, total, len(images), generator)
    views = TwoViews(augmentation(mean, std, padding=config.crop_padding,
                                  noise=config.augment_noise, size=images.images.shape[-1]))

    def batches(epoch: int) -> Iterator[tuple[Tensor, Tensor]]:
        for batch in iterate_batches(images, config.batch_size, data_seed, epoch, views,
                                     drop_last=True):
            yield batch
            if progress is not None:
                progress.update(1)

    result = fit(stepper, batches, lambda epoch: config.lr, config.epochs,
                 phase="byov" if prior else "byol", callbacks=[stepper])
    return ByovRun(prior, network, stepper.posterior(), stepper.teacher, stepper.epoch_rows,
                   result.steps, time.perf_counter() - started)


# --- after training: SNR, pruning, draws ----------------------------------------------------


def snr(posterior: Posterior) -> Params:
    """Signal-to-noise ratio ``|mu| / sigma`` of every parameter (same keys, shapes)."""
    return {key: mean.abs() / torch.exp(0.5 * posterior.log_variances[key])
            for key, mean in posterior.means.items()}


def pruned_keys(params: Mapping[str, Tensor]) -> list[str]:
    """The encoder's weight tensors of Conv and Linear layers (``encoder.convs.*``):
    what is pruned; normalisation parameters are few and are kept."""
    return [key for key in params if key.startswith("encoder.convs.")
            and key.endswith(".weight")]


def keep_mask(scores: Tensor, sparsity: float) -> Tensor:
    """Keep the ``round((1 - sparsity) n)`` entries of ``scores`` with the largest score.

    Parameters
    ----------
    scores : Tensor
        Any shape, ``n`` entries; ties are broken towards the earlier entry (flattened
        order).
    sparsity : float
        Fraction of entries to remove, in [0, 1].

    Returns
    -------
    Tensor
        bool, the shape of ``scores``: True where kept; exactly ``n - round(sparsity n)``
        entries are True.
    """
    check_number("sparsity", sparsity, 0.0, maximum=1.0)
    flat = scores.detach().reshape(-1)
    removed = int(round(sparsity * flat.numel()))
    order = torch.argsort(flat, descending=True, stable=True)
    mask = torch.zeros(flat.numel(), dtype=torch.bool)
    mask[order[:flat.numel() - removed]] = True
    return mask.reshape(scores.shape)


def prune(means: Mapping[str, Tensor], scores: Mapping[str, Tensor], sparsity: float,
          keys: Sequence[str]) -> tuple[Params, dict[str, Tensor]]:
    """Zero, in each tensor of ``keys`` separately (per layer), the ``sparsity`` fraction
    of its entries with the smallest ``scores``; other entries of ``means`` are copied.

    Returns
    -------
    pruned : dict of str to Tensor
        The means with the pruned entries set to 0.
    masks : dict of str to Tensor
        The keep masks (:func:`keep_mask`) of ``keys``.
    """
    masks = {key: keep_mask(scores[key], sparsity) for key in keys}
    pruned = {key: value * masks[key] if key in masks else value.clone()
              for key, value in means.items()}
    return pruned, masks


def draw_seed(seed: int, draw: int) -> int:
    """The seed of posterior draw ``draw`` under ``seed`` (``SeedSequence([seed,
    draw])``'s first 32-bit word)."""
    return int(np.random.SeedSequence([int(seed), int(draw)]).generate_state(1)[0])


def encoder_draws(posterior: Posterior, count: int, seed: int) -> tuple[list[Params],
                                                                          list[int]]:
    """``count`` posterior samples of the encoder, as state_dicts of the registered
    encoder (:data:`ENCODER`).

    Draw ``i`` is ``mu + sigma * eps`` with ``eps`` standard normal from a generator
    seeded with :func:`draw_seed` ``(seed, i)``, drawn in the encoder's key order, so any
    draw can be made again on its own.

    Returns
    -------
    draws : list of dict of str to Tensor
        float32, keyed like ``build("small-cnn", ...).state_dict()``.
    seeds : list of int
        The seed of each draw.
    """
    check_integer("count", count, 1)
    encoder = Posterior(encoder_parameters(posterior.means),
                        encoder_parameters(posterior.log_variances))
    draws, seeds = [], []
    for index in range(count):
        seeds.append(draw_seed(seed, index))
        noise = draw_noise(encoder.means, torch.Generator().manual_seed(seeds[-1]))
        draws.append({key: value.detach().clone()
                      for key, value in sample_parameters(encoder, noise).items()})
    return draws, seeds


def encoder_features(network: ByolNetwork, encoder_params: Mapping[str, Tensor],
                     images: Tensor, batch_size: int = 1000) -> Tensor:
    """The encoder's representation ``(N, widths[-1])`` of normalised images
    ``(N, C, H, W)`` with ``encoder_params`` (registered model keys), no gradient."""
    parts = []
    with torch.no_grad():
        for start in range(0, images.shape[0], batch_size):
            parts.append(functional_call(network.encoder, dict(encoder_params),
                                         (images[start:start + batch_size],)))
    return torch.cat(parts) if parts else torch.zeros((0, network.encoder_options["widths"][-1]))
