"""numba kernel: an OptuNet-shaped network whose layers are scaled per example (Rank-1).

Rank-1 BNNs (:mod:`train_zoo.methods.rank1`) run every example ``b`` through
``y = r_b * (W (s_b * x)) + bias_b`` at each layer: ``s`` scales the input channels, ``r``
the output channels, and the bias is the example's component's. On OptuNet each conv
group reads one input channel, so a conv's output channel ``c`` is ``r_b[c] s_b[g(c)]``
times the unscaled convolution ``U[c]`` (``g(c)`` the group's input channel): the kernel
computes ``U`` exactly as :func:`~train_zoo.fast.kernels.loss_and_grad` does and scales
it before the ReLU. The head scales its input and output explicitly.

:func:`rank1_loss_and_grad` returns the batch's mean cross-entropy and its gradient with
respect to the shared weights ``theta`` and to every example's ``r``, ``s`` and bias;
the method turns those into gradients of its factors' locations and scales with torch.
Layout and arithmetic follow :mod:`train_zoo.fast.kernels` (batch innermost, float32
activations, float64 weight-gradient accumulation).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from posteriorzoo._numba import announce_compilation
from train_zoo.fast.kernels import (
    _conv1_band,
    _conv1_taps,
    _conv1_weight_gradient,
    _conv2_backward,
    _conv2_channel,
    _cross_entropy,
    _lane_sum,
    _relu,
    _zero,
)

announce_compilation()

__all__ = ["rank1_loss_and_grad"]

# Indices into ``dims`` (train_zoo.fast.layout.DIM_NAMES).
_CIN, _H, _W, _C1, _K1H, _K1W, _G1 = 0, 1, 2, 3, 4, 5, 6
_PKH, _PKW, _PSH, _PSW = 7, 8, 9, 10
_C2, _K2H, _K2W, _G2, _HID, _NCLS = 11, 12, 13, 14, 15, 16


@njit(cache=True, fastmath=False)
def rank1_loss_and_grad(x: np.ndarray, labels: np.ndarray, theta: np.ndarray,
                        dims: np.ndarray, r1: np.ndarray, s1: np.ndarray, r2: np.ndarray,
                        s2: np.ndarray, r3: np.ndarray, s3: np.ndarray, bias: np.ndarray,
                        grad: np.ndarray, gr1: np.ndarray, gs1: np.ndarray,
                        gr2: np.ndarray, gs2: np.ndarray, gr3: np.ndarray,
                        gs3: np.ndarray, gbias: np.ndarray, logits: np.ndarray) -> float:
    """Mean cross-entropy of a batch through per-example scaled layers, and its gradients.

    Parameters
    ----------
    x : float32 ``(C, H, W, B)``
        Normalised images, batch innermost.
    labels : int64 ``(B,)``
    theta : float32 ``(P,)``
        The shared weights in state_dict order (the head's own bias is added too; Rank-1
        passes zeros there and the components' biases in ``bias``).
    dims : int64 ``(17,)``
        ``NetLayout.dims()``: one input channel per conv group, no hidden head layer.
    r1, s1, r2, s2, r3, s3 : float32 ``(channels, B)``
        Per example: conv1's output ``(c1, B)`` and input ``(cin, B)`` scales, conv2's
        ``(c2, B)`` and ``(c1, B)``, the head's ``(classes, B)`` and ``(c2, B)``.
    bias : float32 ``(classes, B)``
        Each example's head bias.
    grad, gr1, gs1, gr2, gs2, gr3, gs3, gbias : float32
        Receive d loss / d each input (shaped like it; overwritten).
    logits : float32 ``(classes, B)``
        Receives the logits.

    Returns
    -------
    float
        The float32 mean loss (nats per example).
    """
    cin, h, w = dims[_CIN], dims[_H], dims[_W]
    c1, k1h, k1w, g1 = dims[_C1], dims[_K1H], dims[_K1W], dims[_G1]
    pkh, pkw, psh, psw = dims[_PKH], dims[_PKW], dims[_PSH], dims[_PSW]
    c2, k2h, k2w, g2 = dims[_C2], dims[_K2H], dims[_K2W], dims[_G2]
    hid, ncls = dims[_HID], dims[_NCLS]
    if hid != 0 or cin != g1 or c1 != g2:
        raise ValueError("the rank-1 kernel takes one input channel per conv group and a "
                         "single linear head")
    nb = x.shape[3]
    ph = (h - k1h + 1 - pkh) // psh + 1
    pw = (w - k1w + 1 - pkw) // psw + 1
    wu = (pw - 1) * psw + pkw
    h2, w2 = ph - k2h + 1, pw - k2w + 1
    opg1, opg2 = c1 // g1, c2 // g2
    rl1, rl2 = wu * nb, w2 * nb
    xf = x.reshape(x.size)

    g64 = np.zeros(theta.size, np.float64)
    o = 0
    n = c1 * k1h * k1w
    wc1 = theta[o:o + n].reshape((c1, 1, k1h, k1w))
    gc1 = g64[o:o + n].reshape((c1, 1, k1h, k1w))
    o += n
    n = c2 * k2h * k2w
    wc2 = theta[o:o + n].reshape((c2, 1, k2h, k2w))
    gc2 = g64[o:o + n].reshape((c2, 1, k2h, k2w))
    o += n
    wa = theta[o:o + ncls * c2].reshape((ncls, c2))
    gwa = g64[o:o + ncls * c2].reshape((ncls, c2))
    o += ncls * c2
    ba = theta[o:o + ncls]
    gba = g64[o:o + ncls]

    acc = np.empty(nb, np.float32)
    scale = np.empty(nb, np.float32)
    scratch = np.empty(nb, np.float32)
    for a in (gr1, gs1, gr2, gs2):
        a[:] = 0.0

    # ---- conv1 (unscaled U1) -> x r1 s1 -> ReLU -> max-pool; ``ubest`` keeps U1 at
    # each window's maximum for the backward pass.
    p1 = np.empty(c1 * ph * pw * nb, np.float32)
    arg = np.empty(c1 * ph * pw * nb, np.int32)
    ubest = np.empty(c1 * ph * pw * nb, np.float32)
    band = np.empty(pkh * rl1, np.float32)
    taps1 = k1h * k1w
    tap_offsets = np.empty(taps1, np.int64)
    tap_weights = np.empty(taps1, np.float32)
    row_offsets = np.empty(taps1, np.int64)
    for c in range(c1):
        first = c // opg1
        for b in range(nb):
            scale[b] = r1[c, b] * s1[first, b]
        _conv1_taps(wc1, c, h, w, nb, tap_offsets, tap_weights)
        for py in range(ph):
            _conv1_band(band, xf, first, py * psh, h, w, nb, rl1, tap_offsets, tap_weights,
                        row_offsets)
            for px in range(pw):
                o = ((c * ph + py) * pw + px) * nb
                best = p1[o:o + nb]
                where = arg[o:o + nb]
                kept = ubest[o:o + nb]
                for b in range(nb):
                    best[b] = -np.inf
                    where[b] = 0
                    kept[b] = 0.0
                for i in range(pkh):
                    for j in range(pkw):
                        # numba types k int32 here and int64 in the loops below (the ignores there).
                        k = np.int32((i * w + j) * nb)
                        col = i * rl1 + (px * psw + j) * nb
                        vals = band[col:col + nb]
                        for b in range(nb):
                            r = _relu(vals[b] * scale[b])
                            take = (r > best[b]) | (r != r)
                            best[b] = r if take else best[b]
                            where[b] = k if take else where[b]
                            kept[b] = vals[b] if take else kept[b]

    # ---- conv2 (unscaled U2) -> x r2 s2 -> ReLU -> global average pool
    a2 = np.empty(c2 * h2 * rl2, np.float32)
    feat = np.empty((c2, nb), np.float32)
    npos = np.float32(h2 * w2)
    taps2 = k2h * k2w
    tap_weights2 = np.empty(taps2, np.float32)
    row_offsets2 = np.empty(taps2, np.int64)
    for oc in range(c2):
        first = oc // opg2
        for b in range(nb):
            scale[b] = r2[oc, b] * s2[first, b]
        _conv2_channel(a2[oc * h2 * rl2:(oc + 1) * h2 * rl2], p1, wc2, oc, first, ph, pw, nb,
                       tap_weights2, row_offsets2)
        total = feat[oc]
        _zero(total)
        for q in range(h2 * w2):
            vals = a2[(oc * h2 * w2 + q) * nb:(oc * h2 * w2 + q + 1) * nb]
            for b in range(nb):
                total[b] += _relu(vals[b] * scale[b])
        for b in range(nb):
            total[b] = total[b] / npos

    # ---- head: logits = r3 * (W (s3 * feat)) + ba + bias
    fs = np.empty((c2, nb), np.float32)
    for k in range(c2):  # type: ignore[assignment]
        for b in range(nb):
            fs[k, b] = feat[k, b] * s3[k, b]
    hu = np.empty((ncls, nb), np.float32)
    for j in range(ncls):
        _zero(hu[j])
        for k in range(c2):  # type: ignore[assignment]
            row = hu[j]
            weight = wa[j, k]
            for b in range(nb):
                row[b] += weight * fs[k, b]
        for b in range(nb):
            logits[j, b] = hu[j, b] * r3[j, b] + ba[j] + bias[j, b]

    # ---- cross-entropy (mean over the batch) and d loss / d logits
    dl = np.empty((ncls, nb), np.float32)
    loss = _cross_entropy(logits, labels, dl)

    # ---- head backward
    dhu = np.empty((ncls, nb), np.float32)
    for j in range(ncls):
        gba[j] += _lane_sum(dl[j])
        for b in range(nb):
            gbias[j, b] = dl[j, b]
            gr3[j, b] = dl[j, b] * hu[j, b]
            dhu[j, b] = dl[j, b] * r3[j, b]
        for k in range(c2):  # type: ignore[assignment]
            for b in range(nb):
                acc[b] = dhu[j, b] * fs[k, b]
            gwa[j, k] += _lane_sum(acc)
    dfeat = np.empty((c2, nb), np.float32)
    for k in range(c2):  # type: ignore[assignment]
        _zero(acc)
        for j in range(ncls):
            weight = wa[j, k]
            for b in range(nb):
                acc[b] += dhu[j, b] * weight
        for b in range(nb):
            gs3[k, b] = acc[b] * feat[k, b]
            dfeat[k, b] = acc[b] * s3[k, b]

    # ---- global average pool, ReLU, the scales, conv2 backward: d loss / d U2 in da2
    da2 = np.empty(c2 * h2 * rl2, np.float32)
    for oc in range(c2):
        first = oc // opg2
        for b in range(nb):
            acc[b] = dfeat[oc, b] / npos
            scale[b] = r2[oc, b] * s2[first, b]
        for q in range(h2 * w2):
            o = (oc * h2 * w2 + q) * nb
            vals = a2[o:o + nb]
            out = da2[o:o + nb]
            for b in range(nb):
                d = acc[b] if vals[b] * scale[b] > 0 else np.float32(0.0)
                gr2[oc, b] += d * vals[b] * s2[first, b]
                gs2[first, b] += d * vals[b] * r2[oc, b]
                out[b] = d * scale[b]
    dp1 = np.zeros(c1 * ph * pw * nb, np.float32)
    _conv2_backward(da2, p1, wc2, gc2, dp1, g2, ph, pw, nb, scratch)

    # ---- max-pool, ReLU and the scales backward, conv1 weights: each window's gradient
    # goes to its recorded maximum; d loss / d U1 = d loss / d A1 * r1 s1 there.
    nwin = ph * pw
    patch_scale = np.empty(nwin * nb, np.float32)
    origin = np.empty(nwin * nb, np.int64)
    for c in range(c1):
        first = c // opg1
        for py in range(ph):
            for px in range(pw):
                q = py * pw + px
                o = (c * nwin + q) * nb
                corner = ((first * h + py * psh) * w + px * psw) * nb
                for b in range(nb):
                    d = dp1[o + b] if p1[o + b] > 0 else np.float32(0.0)
                    gr1[c, b] += d * ubest[o + b] * s1[first, b]
                    gs1[first, b] += d * ubest[o + b] * r1[c, b]
                    patch_scale[q * nb + b] = d * (r1[c, b] * s1[first, b])
                    origin[q * nb + b] = corner + arg[o + b] + b
        _conv1_weight_gradient(patch_scale, origin, xf, gc1, c, h, w, nb, nwin)

    for i in range(theta.size):
        grad[i] = np.float32(g64[i])
    return float(loss)
