"""The torch engine's training batches, prepared by numba in the kernels' layout.

:class:`FastTransform` stands in for the recipe's ``Compose([RandomCrop, RandomHorizontalFlip,
Normalize])`` inside :func:`posteriorzoo.data.iterate_batches`: it draws the random crop
offsets and flips from the *same* generator with the transforms' own ``sample`` methods (so
the random stream is consumed exactly as the torch transforms consume it), then pads,
crops, mirrors and normalises in one numba pass through a lookup table computed by the
``Normalize`` transform itself. The result is bit-identical to the torch transforms (tested),
delivered batch-innermost ``(C, H, W, B)`` as the kernels want it. Any pipeline it does not
recognise runs through the torch transforms unchanged, only transposed.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from posteriorzoo.data import (
    ArrayDataset,
    Compose,
    Normalize,
    RandomCrop,
    RandomHorizontalFlip,
    iterate_batches,
)
from train_zoo.fast.kernels import prepare_batch

__all__ = ["FastTransform", "fast_batches", "normalize_table"]


def normalize_table(normalize: Normalize, channels: int) -> np.ndarray:
    """float32 ``(channels, 256)``: ``normalize`` applied to every uint8 level."""
    levels = torch.arange(256, dtype=torch.uint8).reshape(1, 1, 1, 256)
    levels = levels.expand(1, channels, 1, 256).contiguous()
    table = normalize(levels).reshape(channels, 256)
    return np.ascontiguousarray(table.numpy(), dtype=np.float32)


class FastTransform:
    """A drop-in for a batch transform that returns a batch-innermost float32 batch.

    Parameters
    ----------
    transform : Compose or Transform
        The torch transform to reproduce (``train_zoo.data.train_transform(recipe, data)``).
    image_shape : (int, int, int)
        ``(C, H, W)`` of the dataset's images.

    Notes
    -----
    ``transform_instance(images, generator)`` takes a uint8 batch ``(B, C, H, W)`` and
    returns a float32 tensor of shape ``(B, C, h, w)`` that is a *permuted view* of a
    C-contiguous ``(C, h, w, B)`` array (``batch.permute(1, 2, 3, 0).numpy()`` gets it back
    without a copy). Its values equal ``transform(images, generator)`` (scaled to [0, 1]
    first if that were uint8, as ``iterate_batches`` does) bit for bit.
    ``fused`` tells whether the numba path is used (else the torch transforms run).
    """

    def __init__(self, transform: object, image_shape: tuple[int, int, int]) -> None:
        self.transform = transform
        steps = list(transform.transforms) if type(transform) is Compose else [transform]
        self.crop: RandomCrop | None = None
        self.flip: RandomHorizontalFlip | None = None
        self.table: np.ndarray | None = None
        channels, height, width = image_shape
        self.out_size = (int(height), int(width))
        if steps and type(steps[0]) is RandomCrop:
            self.crop = steps.pop(0)
            self.out_size = self.crop.size
        if steps and type(steps[0]) is RandomHorizontalFlip:
            self.flip = steps.pop(0)
        if len(steps) == 1 and type(steps[0]) is Normalize:
            self.table = normalize_table(steps[0], int(channels))
        self.fused = self.table is not None

    def __call__(self, images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        if not self.fused:
            out = self.transform(images, generator)
            out = out.float() / 255.0 if out.dtype == torch.uint8 else out.float()
            inner = np.ascontiguousarray(out.numpy().transpose(1, 2, 3, 0))
            return torch.from_numpy(inner).permute(3, 0, 1, 2)
        count = images.shape[0]
        if self.crop is not None:
            tops, lefts = self.crop.sample(images.shape, generator)
            tops, lefts, padding = tops.numpy(), lefts.numpy(), self.crop.padding
        else:
            tops = lefts = np.zeros(count, dtype=np.int64)
            padding = 0
        if self.flip is not None:
            flips = self.flip.sample(count, generator).numpy()
        else:
            flips = np.zeros(count, dtype=np.bool_)
        out = np.empty((images.shape[1], *self.out_size, count), dtype=np.float32)
        prepare_batch(images.numpy(), tops, lefts, flips, padding, self.table, out)
        return torch.from_numpy(out).permute(3, 0, 1, 2)


def fast_batches(dataset: ArrayDataset, batch_size: int, seed: int, epoch: int,
                 transform: FastTransform, *, replacement: bool = False
                 ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """One epoch of ``iterate_batches(dataset, batch_size, seed=seed, epoch=epoch,
    transform=..., replacement=...)`` in the kernels' layout.

    Yields
    ------
    x : float32 array ``(C, h, w, B)``, C-contiguous
    labels : int64 array ``(B,)``
    """
    for images, labels in iterate_batches(dataset, batch_size, seed=seed, epoch=epoch,
                                          transform=transform, replacement=replacement):
        yield images.permute(1, 2, 3, 0).numpy(), labels.numpy()
