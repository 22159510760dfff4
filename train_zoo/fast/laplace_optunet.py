"""GGN rows of OptuNet-shaped networks from the layers' own formulas, a chunk at a time.

:func:`train_zoo.methods.laplace_curvature.full_ggn` needs, for every example ``n``, the
``K - 1`` rows of ``M_n = V_n J_n``: the gradients of ``v^T logits`` for the ``K - 1``
cotangents ``v`` (rows of ``V_n``). For the networks the numba training path accepts
(:func:`train_zoo.fast.layout.describe_model`: ``optunet`` and ``optunet-v1`` without
dropout, float32) this module writes that backward pass out layer by layer, for a whole
chunk of ``B`` examples and all cotangents at once::

    conv1 -> ReLU -> MaxPool -> conv2 -> ReLU -> global mean -> Linear [-> ReLU -> Linear]

- head (``Linear`` layers): weight rows are ``g (x) input``, bias rows ``g``, and
  ``g <- (g @ W) * relu'`` for the layer below;
- global mean and ReLU: ``g_z2 = g / P2`` on the positions where ``z2 > 0``;
- conv2: weight rows are ``g_z2`` contracted with the patches of its input (one batched
  matrix product); the gradient reaching its input is ``g_z2 @ T^T`` with ``T`` the
  ``(C1 Hp Wp, C2 H2 W2)`` matrix of conv2 (its outputs for the unit images), one plain
  matrix product (four times faster here than ``conv_transpose2d`` on these few channels);
- max pool and ReLU: that gradient goes to the arg-max of each window only, and only
  where the window's maximum is positive;
- conv1: so its weight rows need the input patches at the ``C1 x Hp x Wp`` arg-max
  positions alone, gathered once per example and shared by the ``K - 1`` cotangents.

The generic path (``vmap`` of ``vjp``) instead runs ``K - 1`` full backward passes per
example, whose per-example convolution weight gradients and dense ``(C1, H1, W1)``
max-pool gradients (nine tenths zeros) are most of its time; on the 60,000 Fashion-MNIST
images this module makes ``full_ggn`` about twice as fast (``benchmarks/bench_methods.py``)
and agrees with the generic path to float32 rounding: the arg-max and ReLU decisions come
from the same ``F.conv2d`` / ``F.max_pool2d`` calls.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from train_zoo.fast.layout import NetLayout

__all__ = ["Tape", "factor_rows", "forward", "layout_for"]


@dataclass(frozen=True)
class Tape:
    """What the backward pass needs from :func:`forward` (``B`` examples).

    Attributes
    ----------
    patches1 : torch.Tensor
        ``(B, C1, I1, Pp)``: for each conv1 output channel and max-pool window, the conv1
        input patch (``I1 = C/g1 * k1h * k1w`` values) at the window's arg-max, zero where
        the window's maximum is not positive.
    patches2 : torch.Tensor
        ``(B, g2, I2, P2)``: the conv2 input patches of each group, ``I2 = C1/g2 * k2h *
        k2w``, ``P2 = H2 * W2`` output positions.
    active2 : torch.Tensor
        ``(B, C2, P2)`` bool, ``z2 > 0`` (conv2's ReLU).
    conv2_matrix : torch.Tensor
        ``T`` ``(C1 * Hp * Wp, C2 * P2)``: conv2 as a linear map of the flattened max-pool
        output, ``z2 = pooled @ T``.
    head : tuple of (torch.Tensor, torch.Tensor)
        For each ``Linear`` of the head, bottom up: its input ``(B, F_in)`` and its output
        before any ReLU ``(B, F_out)``.
    """

    patches1: torch.Tensor
    patches2: torch.Tensor
    active2: torch.Tensor
    conv2_matrix: torch.Tensor
    head: tuple[tuple[torch.Tensor, torch.Tensor], ...]


def layout_for(model: nn.Module, params: Mapping[str, torch.Tensor],
               buffers: Mapping[str, torch.Tensor], image_shape: tuple[int, ...]
               ) -> NetLayout | None:
    """The model's ``NetLayout`` if this module can compute its rows, else None.

    Parameters
    ----------
    model : torch.nn.Module
        The architecture.
    params, buffers : Mapping[str, torch.Tensor]
        Where it will be evaluated: float32 parameters with the layout's keys and shapes
        in state_dict order, and no buffers.
    image_shape : tuple of int
        ``(C, H, W)`` of one example.
    """
    if buffers or len(image_shape) != 3:
        return None
    # Imported here: train_zoo.fast pulls in numba, which the other methods do not need.
    from train_zoo.fast.layout import UnsupportedModelError, describe_model

    try:
        layout = describe_model(model, image_shape)
    except UnsupportedModelError:
        return None
    same = (tuple(params) == layout.keys
            and all(tuple(params[key].shape) == shape and params[key].dtype == torch.float32
                    for key, shape in zip(layout.keys, layout.shapes, strict=True)))
    return layout if same else None


def _head_names(layout: NetLayout) -> list[str]:
    """The head's ``Linear`` modules, bottom up (``fc``; or ``fc1``, ``fc2``)."""
    return [key[:-len(".weight")] for key in layout.keys
            if key.endswith(".weight") and not key.startswith("conv")]


def _patches(a: torch.Tensor, kh: int, kw: int, groups: int) -> torch.Tensor:
    """Stride-1 convolution patches ``(B, groups, C/groups * kh * kw, Ho * Wo)`` of
    ``a`` ``(B, C, H, W)``, rows in the weight's ``(channel, row, column)`` order."""
    b, c, h, w = a.shape
    ho, wo = h - kh + 1, w - kw + 1
    s = a.stride()
    view = a.as_strided((b, c, kh, kw, ho, wo), (s[0], s[1], s[2], s[3], s[2], s[3]))
    return view.reshape(b, groups, c // groups * kh * kw, ho * wo)


def forward(layout: NetLayout, params: Mapping[str, torch.Tensor], images: torch.Tensor
            ) -> tuple[torch.Tensor, Tape]:
    """The logits and the :class:`Tape` of a chunk (eval-mode forward pass).

    Parameters
    ----------
    layout : NetLayout
        From :func:`layout_for`.
    params : Mapping[str, torch.Tensor]
        The weights, keyed as ``layout.keys``.
    images : torch.Tensor
        ``(B, C, H, W)`` float32.

    Returns
    -------
    out : torch.Tensor
        Logits ``(B, K)``.
    tape : Tape
    """
    c1, cpg1, k1h, k1w, g1 = layout.conv1
    _, _, k2h, k2w, g2 = layout.conv2
    pkh, pkw, psh, psw = layout.pool
    b, _, h, w = images.shape
    with torch.no_grad():
        z1 = F.conv2d(images, params["conv1.weight"], groups=g1)
        pooled, argmax = F.max_pool2d(torch.relu(z1), (pkh, pkw), (psh, psw),
                                      return_indices=True)      # (B, C1, Hp, Wp)
        z2 = F.conv2d(pooled, params["conv2.weight"], groups=g2)
        hidden = torch.relu(z2).mean((2, 3))
        head = []
        names = _head_names(layout)
        for i, name in enumerate(names):
            pre = F.linear(hidden, params[f"{name}.weight"], params[f"{name}.bias"])
            head.append((hidden, pre))
            hidden = torch.relu(pre) if i < len(names) - 1 else pre

        # conv1's input patch at each window's arg-max: flat indices into the image,
        # (channel of the group) * H * W + (top-left of the patch) + (offset in the patch)
        width1 = w - k1w + 1
        corner = argmax.flatten(2)                                  # (B, C1, Pp)
        corner = corner // width1 * w + corner % width1
        offsets = (torch.arange(k1h).unsqueeze(1) * w + torch.arange(k1w)).reshape(-1)
        first = torch.arange(c1) // (c1 // g1) * cpg1               # group's first channel
        channels = (first.unsqueeze(1) + torch.arange(cpg1)) * (h * w)     # (C1, cpg1)
        within = (channels.unsqueeze(2) + offsets).reshape(1, c1, -1, 1)  # (1, C1, I1, 1)
        index = within + corner.unsqueeze(2)                        # (B, C1, I1, Pp)
        flat = images.reshape(b, 1, -1).expand(b, c1, -1)
        patches1 = torch.gather(flat, 2, index.reshape(b, c1, -1)).reshape(index.shape)
        patches1 = patches1 * (pooled > 0).flatten(2).unsqueeze(2)  # ReLU: max must be > 0
        # row i of T is conv2 of the i-th unit image of the max-pool output's shape
        units = torch.eye(pooled[0].numel(), dtype=pooled.dtype).reshape(-1, *pooled.shape[1:])
        matrix = F.conv2d(units, params["conv2.weight"], groups=g2).flatten(1)
    tape = Tape(patches1=patches1, patches2=_patches(pooled, k2h, k2w, g2),
                active2=z2.flatten(2) > 0, conv2_matrix=matrix, head=tuple(head))
    return hidden, tape


def factor_rows(layout: NetLayout, params: Mapping[str, torch.Tensor], tape: Tape,
                factor: torch.Tensor) -> torch.Tensor:
    """The gradients of ``factor[n, k] @ logits_n`` for every example and cotangent.

    Parameters
    ----------
    layout : NetLayout
        From :func:`layout_for`.
    params : Mapping[str, torch.Tensor]
        The weights :func:`forward` used.
    tape : Tape
        From :func:`forward`.
    factor : torch.Tensor
        Cotangents ``(B, R, K)`` in the logits' dtype (``R = K - 1`` rows of ``V_n``).

    Returns
    -------
    torch.Tensor
        ``(B, R, D)``: row ``(n, k)`` is ``factor[n, k] @ J_n``, columns in state_dict
        order (as ``flatten``).
    """
    c1, _, _, _, _ = layout.conv1
    c2, _, _, _, g2 = layout.conv2
    b, rank, _ = factor.shape
    pieces: dict[str, torch.Tensor] = {}
    grad = factor                                                   # (B, R, F_out)
    names = _head_names(layout)
    for i in reversed(range(len(names))):
        name = names[i]
        inputs, pre = tape.head[i]
        if i < len(names) - 1:
            grad = grad * (pre > 0).unsqueeze(1)                    # the ReLU above it
        pieces[f"{name}.weight"] = (grad.unsqueeze(3) * inputs[:, None, None, :]
                                    ).reshape(b, rank, -1)
        pieces[f"{name}.bias"] = grad
        grad = grad @ params[f"{name}.weight"]                      # (B, R, F_in)

    # global mean, then conv2's ReLU
    positions = tape.active2.shape[2]
    grad_z2 = (grad / positions).unsqueeze(3) * tape.active2.unsqueeze(1)   # (B, R, C2, P2)
    per_group = c2 // g2
    grouped = grad_z2.reshape(b, rank, g2, per_group, positions).transpose(1, 2)
    weight2 = grouped.reshape(b, g2, rank * per_group, positions) @ tape.patches2.transpose(2, 3)
    pieces["conv2.weight"] = weight2.reshape(b, g2, rank, -1).transpose(1, 2).reshape(b, rank, -1)

    # back through conv2 to the max-pool outputs, then to conv1's weights via the patches
    grad_pool = grad_z2.reshape(b, rank, -1) @ tape.conv2_matrix.T      # (B, R, C1 Pp)
    grad_pool = grad_pool.reshape(b, rank, c1, -1).transpose(1, 2)      # (B, C1, R, Pp)
    weight1 = grad_pool @ tape.patches1.transpose(2, 3)                 # (B, C1, R, I1)
    pieces["conv1.weight"] = weight1.transpose(1, 2).reshape(b, rank, -1)
    return torch.cat([pieces[key] for key in layout.keys], dim=2)
