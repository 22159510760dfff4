"""The fast engine's gradient for Rank-1 BNNs: the network part of the loss on the kernels.

:func:`rank1_network` gives, for an OptuNet-shaped network whose conv groups read one
input channel each and whose head is one Linear layer, a function that runs a batch in
the kernels' layout through the layers scaled per example
(:func:`~train_zoo.fast.rank1_kernels.rank1_loss_and_grad`) and returns the mean
cross-entropy with its gradients. :mod:`train_zoo.methods.rank1` draws the factors and
turns their gradients into those of its locations and scales; the engine knows nothing of
the method's posterior.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from train_zoo.fast.layout import NetLayout
from train_zoo.fast.rank1_kernels import rank1_loss_and_grad

__all__ = ["Rank1Gradients", "Rank1Network", "rank1_network"]


@dataclass
class Rank1Gradients:
    """The network part of one Rank-1 step (float32 numpy; ``n`` examples).

    Attributes
    ----------
    loss : float
        Mean cross-entropy over the ``n`` examples (nats).
    weights : ndarray ``(P,)``
        d loss / d the shared weights, in state_dict order (the head's bias entry is the
        gradient of a bias shared by every example).
    r, s : dict of str to ndarray ``(n, channels)``
        d loss / d each example's output and input scales, per layer.
    bias : ndarray ``(n, classes)``
        d loss / d each example's head bias.
    """

    loss: float
    weights: np.ndarray
    r: dict[str, np.ndarray]
    s: dict[str, np.ndarray]
    bias: np.ndarray


#: ``network(theta, r, s, bias, x, labels) -> Rank1Gradients``: ``r``, ``s`` keyed by the
#: layers (the network's conv1, conv2 and head), each ``(n, channels)``; ``bias`` ``(n,
#: classes)``; ``x`` ``(C, H, W, n)`` and ``labels`` ``(n,)`` in the kernels' layout.
Rank1Network = Callable[[np.ndarray, Mapping[str, np.ndarray], Mapping[str, np.ndarray],
                         np.ndarray, np.ndarray, np.ndarray], Rank1Gradients]


def rank1_network(layout: NetLayout, layers: Sequence[str]) -> Rank1Network | None:
    """The kernels' Rank-1 network for ``layout`` with rank-1 ``layers`` (module names),
    or None where the kernel does not apply: a hidden head layer, a conv group reading
    several channels, or rank-1 factors on only some of the layers."""
    dims = layout.dims()
    cin, c1, g1, c2, g2 = (int(dims[i]) for i in (0, 3, 6, 11, 14))
    names = tuple(key.rpartition(".")[0] for key in layout.keys if key.endswith("weight"))
    if layout.hidden or cin != g1 or c1 != g2 or tuple(layers) != names:
        return None
    conv1, conv2, head = names
    channels = {conv1: (c1, cin), conv2: (c2, c1), head: (layout.num_classes, c2)}

    def network(theta: np.ndarray, r: Mapping[str, np.ndarray], s: Mapping[str, np.ndarray],
                bias: np.ndarray, x: np.ndarray, labels: np.ndarray) -> Rank1Gradients:
        count = x.shape[3]
        inputs = []
        for name in names:
            out, into = channels[name]
            for value, width in ((r[name], out), (s[name], into)):
                if value.shape != (count, width):
                    raise ValueError(f"a rank-1 factor of {name} has shape {value.shape}, "
                                     f"expected {(count, width)}")
                inputs.append(np.ascontiguousarray(value.T, dtype=np.float32))
        bias_t = np.ascontiguousarray(bias.T, dtype=np.float32)
        grads = [np.empty_like(value) for value in inputs]
        grad_bias = np.empty_like(bias_t)
        grad = np.empty(layout.num_params, dtype=np.float32)
        logits = np.empty((layout.num_classes, count), dtype=np.float32)
        # inputs and grads are six arrays each (r, s of the three layers): mypy cannot
        # count a list's items against the kernel's parameters.
        loss = rank1_loss_and_grad(  # type: ignore[call-arg]
            np.ascontiguousarray(x, dtype=np.float32),
            np.ascontiguousarray(labels, dtype=np.int64),
            np.ascontiguousarray(theta, dtype=np.float32), dims, *inputs, bias_t, grad,
            *grads, grad_bias, logits)
        return Rank1Gradients(loss, grad,
                              {name: grads[2 * i].T for i, name in enumerate(names)},
                              {name: grads[2 * i + 1].T for i, name in enumerate(names)},
                              grad_bias.T)

    return network
