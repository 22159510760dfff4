"""The members' predictions of OptuNet collections, many networks at once (numba).

:func:`posteriorzoo.collection.evaluation.member_probabilities` (engine ``"auto"``) uses
these kernels for OptuNets: ``evaluate``, ``diagnose`` and the report. The report needs
every method checkpoint's softmax outputs on every in- and out-of-distribution image: for
the shipped zoo 1,500 OptuNets on 10,450 images, about 705 GFLOP. The torch path runs one
``torch.nn.Module`` per checkpoint, whose tiny convolutions (2 and 10 channels) leave the
CPU mostly idle: minutes. :func:`kernel_probabilities` computes the same numbers with the
*networks* as the innermost (SIMD) axis: the weights of a block of :data:`B` checkpoints
lie side by side, and each pixel is read once per block and multiplied into all of them.
On two cores: seconds (``benchmarks/bench_report.py`` measures both).

Only the rounding differs from the torch path (float32 sums in another order, fused
multiply-adds, an exponential of its own): probabilities agree within a float32 error
bound (about 1e-6 in practice), and the report's metrics within the bounds that follow
from it (``tests/test_report_speed_equivalence.py``); a printed table cell may differ in
its last digit where a value lies within that bound of a rounding boundary. Anything
else -- another architecture or image size, non-finite weights, weights large enough to
overflow -- goes to the torch path (:func:`probabilities` returns None), so the results
and the errors stay the torch path's.
"""

from __future__ import annotations

import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from posteriorzoo._numba import announce_compilation

announce_compilation()

__all__ = ["B", "kernel_probabilities", "probabilities", "supports"]

#: Checkpoints per block: a compile-time constant, so that every weight and activation of
#: a block lies at a constant offset from its array's start (the vectoriser then checks
#: one overlap per array, not one per tap), and one block's conv1 weights (14 KB) stay in
#: the L1 cache while the pixels stream past. Seven 16-lane vectors: a collection of 100
#: (the paper's size) fills one block with 12 lanes idle, where 128 left 28 idle (its
#: predictions 8% faster; 1,000 fill nine blocks, 0.8% idle).
B = 112
#: OptuNet (posteriorzoo.models.optunet) on 28x28 single-channel images: its state keys
#: and shapes (None: the number of classes).
IMAGE_SHAPE = (1, 28, 28)
SHAPES = {"conv1.weight": (2, 1, 4, 4), "conv2.weight": (10, 1, 5, 5),
          "fc.weight": (None, 10), "fc.bias": (None,)}
_POOLED = 8        # conv1 25x25 -> max-pool 3/3 -> 8x8 (rows and columns 0..23)
_FEATURES = 10     # conv2 channels (two groups of 5), each averaged over its 4x4 map
#: Images per parallel task: enough work for its scratch buffers and its block's weights
#: to be loaded once per many images.
_IMAGES_PER_TASK = 512
_FASTMATH = {"contract"}   # fused multiply-adds only: no reassociation, NaN and inf kept
#: exp(x) for x below this is taken as exp(_EXP_LOW) ~ 1.6e-38: the metrics clip
#: probabilities at 1e-12 and count 0 log 0 as 0, so such values never show.
_EXP_LOW = np.float32(-87.0)


@njit(fastmath=_FASTMATH, cache=True)
def _conv1_pool(image: np.ndarray, w1: np.ndarray, h1: np.ndarray) -> None:
    """conv1 (2 channels, 4x4, no bias), max-pool 3/3 and ReLU of one image, for a block.

    ``w1[(16 * c + 4 * ky + kx) * B + m]`` is tap (ky, kx) of channel c of network m and
    ``h1[((8 * c + y) * 8 + x) * B + m]`` its pooled map. ReLU is folded into the pool:
    the running maximum starts at 0. A pool window's three columns are computed together,
    so that each weight loaded serves three positions.
    """
    for py in range(_POOLED):
        for px in range(_POOLED):
            out0 = (py * _POOLED + px) * B
            out1 = ((_POOLED + py) * _POOLED + px) * B
            for m in range(B):
                h1[out0 + m] = 0.0
                h1[out1 + m] = 0.0
            for dy in range(3):
                y, x = 3 * py + dy, 3 * px
                p00, p01, p02, p03, p04, p05 = image[y + 0, x:x + 6]
                p10, p11, p12, p13, p14, p15 = image[y + 1, x:x + 6]
                p20, p21, p22, p23, p24, p25 = image[y + 2, x:x + 6]
                p30, p31, p32, p33, p34, p35 = image[y + 3, x:x + 6]
                for m in range(B):
                    s0 = (p00 * w1[m] + p01 * w1[1 * B + m] + p02 * w1[2 * B + m]
                         + p03 * w1[3 * B + m] + p10 * w1[4 * B + m] + p11 * w1[5 * B + m]
                         + p12 * w1[6 * B + m] + p13 * w1[7 * B + m] + p20 * w1[8 * B + m]
                         + p21 * w1[9 * B + m] + p22 * w1[10 * B + m] + p23 * w1[11 * B + m]
                         + p30 * w1[12 * B + m] + p31 * w1[13 * B + m] + p32 * w1[14 * B + m]
                         + p33 * w1[15 * B + m])
                    s1 = (p01 * w1[m] + p02 * w1[1 * B + m] + p03 * w1[2 * B + m]
                         + p04 * w1[3 * B + m] + p11 * w1[4 * B + m] + p12 * w1[5 * B + m]
                         + p13 * w1[6 * B + m] + p14 * w1[7 * B + m] + p21 * w1[8 * B + m]
                         + p22 * w1[9 * B + m] + p23 * w1[10 * B + m] + p24 * w1[11 * B + m]
                         + p31 * w1[12 * B + m] + p32 * w1[13 * B + m] + p33 * w1[14 * B + m]
                         + p34 * w1[15 * B + m])
                    s2 = (p02 * w1[m] + p03 * w1[1 * B + m] + p04 * w1[2 * B + m]
                         + p05 * w1[3 * B + m] + p12 * w1[4 * B + m] + p13 * w1[5 * B + m]
                         + p14 * w1[6 * B + m] + p15 * w1[7 * B + m] + p22 * w1[8 * B + m]
                         + p23 * w1[9 * B + m] + p24 * w1[10 * B + m] + p25 * w1[11 * B + m]
                         + p32 * w1[12 * B + m] + p33 * w1[13 * B + m] + p34 * w1[14 * B + m]
                         + p35 * w1[15 * B + m])
                    best = h1[out0 + m]
                    best = s0 if s0 > best else best
                    best = s1 if s1 > best else best
                    h1[out0 + m] = s2 if s2 > best else best
                    s0 = (p00 * w1[16 * B + m] + p01 * w1[17 * B + m] + p02 * w1[18 * B + m]
                         + p03 * w1[19 * B + m] + p10 * w1[20 * B + m] + p11 * w1[21 * B + m]
                         + p12 * w1[22 * B + m] + p13 * w1[23 * B + m] + p20 * w1[24 * B + m]
                         + p21 * w1[25 * B + m] + p22 * w1[26 * B + m] + p23 * w1[27 * B + m]
                         + p30 * w1[28 * B + m] + p31 * w1[29 * B + m] + p32 * w1[30 * B + m]
                         + p33 * w1[31 * B + m])
                    s1 = (p01 * w1[16 * B + m] + p02 * w1[17 * B + m] + p03 * w1[18 * B + m]
                         + p04 * w1[19 * B + m] + p11 * w1[20 * B + m] + p12 * w1[21 * B + m]
                         + p13 * w1[22 * B + m] + p14 * w1[23 * B + m] + p21 * w1[24 * B + m]
                         + p22 * w1[25 * B + m] + p23 * w1[26 * B + m] + p24 * w1[27 * B + m]
                         + p31 * w1[28 * B + m] + p32 * w1[29 * B + m] + p33 * w1[30 * B + m]
                         + p34 * w1[31 * B + m])
                    s2 = (p02 * w1[16 * B + m] + p03 * w1[17 * B + m] + p04 * w1[18 * B + m]
                         + p05 * w1[19 * B + m] + p12 * w1[20 * B + m] + p13 * w1[21 * B + m]
                         + p14 * w1[22 * B + m] + p15 * w1[23 * B + m] + p22 * w1[24 * B + m]
                         + p23 * w1[25 * B + m] + p24 * w1[26 * B + m] + p25 * w1[27 * B + m]
                         + p32 * w1[28 * B + m] + p33 * w1[29 * B + m] + p34 * w1[30 * B + m]
                         + p35 * w1[31 * B + m])
                    best = h1[out1 + m]
                    best = s0 if s0 > best else best
                    best = s1 if s1 > best else best
                    h1[out1 + m] = s2 if s2 > best else best


@njit(fastmath=_FASTMATH, cache=True)
def _conv2_features(h1: np.ndarray, w2: np.ndarray, features: np.ndarray) -> None:
    """conv2 (10 channels, 5x5, groups of 5 reading one pooled map each, no bias), ReLU
    and the sum over its 4x4 map, for a block: ``features[c * B + m]`` (the head divides
    by 16). ``w2[(25 * c + 5 * ky + kx) * B + m]``. A row of four output positions per
    pass over the block, so that each weight loaded serves four positions.
    """
    for c in range(_FEATURES):
        k = w2[25 * c * B:]
        f = c * B
        for m in range(B):
            features[f + m] = 0.0
        for oy in range(_POOLED - 4):
            x = h1[((c // 5) * _POOLED + oy) * _POOLED * B:]
            for m in range(B):
                s0 = (x[m] * k[m] + x[1 * B + m] * k[1 * B + m]
                     + x[2 * B + m] * k[2 * B + m] + x[3 * B + m] * k[3 * B + m]
                     + x[4 * B + m] * k[4 * B + m] + x[8 * B + m] * k[5 * B + m]
                     + x[9 * B + m] * k[6 * B + m] + x[10 * B + m] * k[7 * B + m]
                     + x[11 * B + m] * k[8 * B + m] + x[12 * B + m] * k[9 * B + m]
                     + x[16 * B + m] * k[10 * B + m] + x[17 * B + m] * k[11 * B + m]
                     + x[18 * B + m] * k[12 * B + m] + x[19 * B + m] * k[13 * B + m]
                     + x[20 * B + m] * k[14 * B + m] + x[24 * B + m] * k[15 * B + m]
                     + x[25 * B + m] * k[16 * B + m] + x[26 * B + m] * k[17 * B + m]
                     + x[27 * B + m] * k[18 * B + m] + x[28 * B + m] * k[19 * B + m]
                     + x[32 * B + m] * k[20 * B + m] + x[33 * B + m] * k[21 * B + m]
                     + x[34 * B + m] * k[22 * B + m] + x[35 * B + m] * k[23 * B + m]
                     + x[36 * B + m] * k[24 * B + m])
                s1 = (x[1 * B + m] * k[m] + x[2 * B + m] * k[1 * B + m]
                     + x[3 * B + m] * k[2 * B + m] + x[4 * B + m] * k[3 * B + m]
                     + x[5 * B + m] * k[4 * B + m] + x[9 * B + m] * k[5 * B + m]
                     + x[10 * B + m] * k[6 * B + m] + x[11 * B + m] * k[7 * B + m]
                     + x[12 * B + m] * k[8 * B + m] + x[13 * B + m] * k[9 * B + m]
                     + x[17 * B + m] * k[10 * B + m] + x[18 * B + m] * k[11 * B + m]
                     + x[19 * B + m] * k[12 * B + m] + x[20 * B + m] * k[13 * B + m]
                     + x[21 * B + m] * k[14 * B + m] + x[25 * B + m] * k[15 * B + m]
                     + x[26 * B + m] * k[16 * B + m] + x[27 * B + m] * k[17 * B + m]
                     + x[28 * B + m] * k[18 * B + m] + x[29 * B + m] * k[19 * B + m]
                     + x[33 * B + m] * k[20 * B + m] + x[34 * B + m] * k[21 * B + m]
                     + x[35 * B + m] * k[22 * B + m] + x[36 * B + m] * k[23 * B + m]
                     + x[37 * B + m] * k[24 * B + m])
                s2 = (x[2 * B + m] * k[m] + x[3 * B + m] * k[1 * B + m]
                     + x[4 * B + m] * k[2 * B + m] + x[5 * B + m] * k[3 * B + m]
                     + x[6 * B + m] * k[4 * B + m] + x[10 * B + m] * k[5 * B + m]
                     + x[11 * B + m] * k[6 * B + m] + x[12 * B + m] * k[7 * B + m]
                     + x[13 * B + m] * k[8 * B + m] + x[14 * B + m] * k[9 * B + m]
                     + x[18 * B + m] * k[10 * B + m] + x[19 * B + m] * k[11 * B + m]
                     + x[20 * B + m] * k[12 * B + m] + x[21 * B + m] * k[13 * B + m]
                     + x[22 * B + m] * k[14 * B + m] + x[26 * B + m] * k[15 * B + m]
                     + x[27 * B + m] * k[16 * B + m] + x[28 * B + m] * k[17 * B + m]
                     + x[29 * B + m] * k[18 * B + m] + x[30 * B + m] * k[19 * B + m]
                     + x[34 * B + m] * k[20 * B + m] + x[35 * B + m] * k[21 * B + m]
                     + x[36 * B + m] * k[22 * B + m] + x[37 * B + m] * k[23 * B + m]
                     + x[38 * B + m] * k[24 * B + m])
                s3 = (x[3 * B + m] * k[m] + x[4 * B + m] * k[1 * B + m]
                     + x[5 * B + m] * k[2 * B + m] + x[6 * B + m] * k[3 * B + m]
                     + x[7 * B + m] * k[4 * B + m] + x[11 * B + m] * k[5 * B + m]
                     + x[12 * B + m] * k[6 * B + m] + x[13 * B + m] * k[7 * B + m]
                     + x[14 * B + m] * k[8 * B + m] + x[15 * B + m] * k[9 * B + m]
                     + x[19 * B + m] * k[10 * B + m] + x[20 * B + m] * k[11 * B + m]
                     + x[21 * B + m] * k[12 * B + m] + x[22 * B + m] * k[13 * B + m]
                     + x[23 * B + m] * k[14 * B + m] + x[27 * B + m] * k[15 * B + m]
                     + x[28 * B + m] * k[16 * B + m] + x[29 * B + m] * k[17 * B + m]
                     + x[30 * B + m] * k[18 * B + m] + x[31 * B + m] * k[19 * B + m]
                     + x[35 * B + m] * k[20 * B + m] + x[36 * B + m] * k[21 * B + m]
                     + x[37 * B + m] * k[22 * B + m] + x[38 * B + m] * k[23 * B + m]
                     + x[39 * B + m] * k[24 * B + m])
                total = features[f + m]
                total += s0 if s0 > 0 else 0.0
                total += s1 if s1 > 0 else 0.0
                total += s2 if s2 > 0 else 0.0
                total += s3 if s3 > 0 else 0.0
                features[f + m] = total


@intrinsic
def _float32_from_bits(typingctx, bits):
    """The float32 whose IEEE-754 bit pattern is the int32 ``bits``."""
    sig = types.float32(types.int32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


@njit(fastmath=_FASTMATH, cache=True, inline="always")
def _exp_nonpositive(x: float) -> float:
    """exp(x) in float32 for x <= 0 (Cephes' expf: Cody-Waite reduction by ln 2 and a
    degree-6 polynomial, about 1 ulp), written so that a loop of it becomes SIMD code."""
    x = x if x > _EXP_LOW else _EXP_LOW
    n = np.floor(x * np.float32(1.44269504088896341) + np.float32(0.5))
    r = x - n * np.float32(0.693359375) + n * np.float32(2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * (r * r) + r + np.float32(1.0)
    return p * _float32_from_bits((np.int32(n) + np.int32(127)) << 23)


@njit(fastmath=_FASTMATH, cache=True)
def _head(features: np.ndarray, wf: np.ndarray, bf: np.ndarray, logits: np.ndarray) -> None:
    """fc on the averaged features, then softmax: ``logits[k * B + m]`` becomes network
    m's probability of class k. ``wf[(10 * k + c) * B + m]``, ``bf[k * B + m]``."""
    classes = logits.size // B
    for k in range(classes):
        w = (_FEATURES * k) * B
        for m in range(B):
            total = bf[k * B + m]
            for c in range(_FEATURES):
                total += wf[w + c * B + m] * (features[c * B + m] * np.float32(1.0 / 16.0))
            logits[k * B + m] = total
    largest = logits[:B].copy()
    for k in range(1, classes):
        for m in range(B):
            value = logits[k * B + m]
            largest[m] = value if value > largest[m] else largest[m]
    norm = np.zeros(B, dtype=np.float32)
    for k in range(classes):
        for m in range(B):
            value = _exp_nonpositive(logits[k * B + m] - largest[m])
            logits[k * B + m] = value
            norm[m] += value
    for k in range(classes):
        for m in range(B):
            logits[k * B + m] /= norm[m]


@njit(parallel=True, cache=True, nogil=True)
def _probabilities(images: np.ndarray, w1: np.ndarray, w2: np.ndarray, wf: np.ndarray,
                   bf: np.ndarray, count: int, out: np.ndarray) -> None:
    """``out[m, i, k]``: network m's probability of class k on image i, for the first
    ``count`` networks of the blocks ``w1[block]`` ... (each flat, block-innermost)."""
    n, classes = images.shape[0], out.shape[2]
    chunks = (n + _IMAGES_PER_TASK - 1) // _IMAGES_PER_TASK
    for task in prange(w1.shape[0] * chunks):
        block, chunk = task // chunks, task % chunks
        first = block * B
        size = min(B, count - first)
        h1 = np.empty(2 * _POOLED * _POOLED * B, dtype=np.float32)
        features = np.empty(_FEATURES * B, dtype=np.float32)
        logits = np.empty(classes * B, dtype=np.float32)
        for i in range(chunk * _IMAGES_PER_TASK, min(n, (chunk + 1) * _IMAGES_PER_TASK)):
            _conv1_pool(images[i], w1[block], h1)
            _conv2_features(h1, w2[block], features)
            _head(features, wf[block], bf[block], logits)
            for m in range(size):
                for k in range(classes):
                    out[first + m, i, k] = logits[k * B + m]


def supports(architecture: str, shapes: dict[str, tuple[int, ...]],
             image_shape: tuple[int, ...]) -> bool:
    """Whether the kernels compute this collection's networks on these images: an
    ``optunet`` with exactly OptuNet's tensors (any number of classes) on 28x28
    single-channel images. (Its dropout does nothing at evaluation.)"""
    if architecture != "optunet" or tuple(image_shape) != IMAGE_SHAPE:
        return False
    if set(shapes) != set(SHAPES):
        return False
    classes = shapes["fc.bias"][0] if len(shapes["fc.bias"]) == 1 else None
    return classes is not None and all(
        tuple(shapes[key]) == tuple(classes if size is None else size for size in shape)
        for key, shape in SHAPES.items())


def _blocks(layer: np.ndarray) -> np.ndarray:
    """``(count, *shape)`` -> float32 ``(blocks, size * B)``: each block's values for one
    weight side by side (network innermost), the last block padded with zeros."""
    count = layer.shape[0]
    flat = np.asarray(layer, dtype=np.float32).reshape(count, -1)
    blocks = -(-count // B)
    padded = np.zeros((blocks * B, flat.shape[1]), dtype=np.float32)
    padded[:count] = flat
    return np.ascontiguousarray(
        padded.reshape(blocks, B, -1).transpose(0, 2, 1).reshape(blocks, -1))


def kernel_probabilities(layers: dict[str, np.ndarray], images: np.ndarray) -> np.ndarray:
    """Softmax outputs ``(count, n, K)`` float32 of the OptuNets whose weights are
    ``layers`` (state key -> ``(count, *shape)``) on normalised images ``(n, 1, 28, 28)``,
    by the kernels (no checks: see :func:`member_probabilities`)."""
    count, classes = layers["fc.bias"].shape
    pixels = np.ascontiguousarray(np.asarray(images, dtype=np.float32).reshape(-1, 28, 28))
    out = np.empty((count, len(pixels), classes), dtype=np.float32)
    if count and len(pixels):
        _probabilities(pixels, _blocks(layers["conv1.weight"]),
                       _blocks(layers["conv2.weight"]), _blocks(layers["fc.weight"]),
                       _blocks(layers["fc.bias"]), count, out)
    return out


def probabilities(zoo: object, images: torch.Tensor) -> np.ndarray | None:
    """Softmax outputs of every checkpoint of an open collection by the kernels, or None
    where they do not apply (:func:`supports`, or weights that are not finite or large
    enough for an activation to overflow: the torch path then says what goes wrong).

    Parameters
    ----------
    zoo : posteriorzoo.zoo.Zoo
        An open collection (opened with ``verify=True``, its layers are checked as read).
    images : torch.Tensor
        ``(n, C, H, W)`` normalised images.

    Returns
    -------
    numpy.ndarray or None
        ``(N, n, K)`` float32 probabilities.
    """
    shapes = {key: tuple(shape) for key, shape in zoo.shapes.items()}
    if not supports(zoo.architecture, shapes, tuple(images.shape[1:])):
        return None
    layers = {key: zoo.layer(key) for key in SHAPES}
    pixels = images.numpy()
    if not _cannot_overflow(layers, pixels):
        return None
    return kernel_probabilities(layers, pixels)


def _cannot_overflow(layers: dict[str, np.ndarray], images: np.ndarray) -> bool:
    """Whether every weight and pixel is finite and no activation can reach 1e30 (float32
    overflows at 3.4e38): bounds through the layers from the largest sums of absolute
    weights. Then no inf or NaN arises inside the kernels, whose max-pool and ReLU do not
    carry NaN as torch's do."""
    arrays = [*layers.values(), images]
    if not all(np.isfinite(array).all() for array in arrays):
        return False
    count = len(layers["fc.bias"])

    def largest_row_sum(key: str, rows: int) -> float:
        weights = np.abs(np.asarray(layers[key], dtype=np.float64)).reshape(count, rows, -1)
        return float(weights.sum(axis=2).max()) if weights.size else 0.0

    bound = float(np.abs(images).max()) if images.size else 0.0
    bound *= largest_row_sum("conv1.weight", 2)          # conv1, then pool and ReLU
    bound *= largest_row_sum("conv2.weight", _FEATURES)  # conv2, ReLU, the mean
    bound = bound * largest_row_sum("fc.weight", layers["fc.weight"].shape[1]) + float(
        np.abs(layers["fc.bias"]).max())
    return bound < 1e30
