"""The torch engine's training batches, prepared by numba in the kernels' layout.

:class:`FastTransform` stands in for the recipe's ``Compose([RandomCrop, RandomHorizontalFlip,
Normalize])`` inside :func:`posteriorzoo.data.iterate_batches`: it draws the random crop
offsets and flips from the *same* generator with the transforms' own ``sample`` methods (so
the random stream is consumed exactly as the torch transforms consume it), then pads,
crops, mirrors and normalises in one numba pass through a lookup table computed by the
``Normalize`` transform itself. The result is bit-identical to the torch transforms (tested),
delivered batch-innermost ``(C, H, W, B)`` as the kernels want it. Any pipeline it does not
recognise runs through the torch transforms unchanged, only transposed.

:func:`fast_batches` reads each batch straight from the dataset's array in that pass (the
order from :func:`posteriorzoo.data.epoch_order`, as ``iterate_batches`` has it): no batch
is gathered, wrapped in tensors or converted on the way, which took a quarter of a step.
Without a flip and with a square crop range, an epoch's crop offsets come from one
``torch.randint`` (:meth:`FastTransform.epoch_offsets`): torch draws them one after another
from the generator, so the epoch's draw is the batches' draws laid end to end, as a check
of that property confirms once per process before it is relied on.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import cast

import numpy as np
import torch

from posteriorzoo.data import (
    ArrayDataset,
    Compose,
    Normalize,
    RandomCrop,
    RandomHorizontalFlip,
    epoch_order,
    iterate_batches,
)
from posteriorzoo.data.transforms import Transform
from posteriorzoo.errors import InvalidOptionError
from train_zoo.fast.kernels import prepare_rows

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

    def __init__(self, transform: Transform, image_shape: tuple[int, int, int]) -> None:
        self.transform = transform
        steps = list(transform.transforms) if type(transform) is Compose else [transform]
        self.crop: RandomCrop | None = None
        self.flip: RandomHorizontalFlip | None = None
        self.table: np.ndarray | None = None
        channels, height, width = image_shape
        self.out_size = (int(height), int(width))
        if steps and type(steps[0]) is RandomCrop:
            self.crop = cast(RandomCrop, steps.pop(0))
            self.out_size = self.crop.size
        if steps and type(steps[0]) is RandomHorizontalFlip:
            self.flip = cast(RandomHorizontalFlip, steps.pop(0))
        if len(steps) == 1 and type(steps[0]) is Normalize:
            self.table = normalize_table(cast(Normalize, steps[0]), int(channels))
        self.fused = self.table is not None

    def __call__(self, images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        if not self.fused:
            out = self.transform(images, generator)
            out = out.float() / 255.0 if out.dtype == torch.uint8 else out.float()
            inner = np.ascontiguousarray(out.numpy().transpose(1, 2, 3, 0))
            return torch.from_numpy(inner).permute(3, 0, 1, 2)
        array = np.ascontiguousarray(images.numpy())
        prepared = self.prepare(array, np.arange(len(array)), generator)
        return torch.from_numpy(prepared).permute(3, 0, 1, 2)

    def prepare(self, images: np.ndarray, rows: np.ndarray, generator: torch.Generator,
                offsets: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
        """The fused pipeline on ``images[rows]``: float32 ``(C, h, w, len(rows))``,
        C-contiguous. ``images`` uint8 ``(N, C, H, W)``, ``rows`` int64; the random draws
        are those of the torch transforms on that batch, or the crop ``offsets`` (tops,
        lefts) drawn for it already (:meth:`epoch_offsets`). Only when :attr:`fused`."""
        count = len(rows)
        shape = (count, *images.shape[1:])
        if offsets is not None:   # epoch_offsets drew them; it is never used with a flip
            tops, lefts = offsets
            padding = self.crop.padding if self.crop is not None else 0
        elif self.crop is not None:
            drawn_tops, drawn_lefts = self.crop.sample(shape, generator)
            tops, lefts = drawn_tops.numpy(), drawn_lefts.numpy()
            padding = self.crop.padding
        else:
            tops = lefts = np.zeros(count, dtype=np.int64)
            padding = 0
        if self.flip is not None and offsets is None:
            flips = self.flip.sample(count, generator).numpy()
        else:
            flips = np.zeros(count, dtype=np.bool_)
        if self.table is None:
            raise RuntimeError("FastTransform.prepare needs the fused pipeline (fused is False)")
        out = np.empty((images.shape[1], *self.out_size, count), dtype=np.float32)
        prepare_rows(images, rows, tops, lefts, flips, padding, self.table, out)
        return out

    def epoch_offsets(self, n_examples: int, image_shape: tuple[int, int, int],
                      generator: torch.Generator) -> np.ndarray | None:
        """An epoch's crop offsets in one draw, or None where that draw would differ from
        the batches' own (a flip interleaves its draws with the offsets; a crop range
        that differs between rows and columns cannot share one draw).

        Returns int64 ``(2 * n_examples,)``: the batch of rows ``start .. start + B``
        has its tops at ``[2 * start, 2 * start + B)`` and its lefts right after, as
        :meth:`RandomCrop.sample` draws them batch by batch.
        """
        if not self.fused or self.flip is not None:
            return None
        if self.crop is None:
            return np.zeros(2 * n_examples, dtype=np.int64)
        _, height, width = image_shape
        spans = {height + 2 * self.crop.padding - self.crop.size[0] + 1,
                 width + 2 * self.crop.padding - self.crop.size[1] + 1}
        if len(spans) != 1 or min(spans) < 1 or not _randint_draws_concatenate():
            return None
        return torch.randint(0, spans.pop(), (2 * n_examples,), generator=generator).numpy()


@functools.cache
def _randint_draws_concatenate() -> bool:
    """Whether torch draws ``randint`` values one after another from a generator, so that
    one draw of ``m + n`` values equals a draw of ``m`` then one of ``n``."""
    whole, parts = torch.Generator().manual_seed(2024), torch.Generator().manual_seed(2024)
    lengths = (64, 64, 32, 1, 47)
    together = torch.randint(0, 9, (sum(lengths),), generator=whole)
    apart = torch.cat([torch.randint(0, 9, (n,), generator=parts) for n in lengths])
    return torch.equal(together, apart)


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
    if not transform.fused:
        for images, labels in iterate_batches(dataset, batch_size, seed=seed, epoch=epoch,
                                              transform=transform, replacement=replacement):
            yield images.permute(1, 2, 3, 0).numpy(), labels.numpy()
        return
    if batch_size < 1:
        raise InvalidOptionError(f"batch_size must be positive, not {batch_size}")
    order, augment = epoch_order(len(dataset), seed, epoch, replacement=replacement)
    arrays = np.ascontiguousarray(dataset.images)
    targets = dataset.labels
    offsets = transform.epoch_offsets(len(order), dataset.image_shape, augment)
    if offsets is None:
        for start in range(0, len(order), batch_size):
            rows = order[start:start + batch_size]
            yield transform.prepare(arrays, rows, augment), targets[rows]
        return
    for start in range(0, len(order), batch_size):
        rows = order[start:start + batch_size]
        count = len(rows)
        drawn = (offsets[2 * start:2 * start + count],
                 offsets[2 * start + count:2 * start + 2 * count])
        yield transform.prepare(arrays, rows, augment, drawn), targets[rows]
