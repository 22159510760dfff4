"""The mean cross-entropy of a batch and its gradient from the numba kernels, for any method.

Methods that need many gradients of an OptuNet-shaped network at weights of their own
choosing (Bayes by Backprop at sampled weights, SWAG's SGD continuation, SGHMC) call
:func:`fast_loss_and_grad` with a flat float32 weight vector in state_dict order
(:meth:`~train_zoo.fast.layout.NetLayout.flatten`) and a batch in the kernels' layout
(:func:`~train_zoo.fast.batches.fast_batches`). It is the gradient half of
:class:`~train_zoo.fast.engine.FastNet`'s step, without the SGD update.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

import numpy as np
import torch

from train_zoo.fast.kernels import loss_and_grad
from train_zoo.fast.layout import NetLayout
from train_zoo.methods.common import Params, flatten, unflatten
from train_zoo.methods.sghmc_steppers import LogPosteriorGradient

__all__ = ["LossGradient", "fast_log_posterior", "fast_loss_and_grad", "fast_loss_gradient"]


#: Examples per kernel call in :func:`fast_loss_and_grad` (the fastest per example here).
KERNEL_CHUNK = 128


@lru_cache(maxsize=32)
def _dims(layout: NetLayout) -> tuple[np.ndarray, int]:
    """The kernels' ``dims`` vector (read-only) and the parameter count, computed once."""
    dims = layout.dims()
    dims.flags.writeable = False
    return dims, layout.num_params


def fast_loss_and_grad(layout: NetLayout, theta: np.ndarray, x: np.ndarray, labels: np.ndarray,
                       *, grad: np.ndarray | None = None) -> tuple[float, np.ndarray]:
    """Mean cross-entropy of a batch at weights ``theta`` and its gradient.

    Parameters
    ----------
    layout : NetLayout
        The network (:func:`~train_zoo.fast.layout.describe_model`).
    theta : float32 array ``(P,)``
        Flat weights in state_dict order, ``P = layout.num_params`` (other dtypes are
        converted, which costs a copy).
    x : float32 array ``(C, H, W, B)``
        Normalised images, batch innermost, ``(C, H, W) == layout.input_shape``.
    labels : int64 array ``(B,)``
        Classes in ``0 .. layout.num_classes - 1``.
    grad : float32 array ``(P,)``, optional
        Receives the gradient (a new array when omitted).

    Returns
    -------
    loss : float
        The batch's mean cross-entropy in nats per example (float32 arithmetic).
    grad : float32 array ``(P,)``
        d loss / d theta (``grad`` itself when given).

    Raises
    ------
    ValueError
        Shapes that do not fit ``layout``.
    IndexError
        A label outside the head.
    """
    dims, size = _dims(layout)
    theta = np.ascontiguousarray(theta, dtype=np.float32)
    x = np.ascontiguousarray(x, dtype=np.float32)
    labels = np.ascontiguousarray(labels, dtype=np.int64)
    if theta.shape != (size,):
        raise ValueError(f"theta has shape {theta.shape}, expected ({size},)")
    if x.ndim != 4 or tuple(x.shape[:3]) != layout.input_shape:
        raise ValueError(f"x has shape {x.shape}, expected {(*layout.input_shape, 'B')}")
    if labels.shape != (x.shape[3],):
        raise ValueError(f"labels have shape {labels.shape}, expected ({x.shape[3]},)")
    if grad is None:
        grad = np.empty_like(theta)
    elif grad.shape != theta.shape or grad.dtype != np.float32 or not grad.flags.c_contiguous:
        raise ValueError("grad must be a C-contiguous float32 array shaped like theta")
    count = x.shape[3]
    if count <= KERNEL_CHUNK:
        logits = np.empty((layout.num_classes, count), dtype=np.float32)
        return loss_and_grad(x, labels, theta, dims, grad, logits), grad
    # A large batch in chunks: past a few hundred examples the kernels' activations leave
    # the cache (4.1 us per example at 2,048 against 2.9 at 128, idle). The batch mean is the
    # chunks' means weighted by their sizes, summed in float64.
    logits = np.empty((layout.num_classes, KERNEL_CHUNK), dtype=np.float32)
    part = np.empty_like(grad)
    total = np.zeros(size, dtype=np.float64)
    loss = 0.0
    for start in range(0, count, KERNEL_CHUNK):
        stop = min(start + KERNEL_CHUNK, count)
        chunk = np.ascontiguousarray(x[..., start:stop])
        weight = (stop - start) / count
        if stop - start != logits.shape[1]:
            logits = np.empty((layout.num_classes, stop - start), dtype=np.float32)
        loss += weight * loss_and_grad(chunk, np.ascontiguousarray(labels[start:stop]), theta,
                                       dims, part, logits)
        total += weight * part
    grad[:] = total
    return loss, grad


#: ``gradient(params, batch) -> (loss, grads)``: the batch's mean cross-entropy (nats per
#: example) at ``params`` and its gradient, keyed like ``params``.
LossGradient = Callable[[Params, tuple], tuple[float, Params]]


def fast_loss_gradient(layout: NetLayout, like: Params) -> LossGradient:
    """The mean cross-entropy's gradient on the numba kernels, for a method that steps its
    own parameters (EMP and ECMP fold their draw into ``params`` first). Batches are in the
    kernels' layout (:func:`train_zoo.fast.engine.batches_for`); the returned gradients
    are views of one buffer, valid until the next call."""
    grad = np.empty(layout.num_params, dtype=np.float32)

    def evaluate(params: Params, batch: tuple) -> tuple[float, Params]:
        x, labels = batch
        loss, _ = fast_loss_and_grad(layout, flatten(params).detach().numpy(), x, labels,
                                     grad=grad)
        return loss, unflatten(torch.from_numpy(grad), like)

    return evaluate


def fast_log_posterior(layout: NetLayout, like: Params, num_data: int,
                       prior_precision: float) -> LogPosteriorGradient:
    """SGHMC's gradient on the numba kernels: ``-(N dL/dw + prior_precision * theta)``
    with ``L`` the batch's mean cross-entropy (batches in the kernels' layout)."""
    grad = np.empty(layout.num_params, dtype=np.float32)

    def evaluate(params: Params, batch: tuple) -> tuple[float, Params]:
        theta = flatten(params)
        x, labels = batch
        loss, _ = fast_loss_and_grad(layout, theta.numpy(), x, labels, grad=grad)
        g = torch.from_numpy(grad)
        log_grad = -(num_data * g + prior_precision * theta)
        square = float(theta.double().square().sum())
        return loss + 0.5 * prior_precision * square / num_data, unflatten(log_grad, like)

    return evaluate
