"""numba kernels: OptuNet-shaped forward pass, cross-entropy, backward pass and SGD.

Layout. The batch is the *innermost* axis everywhere: images are ``x[C, H, W, B]``
(float32, C-contiguous) and every activation is ``[channel, row, col, B]``, so each
inner loop runs over the batch and compiles to SIMD code even though the layers
themselves are tiny (a 4x4 kernel, 8x8 maps, 10 channels). Weights come as one flat
float32 vector ``theta`` in state_dict order (see :class:`~train_zoo.fast.layout.NetLayout`)
and the layer sizes as the int64 vector ``dims`` (:data:`~train_zoo.fast.layout.DIM_NAMES`).

Arithmetic follows torch's float32 forward/backward:

* activations and activation gradients are float32, each output accumulated over its
  taps in a fixed order (the same order at every position, so equal inputs give
  bit-equal outputs and max-pool ties are real ties, as in torch);
* ReLU propagates NaN and its gradient passes where the output is > 0;
* max-pool routes the gradient to the first maximal element in window scan order
  (row-major), a NaN taking the place as in PyTorch's CPU kernel;
* cross-entropy is the mean over the batch of a max-shifted log-softmax;
* parameter gradients (sums over the batch and positions) are accumulated in float32
  over short runs (one example's positions, or one pool window's examples) and those
  partial sums in float64, then rounded to float32 once. torch reduces these sums with
  blocked float32 GEMMs; a plain sequential float32 sum over 64 x 16 terms can drift from
  it by more than the 1e-5 tolerance the tests use, this stays well inside it;
* conv1's weight gradient uses only each pool window's recorded maximum (one input
  patch per example and window) instead of a dense correlation over all positions;
* the SGD update replays ``torch.optim.SGD``'s single-tensor path op by op, including
  its fused multiply-adds (``Tensor.add(other, alpha=...)`` is one ``fma`` on CPU), so
  the same gradient gives bit-identical weights.

Everything is single-threaded on purpose: the trainer runs one process per core.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from posteriorzoo._numba import announce_compilation

announce_compilation()

__all__ = ["evaluate_batch", "fma32", "loss_and_grad", "prepare_batch", "prepare_rows",
           "sgd_update", "train_step"]

# Indices into ``dims`` (train_zoo.fast.layout.DIM_NAMES).
_CIN, _H, _W, _C1, _K1H, _K1W, _G1 = 0, 1, 2, 3, 4, 5, 6
_PKH, _PKW, _PSH, _PSW = 7, 8, 9, 10
_C2, _K2H, _K2W, _G2, _HID, _NCLS = 11, 12, 13, 14, 15, 16
#: :func:`prepare_batch` goes through a tile of _PREPARE_BLOCK examples from batches of
#: _TILED_FROM on (below, one example at a time is faster: 0.036 against 0.077 ms at 64).
_PREPARE_BLOCK, _TILED_FROM = 16, 512


@intrinsic
def fma32(typingctx, a, b, c):
    """``a * b + c`` in float32 with a single rounding (LLVM's ``llvm.fma.f32``)."""
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        f32 = ir.FloatType()
        fn = builder.module.declare_intrinsic("llvm.fma", [f32], ir.FunctionType(f32, [f32] * 3))
        return builder.call(fn, args)

    return sig, codegen


@njit(cache=True, fastmath=False)
def _relu(v: np.float32) -> np.float32:
    """torch.relu on one float32: 0 for v <= 0, NaN stays NaN."""
    return np.float32(0.0) if v <= 0 else v


@njit(cache=True, fastmath=False)
def _lane_sum(lanes: np.ndarray) -> float:
    """Sum of a float32 vector ``(n,)`` in float64 (eight interleaved partial sums)."""
    n = lanes.size
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = 0.0
    i = 0
    while i + 8 <= n:
        s0 += np.float64(lanes[i])
        s1 += np.float64(lanes[i + 1])
        s2 += np.float64(lanes[i + 2])
        s3 += np.float64(lanes[i + 3])
        s4 += np.float64(lanes[i + 4])
        s5 += np.float64(lanes[i + 5])
        s6 += np.float64(lanes[i + 6])
        s7 += np.float64(lanes[i + 7])
        i += 8
    while i < n:
        s0 += np.float64(lanes[i])
        i += 1
    return ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))


@njit(cache=True, fastmath=False)
def _fold_sum(lanes: np.ndarray, nb: int, scratch: np.ndarray) -> float:
    """Sum of ``lanes`` ``(m * nb,)``: folded to ``nb`` batch lanes in float32 (each lane
    sums one example's positions), then :func:`_lane_sum` over the batch."""
    for b in range(nb):
        scratch[b] = lanes[b]
    for q in range(1, lanes.size // nb):
        seg = lanes[q * nb:(q + 1) * nb]
        for b in range(nb):
            scratch[b] += seg[b]
    return _lane_sum(scratch[:nb])


@njit(cache=True, fastmath=False)
def _axpy(acc: np.ndarray, x: np.ndarray, w: np.float32) -> None:
    """``acc += w * x`` elementwise (float32 vectors of one length; no fused multiply-add)."""
    for t in range(acc.size):
        acc[t] += w * x[t]


@njit(cache=True, fastmath=False)
def _zero(a: np.ndarray) -> None:
    for t in range(a.size):
        a[t] = 0.0


@njit(cache=True, fastmath=False)
def _taps(acc: np.ndarray, src: np.ndarray, offsets: np.ndarray, weights: np.ndarray) -> None:
    """``acc[t] += weights[k] * src[offsets[k] + t]`` for k = 0, 1, ... in that order.

    ``acc`` float32 ``(n,)``; ``src`` float32 1-D; ``offsets`` int64 ``(K,)``; ``weights``
    float32 ``(K,)``. Four taps per pass over ``acc`` (fewer loads and stores), with the
    same rounding as one tap at a time.
    """
    n = acc.size
    count = offsets.size
    k = 0
    while k + 4 <= count:
        x0 = src[offsets[k]:offsets[k] + n]
        x1 = src[offsets[k + 1]:offsets[k + 1] + n]
        x2 = src[offsets[k + 2]:offsets[k + 2] + n]
        x3 = src[offsets[k + 3]:offsets[k + 3] + n]
        w0, w1, w2, w3 = weights[k], weights[k + 1], weights[k + 2], weights[k + 3]
        for t in range(n):
            a = acc[t]
            a += w0 * x0[t]
            a += w1 * x1[t]
            a += w2 * x2[t]
            a += w3 * x3[t]
            acc[t] = a
        k += 4
    while k < count:
        _axpy(acc, src[offsets[k]:offsets[k] + n], weights[k])
        k += 1


@njit(cache=True, fastmath=False)
def _patch_sums(scale: np.ndarray, origin: np.ndarray, x: np.ndarray, offset: int, nb: int,
                nwin: int, out: np.ndarray) -> None:
    """``out[j] += sum_t scale[t] * x[origin[t] + offset + j * nb]`` for ``j < out.size``
    (at most 4): one column run of every example's patch. ``scale``, ``origin``:
    ``(nwin * nb,)``; ``x``: the flat batch; ``out``: float64. Partial sums over one
    window's ``nb`` examples are float32 (in registers), then added in float64."""
    if out.size == 4:
        for q in range(nwin):
            a0 = a1 = a2 = a3 = np.float32(0.0)
            for t in range(q * nb, (q + 1) * nb):
                g = scale[t]
                patch = x[origin[t] + offset:]
                a0 += g * patch[0]
                a1 += g * patch[nb]
                a2 += g * patch[2 * nb]
                a3 += g * patch[3 * nb]
            out[0] += a0
            out[1] += a1
            out[2] += a2
            out[3] += a3
    else:
        for j in range(out.size):
            for q in range(nwin):
                a0 = np.float32(0.0)
                for t in range(q * nb, (q + 1) * nb):
                    a0 += scale[t] * x[origin[t] + offset + j * nb]
                out[j] += a0


@njit(cache=True, fastmath=False)
def _patch_sums_4x4(scale: np.ndarray, origin: np.ndarray, x: np.ndarray, offset: int,
                    row: int, nb: int, nwin: int, out: np.ndarray) -> None:
    """:func:`_patch_sums` for a whole 4 x 4 kernel at once: ``out[ki, kj] += sum_t
    scale[t] * x[origin[t] + offset + ki * row + kj * nb]``, ``out`` float64 ``(4, 4)``.

    The same sums in the same order (per window, a float32 run over its examples, then
    added in float64), so the same bits; but sixteen independent running sums instead of
    four, so the loop is no longer bound by the latency of one float32 addition (the
    conv1 weight gradient took 40% of a training step, now a quarter).
    """
    for q in range(nwin):
        a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = np.float32(0.0)
        a20 = a21 = a22 = a23 = a30 = a31 = a32 = a33 = np.float32(0.0)
        for t in range(q * nb, (q + 1) * nb):
            g = scale[t]
            p = x[origin[t] + offset:]
            a00 += g * p[0]
            a01 += g * p[nb]
            a02 += g * p[2 * nb]
            a03 += g * p[3 * nb]
            p = p[row:]
            a10 += g * p[0]
            a11 += g * p[nb]
            a12 += g * p[2 * nb]
            a13 += g * p[3 * nb]
            p = p[row:]
            a20 += g * p[0]
            a21 += g * p[nb]
            a22 += g * p[2 * nb]
            a23 += g * p[3 * nb]
            p = p[row:]
            a30 += g * p[0]
            a31 += g * p[nb]
            a32 += g * p[2 * nb]
            a33 += g * p[3 * nb]
        out[0, 0] += a00
        out[0, 1] += a01
        out[0, 2] += a02
        out[0, 3] += a03
        out[1, 0] += a10
        out[1, 1] += a11
        out[1, 2] += a12
        out[1, 3] += a13
        out[2, 0] += a20
        out[2, 1] += a21
        out[2, 2] += a22
        out[2, 3] += a23
        out[3, 0] += a30
        out[3, 1] += a31
        out[3, 2] += a32
        out[3, 3] += a33


@njit(cache=True, fastmath=False)
def _conv1_pool(xf: np.ndarray, wc1: np.ndarray, dims: np.ndarray, nb: int, p1: np.ndarray,
                arg: np.ndarray) -> None:
    """conv1 -> ReLU -> max-pool of the batch into ``p1`` ``(C1 * PH * PW * B,)``, and in
    ``arg`` each window's first maximum as its offset in x from the window's corner.

    Each conv1 output is summed over its taps in (in-channel, row, col) order from 0; the
    pool scans its window row-major, keeps the first maximum and lets a NaN through, as
    torch does. One band of pool-kernel rows of conv1 outputs at a time.
    """
    cin, h, w = dims[_CIN], dims[_H], dims[_W]
    c1, k1h, k1w, g1 = dims[_C1], dims[_K1H], dims[_K1W], dims[_G1]
    pkh, pkw, psh, psw = dims[_PKH], dims[_PKW], dims[_PSH], dims[_PSW]
    ph = (h - k1h + 1 - pkh) // psh + 1
    pw = (w - k1w + 1 - pkw) // psw + 1
    cpg1, opg1 = cin // g1, c1 // g1
    wu = (pw - 1) * psw + pkw  # conv1 output columns the pool reads
    rl1 = wu * nb
    band = np.empty(pkh * rl1, np.float32)
    taps1 = cpg1 * k1h * k1w
    tap_offsets = np.empty(taps1, np.int64)  # of each tap in x, relative to its row
    tap_weights = np.empty(taps1, np.float32)
    row_offsets = np.empty(taps1, np.int64)
    for c in range(c1):
        first = (c // opg1) * cpg1
        _conv1_taps(wc1, c, h, w, nb, tap_offsets, tap_weights)
        for py in range(ph):
            _conv1_band(band, xf, first, py * psh, h, w, nb, rl1, tap_offsets, tap_weights,
                        row_offsets)
            for px in range(pw):
                o = ((c * ph + py) * pw + px) * nb
                best = p1[o:o + nb]
                where = arg[o:o + nb]
                for b in range(nb):
                    best[b] = -np.inf
                    where[b] = 0
                for i in range(pkh):
                    for j in range(pkw):
                        k = np.int32((i * w + j) * nb)  # the position's offset in x
                        col = i * rl1 + (px * psw + j) * nb
                        vals = band[col:col + nb]
                        for b in range(nb):
                            r = _relu(vals[b])
                            take = (r > best[b]) | (r != r)
                            best[b] = r if take else best[b]
                            where[b] = k if take else where[b]


@njit(cache=True, fastmath=False)
def _conv1_taps(wc1: np.ndarray, c: int, h: int, w: int, nb: int, tap_offsets: np.ndarray,
                tap_weights: np.ndarray) -> None:
    """Output channel ``c``'s taps of conv1 in (in-channel, row, col) order: each tap's
    offset in x relative to its row, and its weight."""
    tap = 0
    for ci in range(wc1.shape[1]):
        for ki in range(wc1.shape[2]):
            for kj in range(wc1.shape[3]):
                tap_offsets[tap] = ((ci * h + ki) * w + kj) * nb
                tap_weights[tap] = wc1[c, ci, ki, kj]
                tap += 1


@njit(cache=True, fastmath=False)
def _conv1_band(band: np.ndarray, xf: np.ndarray, first: int, top: int, h: int, w: int,
                nb: int, rl1: int, tap_offsets: np.ndarray, tap_weights: np.ndarray,
                row_offsets: np.ndarray) -> None:
    """The conv1 outputs of the band's rows ``top, top + 1, ...`` for one output channel
    (its group's first input channel ``first``), each summed over its taps in order."""
    for i in range(band.size // rl1):
        row = band[i * rl1:(i + 1) * rl1]
        _zero(row)
        base = ((first * h + top + i) * w) * nb
        for tap in range(tap_offsets.size):
            row_offsets[tap] = base + tap_offsets[tap]
        _taps(row, xf, row_offsets, tap_weights)


@njit(cache=True, fastmath=False)
def _conv2_channel(out: np.ndarray, p1: np.ndarray, wc2: np.ndarray, oc: int, first: int,
                   ph: int, pw: int, nb: int, tap_weights: np.ndarray,
                   row_offsets: np.ndarray) -> None:
    """Output channel ``oc`` of conv2 over the pooled maps ``p1`` (its group's first input
    channel ``first``) into ``out`` ``(h2 * w2 * nb,)``, each output summed over its taps
    in (in-channel, row, col) order."""
    cpg2, k2h, k2w = wc2.shape[1], wc2.shape[2], wc2.shape[3]
    h2, w2 = ph - k2h + 1, pw - k2w + 1
    rl2 = w2 * nb
    tap = 0
    for ci in range(cpg2):
        for ki in range(k2h):
            for kj in range(k2w):
                tap_weights[tap] = wc2[oc, ci, ki, kj]
                tap += 1
    for y in range(h2):
        row = out[y * rl2:(y + 1) * rl2]
        _zero(row)
        tap = 0
        for ci in range(cpg2):
            for ki in range(k2h):
                for kj in range(k2w):
                    row_offsets[tap] = (((first + ci) * ph + y + ki) * pw + kj) * nb
                    tap += 1
        _taps(row, p1, row_offsets, tap_weights)


@njit(cache=True, fastmath=False)
def _conv2_backward(da2: np.ndarray, p1: np.ndarray, wc2: np.ndarray, gc2: np.ndarray,
                    dp1: np.ndarray, groups: int, ph: int, pw: int, nb: int,
                    scratch: np.ndarray) -> None:
    """conv2's backward pass from ``da2`` (d loss / d its outputs): its weight gradient
    added to ``gc2`` (float64) and its input gradient to ``dp1``."""
    c2, cpg2, k2h, k2w = wc2.shape
    opg2 = c2 // groups
    h2, w2 = ph - k2h + 1, pw - k2w + 1
    rl2 = w2 * nb
    lanes2 = np.empty(rl2, np.float32)
    for oc in range(c2):
        first = (oc // opg2) * cpg2
        for ci in range(cpg2):
            for ki in range(k2h):
                for kj in range(k2w):
                    wv = wc2[oc, ci, ki, kj]
                    _zero(lanes2)
                    for y in range(h2):
                        d = da2[(oc * h2 + y) * rl2:(oc * h2 + y + 1) * rl2]
                        off = (((first + ci) * ph + y + ki) * pw + kj) * nb
                        pv = p1[off:off + rl2]
                        dv = dp1[off:off + rl2]
                        for t in range(rl2):
                            lanes2[t] += d[t] * pv[t]
                            dv[t] += d[t] * wv
                    gc2[oc, ci, ki, kj] += _fold_sum(lanes2, nb, scratch)


@njit(cache=True, fastmath=False)
def _conv1_weight_gradient(scale: np.ndarray, origin: np.ndarray, xf: np.ndarray,
                           gc1: np.ndarray, c: int, h: int, w: int, nb: int,
                           nwin: int) -> None:
    """Output channel ``c``'s conv1 weight gradient (added to ``gc1``, float64): each pool
    window's recorded input patch (``origin``) scaled by the window's gradient
    (``scale``), summed by :func:`_patch_sums` four columns at a time."""
    k1w = gc1.shape[3]
    if gc1.shape[2] == 4 and k1w == 4:
        for ci in range(gc1.shape[1]):
            _patch_sums_4x4(scale, origin, xf, (ci * h * w) * nb, w * nb, nb, nwin, gc1[c, ci])
        return
    for ci in range(gc1.shape[1]):
        for ki in range(gc1.shape[2]):
            for kj in range(0, k1w, 4):
                _patch_sums(scale, origin, xf, ((ci * h + ki) * w + kj) * nb, nb, nwin,
                            gc1[c, ci, ki, kj:min(kj + 4, k1w)])


@njit(cache=True, fastmath=False)
def _cross_entropy(logits: np.ndarray, labels: np.ndarray, dl: np.ndarray) -> np.float32:
    """The batch's mean cross-entropy (float32, a max-shifted log-softmax per example) from
    ``logits`` ``(classes, B)``; ``dl`` receives d loss / d logits (softmax / B, minus 1 / B
    at the label)."""
    ncls, nb = logits.shape
    inv = np.float32(1.0) / np.float32(nb)
    loss64 = 0.0
    for b in range(nb):
        m = logits[0, b]
        for j in range(1, ncls):
            if logits[j, b] > m:
                m = logits[j, b]
        s = np.float32(0.0)
        for j in range(ncls):
            e = np.exp(logits[j, b] - m)
            dl[j, b] = e
            s += e
        lse = np.log(s)
        t = labels[b]
        if t < 0 or t >= ncls:
            raise IndexError("a label is outside 0 .. num_classes - 1")
        loss64 -= np.float64(logits[t, b] - m - lse)
        for j in range(ncls):
            dl[j, b] = dl[j, b] / s * inv  # softmax / B
        dl[t, b] -= inv
    return np.float32(loss64 / nb)


@njit(cache=True, fastmath=False)
def loss_and_grad(x: np.ndarray, labels: np.ndarray, theta: np.ndarray, dims: np.ndarray,
                  grad: np.ndarray, logits: np.ndarray) -> float:
    """Mean cross-entropy of a batch and its gradient with respect to ``theta``.

    Parameters
    ----------
    x : float32 array ``(C, H, W, B)``, C-contiguous
        Normalised images, batch innermost.
    labels : int64 array ``(B,)``
        In ``0 .. num_classes - 1`` (else IndexError).
    theta : float32 array ``(P,)``
        Flat weights in state_dict order.
    dims : int64 array ``(17,)``
        Layer sizes (``NetLayout.dims()``).
    grad : float32 array ``(P,)``
        Receives d loss / d theta (overwritten).
    logits : float32 array ``(num_classes, B)``
        Receives the logits (overwritten).

    Returns
    -------
    float
        The float32 loss (mean over the batch, nats), as a Python float.
    """
    cin, h, w = dims[_CIN], dims[_H], dims[_W]
    c1, k1h, k1w, g1 = dims[_C1], dims[_K1H], dims[_K1W], dims[_G1]
    pkh, pkw, psh, psw = dims[_PKH], dims[_PKW], dims[_PSH], dims[_PSW]
    c2, k2h, k2w, g2 = dims[_C2], dims[_K2H], dims[_K2W], dims[_G2]
    hid, ncls = dims[_HID], dims[_NCLS]
    nb = x.shape[3]
    ph = (h - k1h + 1 - pkh) // psh + 1
    pw = (w - k1w + 1 - pkw) // psw + 1
    h2, w2 = ph - k2h + 1, pw - k2w + 1
    cpg1, opg1 = cin // g1, c1 // g1
    cpg2, opg2 = c1 // g2, c2 // g2
    na = hid if hid > 0 else ncls
    rl2 = w2 * nb  # the length of one (column, batch) row of conv2
    xf = x.reshape(x.size)

    # Views of the weights and of the float64 gradient accumulators.
    g64 = np.zeros(theta.size, np.float64)
    o = 0
    n = c1 * cpg1 * k1h * k1w
    wc1 = theta[o:o + n].reshape((c1, cpg1, k1h, k1w))
    gc1 = g64[o:o + n].reshape((c1, cpg1, k1h, k1w))
    o += n
    n = c2 * cpg2 * k2h * k2w
    wc2 = theta[o:o + n].reshape((c2, cpg2, k2h, k2w))
    gc2 = g64[o:o + n].reshape((c2, cpg2, k2h, k2w))
    o += n
    wa = theta[o:o + na * c2].reshape((na, c2))
    gwa = g64[o:o + na * c2].reshape((na, c2))
    o += na * c2
    ba = theta[o:o + na]
    gba = g64[o:o + na]
    o += na
    if hid > 0:
        wb = theta[o:o + ncls * hid].reshape((ncls, hid))
        gwb = g64[o:o + ncls * hid].reshape((ncls, hid))
        o += ncls * hid
        bb = theta[o:o + ncls]
        gbb = g64[o:o + ncls]
    else:
        wb, gwb, bb, gbb = wa, gwa, ba, gba  # unused

    acc = np.empty(nb, np.float32)
    scratch = np.empty(nb, np.float32)

    # ---- conv1 -> ReLU -> max-pool. One band of pool-kernel rows of conv1 outputs at a
    # time (each output summed over its taps in (in-channel, row, col) order), then the
    # pool keeps the value of the first maximum in row-major window order and, in
    # ``arg``, its offset in x relative to the window's corner (for the backward pass).
    p1 = np.empty(c1 * ph * pw * nb, np.float32)
    arg = np.empty(c1 * ph * pw * nb, np.int32)
    _conv1_pool(xf, wc1, dims, nb, p1, arg)

    # ---- conv2 -> ReLU -> global average pool
    a2 = np.empty(c2 * h2 * rl2, np.float32)
    feat = np.empty((c2, nb), np.float32)
    npos = np.float32(h2 * w2)
    taps2 = cpg2 * k2h * k2w
    tap_weights2 = np.empty(taps2, np.float32)
    row_offsets2 = np.empty(taps2, np.int64)
    for oc in range(c2):
        first = (oc // opg2) * cpg2
        _conv2_channel(a2[oc * h2 * rl2:(oc + 1) * h2 * rl2], p1, wc2, oc, first, ph, pw, nb,
                       tap_weights2, row_offsets2)
        total = feat[oc]
        _zero(total)
        for q in range(h2 * w2):
            vals = a2[(oc * h2 * w2 + q) * nb:(oc * h2 * w2 + q + 1) * nb]
            for b in range(nb):
                total[b] += _relu(vals[b])
        for b in range(nb):
            total[b] = total[b] / npos

    # ---- head
    ha = np.empty((na, nb), np.float32)
    for j in range(na):
        _zero(ha[j])
        for k in range(c2):
            _axpy(ha[j], feat[k], wa[j, k])
        for b in range(nb):
            ha[j, b] += ba[j]
    hr = np.empty((hid, nb), np.float32)
    if hid > 0:
        for j in range(hid):
            for b in range(nb):
                hr[j, b] = _relu(ha[j, b])
        for j in range(ncls):
            _zero(logits[j])
            for k in range(hid):
                _axpy(logits[j], hr[k], wb[j, k])
            for b in range(nb):
                logits[j, b] += bb[j]
    else:
        for j in range(ncls):
            for b in range(nb):
                logits[j, b] = ha[j, b]

    # ---- cross-entropy (mean over the batch) and d loss / d logits
    dl = np.empty((ncls, nb), np.float32)
    loss = _cross_entropy(logits, labels, dl)

    # ---- head backward
    dfeat = np.empty((c2, nb), np.float32)
    if hid > 0:
        dh = np.empty((hid, nb), np.float32)
        for k in range(hid):
            _zero(acc)
            for j in range(ncls):
                _axpy(acc, dl[j], wb[j, k])
            for b in range(nb):
                dh[k, b] = acc[b] if hr[k, b] > 0 else np.float32(0.0)
        for j in range(ncls):
            gbb[j] += _lane_sum(dl[j])
            for k in range(hid):
                for b in range(nb):
                    acc[b] = dl[j, b] * hr[k, b]
                gwb[j, k] += _lane_sum(acc)
        dout = dh
    else:
        dout = dl
    for j in range(na):
        gba[j] += _lane_sum(dout[j])
        for k in range(c2):
            for b in range(nb):
                acc[b] = dout[j, b] * feat[k, b]
            gwa[j, k] += _lane_sum(acc)
    for k in range(c2):
        _zero(dfeat[k])
        for j in range(na):
            _axpy(dfeat[k], dout[j], wa[j, k])

    # ---- global average pool, ReLU and conv2 backward
    da2 = np.empty(c2 * h2 * rl2, np.float32)
    for oc in range(c2):
        for b in range(nb):
            acc[b] = dfeat[oc, b] / npos
        for q in range(h2 * w2):
            o = (oc * h2 * w2 + q) * nb
            vals = a2[o:o + nb]
            out = da2[o:o + nb]
            for b in range(nb):
                out[b] = acc[b] if vals[b] > 0 else np.float32(0.0)
    dp1 = np.zeros(c1 * ph * pw * nb, np.float32)
    _conv2_backward(da2, p1, wc2, gc2, dp1, g2, ph, pw, nb, scratch)

    # ---- max-pool backward, ReLU and conv1 weights. A window's gradient goes to its
    # recorded maximum only, so each example adds one input patch per window, scaled by
    # the gradient (0 where the pooled value, the ReLU output there, is not > 0).
    nwin = ph * pw
    scale = np.empty(nwin * nb, np.float32)
    origin = np.empty(nwin * nb, np.int64)
    for c in range(c1):
        first = (c // opg1) * cpg1
        for py in range(ph):
            for px in range(pw):
                q = py * pw + px
                o = (c * nwin + q) * nb
                corner = ((first * h + py * psh) * w + px * psw) * nb
                for b in range(nb):
                    scale[q * nb + b] = dp1[o + b] if p1[o + b] > 0 else np.float32(0.0)
                    origin[q * nb + b] = corner + arg[o + b] + b
        _conv1_weight_gradient(scale, origin, xf, gc1, c, h, w, nb, nwin)

    for i in range(theta.size):
        grad[i] = np.float32(g64[i])
    return float(loss)


@njit(cache=True, fastmath=False)
def evaluate_batch(x: np.ndarray, labels: np.ndarray, theta: np.ndarray, dims: np.ndarray,
                   logits: np.ndarray) -> tuple[float, int]:
    """The summed cross-entropy and the number of correct top-1 predictions of a batch:
    the forward pass of :func:`loss_and_grad` alone (no max-pool positions recorded, no
    gradient), for evaluating a trained network.

    Shapes as in :func:`loss_and_grad`; ``logits`` ``(num_classes, B)`` receives the
    logits. Returns ``(sum over the batch of -log softmax[label] in float64, correct)``;
    a prediction is the first largest logit, as ``torch.argmax``.
    """
    cin, h, w = dims[_CIN], dims[_H], dims[_W]
    c1, k1h, k1w, g1 = dims[_C1], dims[_K1H], dims[_K1W], dims[_G1]
    pkh, pkw, psh, psw = dims[_PKH], dims[_PKW], dims[_PSH], dims[_PSW]
    c2, k2h, k2w, g2 = dims[_C2], dims[_K2H], dims[_K2W], dims[_G2]
    hid, ncls = dims[_HID], dims[_NCLS]
    nb = x.shape[3]
    ph = (h - k1h + 1 - pkh) // psh + 1
    pw = (w - k1w + 1 - pkw) // psw + 1
    h2, w2 = ph - k2h + 1, pw - k2w + 1
    cpg1 = cin // g1
    cpg2, opg2 = c1 // g2, c2 // g2
    na = hid if hid > 0 else ncls
    rl2 = w2 * nb
    xf = x.reshape(x.size)
    o = 0
    n = c1 * cpg1 * k1h * k1w
    wc1 = theta[o:o + n].reshape((c1, cpg1, k1h, k1w))
    o += n
    n = c2 * cpg2 * k2h * k2w
    wc2 = theta[o:o + n].reshape((c2, cpg2, k2h, k2w))
    o += n
    wa = theta[o:o + na * c2].reshape((na, c2))
    o += na * c2
    ba = theta[o:o + na]
    o += na
    wb, bb = wa, ba  # unused without a hidden layer
    if hid > 0:
        wb = theta[o:o + ncls * hid].reshape((ncls, hid))
        o += ncls * hid
        bb = theta[o:o + ncls]

    # conv1 -> ReLU -> max-pool (as in training; the pool's positions are not used)
    p1 = np.empty(c1 * ph * pw * nb, np.float32)
    _conv1_pool(xf, wc1, dims, nb, p1, np.empty(c1 * ph * pw * nb, np.int32))

    # conv2 -> ReLU -> global average pool
    a2 = np.empty(h2 * rl2, np.float32)
    feat = np.empty((c2, nb), np.float32)
    npos = np.float32(h2 * w2)
    taps2 = cpg2 * k2h * k2w
    tap_weights2 = np.empty(taps2, np.float32)
    row_offsets2 = np.empty(taps2, np.int64)
    for oc in range(c2):
        first = (oc // opg2) * cpg2
        _conv2_channel(a2, p1, wc2, oc, first, ph, pw, nb, tap_weights2, row_offsets2)
        total = feat[oc]
        _zero(total)
        for q in range(h2 * w2):
            vals = a2[q * nb:(q + 1) * nb]
            for b in range(nb):
                total[b] += _relu(vals[b])
        for b in range(nb):
            total[b] = total[b] / npos

    # head
    ha = np.empty((na, nb), np.float32)
    for j in range(na):
        _zero(ha[j])
        for k in range(c2):
            _axpy(ha[j], feat[k], wa[j, k])
        for b in range(nb):
            ha[j, b] += ba[j]
    if hid > 0:
        for j in range(hid):
            for b in range(nb):
                ha[j, b] = _relu(ha[j, b])
        for j in range(ncls):
            _zero(logits[j])
            for k in range(hid):
                _axpy(logits[j], ha[k], wb[j, k])
            for b in range(nb):
                logits[j, b] += bb[j]
    else:
        for j in range(ncls):
            for b in range(nb):
                logits[j, b] = ha[j, b]

    # cross-entropy and top-1
    loss = 0.0
    correct = 0
    for b in range(nb):
        m = logits[0, b]
        top = 0
        for j in range(1, ncls):
            if logits[j, b] > m:
                m = logits[j, b]
                top = j
        s = np.float32(0.0)
        for j in range(ncls):
            s += np.exp(logits[j, b] - m)
        t = labels[b]
        if t < 0 or t >= ncls:
            raise IndexError("a label is outside 0 .. num_classes - 1")
        loss -= np.float64(logits[t, b] - m - np.log(s))
        correct += top == t
    return loss, correct


@njit(cache=True, fastmath=False)
def sgd_update(theta: np.ndarray, grad: np.ndarray, buf: np.ndarray, lr: float,
               weight_decay: float, momentum: float, nesterov: bool, has_buf: bool) -> None:
    """One ``torch.optim.SGD`` step (dampening 0, not maximising), in place.

    Replays ``_single_tensor_sgd`` op for op: ``g = fma(p, wd, g)``; momentum buffer
    ``b = g`` on the first step, else ``b = fma(g, 1, b * m)``; ``g = fma(b, m, g)``
    (Nesterov) or ``g = b``; ``p = fma(g, -lr, p)``. Scalars are rounded to float32 as
    torch does. ``theta``, ``grad``, ``buf``: float32 ``(P,)``; ``grad`` is left as the
    raw gradient, ``buf`` is the momentum buffer (ignored when ``momentum == 0``).
    """
    alpha = np.float32(-lr)
    wd = np.float32(weight_decay)
    mom = np.float32(momentum)
    one = np.float32(1.0)
    # fma32 is a numba @intrinsic: called without the typingctx its stub still lists.
    for i in range(theta.size):
        g = grad[i]
        if weight_decay != 0:
            g = fma32(theta[i], wd, g)  # type: ignore[call-arg]
        if momentum != 0:
            b = fma32(g, one, buf[i] * mom) if has_buf else g  # type: ignore[call-arg]
            buf[i] = b
            g = fma32(b, mom, g) if nesterov else b  # type: ignore[call-arg]
        theta[i] = fma32(g, alpha, theta[i])  # type: ignore[call-arg]


@njit(cache=True, fastmath=False)
def train_step(x: np.ndarray, labels: np.ndarray, theta: np.ndarray, dims: np.ndarray,
               grad: np.ndarray, logits: np.ndarray, buf: np.ndarray, lr: float,
               weight_decay: float, momentum: float, nesterov: bool, has_buf: bool) -> float:
    """:func:`loss_and_grad` then :func:`sgd_update`; returns the batch loss (before the
    update). Shapes as there: ``x (C, H, W, B)``, ``labels (B,)``, ``theta, grad, buf
    (P,)``, ``logits (num_classes, B)``."""
    loss = loss_and_grad(x, labels, theta, dims, grad, logits)
    sgd_update(theta, grad, buf, lr, weight_decay, momentum, nesterov, has_buf)
    return loss


@njit(cache=True, fastmath=False)
def prepare_batch(images: np.ndarray, tops: np.ndarray, lefts: np.ndarray, flips: np.ndarray,
                  padding: int, lut: np.ndarray, out: np.ndarray) -> None:
    """Zero-pad, crop, mirror and normalise a uint8 batch into the kernels' layout.

    Parameters
    ----------
    images : uint8 array ``(B, C, H, W)``
    tops, lefts : int64 arrays ``(B,)``
        Crop offsets into the images padded by ``padding`` on every side.
    flips : bool array ``(B,)``
        Mirror the crop left-right.
    padding : int
    lut : float32 array ``(C, 256)``
        The normalised value of each uint8 level (padding is level 0).
    out : float32 array ``(C, h, w, B)``
        Receives the batch (``h, w``: crop size), batch innermost.
    """
    if images.shape[0] < _TILED_FROM:
        _prepare_direct(images, tops, lefts, flips, padding, lut, out)
    else:
        _prepare_tiled(images, tops, lefts, flips, padding, lut, out)


@njit(cache=True, fastmath=False)
def prepare_rows(images: np.ndarray, rows: np.ndarray, tops: np.ndarray, lefts: np.ndarray,
                 flips: np.ndarray, padding: int, lut: np.ndarray, out: np.ndarray) -> None:
    """:func:`prepare_batch` of ``images[rows]``: a training batch from the dataset's array
    in one call.

    ``images`` uint8 ``(N, C, H, W)``; ``rows`` int64 ``(B,)``, each in ``0 .. N - 1``
    (IndexError otherwise); the rest as in :func:`prepare_batch`. The rows are copied
    out whole first: read pixel by pixel where they lie, scattered over the dataset, each
    image's first cache lines stall the pass (twice the time).
    """
    n, size = images.shape[0], images.shape[1] * images.shape[2] * images.shape[3]
    flat = images.reshape((n, size))
    batch = np.empty((rows.size, size), np.uint8)
    for b in range(rows.size):
        if rows[b] < 0 or rows[b] >= n:
            raise IndexError("a row is outside the images")
        source = flat[rows[b]]
        target = batch[b]
        for i in range(size):
            target[i] = source[i]
    prepare_batch(batch.reshape((rows.size, *images.shape[1:])), tops, lefts, flips, padding,
                  lut, out)


@njit(cache=True, fastmath=False)
def _prepare_direct(images: np.ndarray, tops: np.ndarray, lefts: np.ndarray,
                    flips: np.ndarray, padding: int, lut: np.ndarray, out: np.ndarray) -> None:
    """:func:`prepare_batch` one example at a time (fastest while ``out`` stays in cache)."""
    nb, nc, hin, win = images.shape
    ho, wo = out.shape[1], out.shape[2]
    for b in range(nb):
        top = tops[b] - padding
        left = lefts[b] - padding
        flip = flips[b]
        for c in range(nc):
            zero = lut[c, 0]
            for y in range(ho):
                sy = top + y
                inside = 0 <= sy < hin
                for xx in range(wo):
                    sx = left + (wo - 1 - xx if flip else xx)
                    if inside and 0 <= sx < win:
                        out[c, y, xx, b] = lut[c, images[b, c, sy, sx]]
                    else:
                        out[c, y, xx, b] = zero


@njit(cache=True, fastmath=False)
def _prepare_tiled(images: np.ndarray, tops: np.ndarray, lefts: np.ndarray,
                   flips: np.ndarray, padding: int, lut: np.ndarray, out: np.ndarray) -> None:
    """:func:`prepare_batch` through a tile of a few examples, the examples innermost: one
    example at a time writes with a stride of the whole batch, which misses the cache once
    the batch is large (2.8 ms against 7.8 for 2,048 images of 28 x 28). Each row's
    in-bounds columns are found once, not tested per pixel."""
    nb, nc, hin, win = images.shape
    ho, wo = out.shape[1], out.shape[2]
    tile = np.empty((ho, wo, _PREPARE_BLOCK), np.float32)
    for start in range(0, nb, _PREPARE_BLOCK):
        stop = min(start + _PREPARE_BLOCK, nb)
        for c in range(nc):
            zero = lut[c, 0]
            for b in range(start, stop):
                j = b - start
                top = tops[b] - padding
                left = lefts[b] - padding
                flip = flips[b]
                if flip:  # source column left + wo - 1 - xx
                    first = max(0, left + wo - win)
                    last = min(wo, left + wo)
                else:     # source column left + xx
                    first = max(0, -left)
                    last = min(wo, win - left)
                for y in range(ho):
                    sy = top + y
                    if sy < 0 or sy >= hin or first >= last:
                        for xx in range(wo):
                            tile[y, xx, j] = zero
                        continue
                    for xx in range(first):
                        tile[y, xx, j] = zero
                    if flip:
                        for xx in range(first, last):
                            tile[y, xx, j] = lut[c, images[b, c, sy, left + wo - 1 - xx]]
                    else:
                        for xx in range(first, last):
                            tile[y, xx, j] = lut[c, images[b, c, sy, left + xx]]
                    for xx in range(last, wo):
                        tile[y, xx, j] = zero
            for y in range(ho):
                for xx in range(wo):
                    for b in range(start, stop):
                        out[c, y, xx, b] = tile[y, xx, b - start]
