"""Mini-batch iteration whose order and augmentation depend only on (seed, epoch).

Seed scheme: ``numpy.random.SeedSequence([seed, epoch]).generate_state(2,
numpy.uint64)`` gives two 64-bit words; the first seeds the ``torch.Generator``
that draws the epoch's permutation (``torch.randperm``), the second seeds the
generator passed to the transform for each batch in turn. Keeping the two
streams apart means adding or removing augmentation never changes the example
order. No global random state is read or changed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import torch

from posteriorzoo._api import public
from posteriorzoo.data.datasets import ArrayDataset
from posteriorzoo.errors import InvalidOptionError

__all__ = ["epoch_generators", "epoch_order", "iterate_batches"]

BatchTransform = Callable[[torch.Tensor, torch.Generator], torch.Tensor]


@public
def epoch_generators(seed: int, epoch: int) -> tuple[torch.Generator, torch.Generator]:
    """The (order, augmentation) generators of ``epoch`` under ``seed``.

    Parameters
    ----------
    seed, epoch : int
        Non-negative integers.

    Returns
    -------
    order, augment : torch.Generator
        CPU generators seeded from ``SeedSequence([seed, epoch])``.
    """
    if seed < 0 or epoch < 0:
        raise InvalidOptionError(f"seed and epoch must be non-negative, got {seed}, {epoch}")
    words = np.random.SeedSequence([int(seed), int(epoch)]).generate_state(2, np.uint64)
    order, augment = torch.Generator(), torch.Generator()
    order.manual_seed(int(words[0]))
    augment.manual_seed(int(words[1]))
    return order, augment


@public
def epoch_order(n_examples: int, seed: int, epoch: int, *, shuffle: bool = True,
                replacement: bool = False) -> tuple[np.ndarray, torch.Generator]:
    """The order in which :func:`iterate_batches` visits the examples in ``epoch``, and
    the generator its batches' augmentation then draws from, batch after batch.

    Parameters
    ----------
    n_examples : int
        The dataset's length.
    seed, epoch : int
        Non-negative.
    shuffle, replacement : bool
        As in :func:`iterate_batches`.

    Returns
    -------
    order : int64 array ``(n_examples,)``
        Indices into the dataset; batch k is ``order[k * batch_size:(k + 1) * batch_size]``.
    augment : torch.Generator
    """
    if replacement and not shuffle:
        raise InvalidOptionError("replacement draws a random order: it needs shuffle=True")
    order_gen, augment_gen = epoch_generators(seed, epoch)
    n = int(n_examples)
    if replacement:
        order = torch.randint(n, (n,), generator=order_gen)
    else:
        order = torch.randperm(n, generator=order_gen) if shuffle else torch.arange(n)
    return order.numpy(), augment_gen


@public
def iterate_batches(
    dataset: ArrayDataset,
    batch_size: int,
    seed: int,
    epoch: int,
    transform: BatchTransform | None = None,
    shuffle: bool = True,
    drop_last: bool = False,
    replacement: bool = False,
    resident: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield one epoch of ``(images, labels)`` batches.

    Parameters
    ----------
    dataset : ArrayDataset
        uint8 images ``(N, C, H, W)`` and int64 labels ``(N,)``.
    batch_size : int
        Examples per batch; the last batch may be smaller unless ``drop_last``.
    seed, epoch : int
        Non-negative; the order and augmentation are a pure function of them
        (see the module docstring for the scheme).
    transform : callable, optional
        ``transform(batch, generator) -> batch``, e.g. a
        :class:`~posteriorzoo.data.Compose`; it receives the uint8 batch as a
        tensor. A uint8 result is scaled to float32 in [0, 1]; a floating
        result is passed through (as float32).
    shuffle : bool, default True
        Random permutation per epoch; if False, dataset order (the augmentation
        is still seeded by ``(seed, epoch)``).
    drop_last : bool, default False
        Skip a final batch smaller than ``batch_size``.
    replacement : bool, default False
        Draw the epoch's ``N`` examples independently and uniformly, with
        replacement, instead of a permutation: every batch is then an independent
        draw, which a sampler's estimate of its minibatch noise assumes (SGHMC's
        ``minibatches = "independent"``). Within a permutation the batches of an
        epoch add up to the whole dataset, so their noise cancels over the epoch.
        Needs ``shuffle``.
    resident : (images, labels) tensors, optional
        The dataset's images and labels already on a device (a GPU): each batch is
        gathered and transformed there, in the same order and with the same random
        draws (from the CPU generator) as from ``dataset``'s arrays.

    Yields
    ------
    images : torch.Tensor
        float32, shape ``(B, C, H', W')``; in [0, 1] without a transform.
    labels : torch.Tensor
        int64, shape ``(B,)``.
    """
    if batch_size < 1:
        raise InvalidOptionError(f"batch_size must be positive, not {batch_size}")
    order, augment_gen = epoch_order(len(dataset), seed, epoch, shuffle=shuffle,
                                     replacement=replacement)
    n = len(order)
    stop = n - n % batch_size if drop_last else n
    for start in range(0, stop, batch_size):
        idx = order[start:start + batch_size]
        if resident is None:
            images = torch.from_numpy(dataset.images[idx])
            labels = torch.from_numpy(dataset.labels[idx])
        else:
            where = torch.from_numpy(np.asarray(idx)).to(resident[0].device)
            images, labels = resident[0][where], resident[1][where]
        if transform is not None:
            images = transform(images, augment_gen)
        images = images.float() / 255.0 if images.dtype == torch.uint8 else images.float()
        yield images, labels
