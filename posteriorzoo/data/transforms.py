"""Batch image transforms in plain torch, with explicit random generators.

Every transform is called as ``transform(images, generator)`` on a batch of shape
``(B, C, H, W)``. Random transforms draw *only* from the ``torch.Generator``
passed in, never from torch's global RNG, so an augmentation is reproducible
from the generator's seed alone. The random draws are exposed (``sample``) and
the deterministic part is a separate method (``apply``), so the same draws can
be replayed or checked.

The usual pipeline is ``Compose([RandomCrop(32, 4), RandomHorizontalFlip(),
Normalize(mean, std)])`` on uint8 images: cropping before normalizing makes the
zero padding black, as in torchvision's CIFAR recipe.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from posteriorzoo.errors import InvalidOptionError

__all__ = ["Compose", "Normalize", "RandomCrop", "RandomHorizontalFlip", "Transform"]


class Transform:
    """Base class: ``__call__(images, generator=None) -> images``."""

    def __call__(self, images: torch.Tensor,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        raise NotImplementedError


def _check_batch(images: torch.Tensor) -> None:
    if images.ndim != 4:
        raise InvalidOptionError(f"expected a (B, C, H, W) batch, got shape {tuple(images.shape)}")


def _need_generator(generator: torch.Generator | None, who: str) -> torch.Generator:
    if generator is None:
        # The global RNG would make runs depend on unrelated code that also draws from it.
        raise InvalidOptionError(f"{who} needs an explicit torch.Generator")
    return generator


class Normalize(Transform):
    """``(x - mean) / std`` per channel, in [0, 1] pixel units.

    Parameters
    ----------
    mean, std : sequence of float
        One value per channel (or a single value for all), in [0, 1] units,
        e.g. :attr:`ArrayDataset.mean`.

    Notes
    -----
    A uint8 input (0..255) is first divided by 255; a floating input is taken
    to be in [0, 1] already. The output is float32 of the same shape. No
    randomness: the generator argument is accepted and ignored.
    """

    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        self.mean = torch.as_tensor(mean, dtype=torch.float32).reshape(1, -1, 1, 1)
        self.std = torch.as_tensor(std, dtype=torch.float32).reshape(1, -1, 1, 1)
        if torch.any(self.std <= 0):
            raise InvalidOptionError("std must be positive")

    def __call__(self, images: torch.Tensor,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        _check_batch(images)
        x = images.float() / 255.0 if images.dtype == torch.uint8 else images.float()
        return (x - self.mean.to(x.device)) / self.std.to(x.device)

    def __repr__(self) -> str:
        return f"Normalize(mean={self.mean.flatten().tolist()}, std={self.std.flatten().tolist()})"


class RandomCrop(Transform):
    """Zero-pad each side by ``padding`` pixels, then crop ``size`` at a random offset.

    Parameters
    ----------
    size : int or (int, int)
        Output height and width in pixels.
    padding : int, default 0
        Zeros added on all four sides first (torchvision's constant padding
        with fill 0).

    Notes
    -----
    Each image of the batch gets its own offset, drawn uniformly: top in
    ``0 .. H + 2 * padding - size_h`` and left in ``0 .. W + 2 * padding - size_w``
    (tops drawn first, then lefts, each as one ``torch.randint`` of length B).
    """

    def __init__(self, size: int | tuple[int, int], padding: int = 0) -> None:
        self.size = (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))
        self.padding = int(padding)
        if min(self.size) < 1 or self.padding < 0:
            raise InvalidOptionError(f"invalid size {size} or padding {padding}")

    def sample(self, shape: torch.Size | Sequence[int],
               generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Draw crop offsets for a batch of ``shape`` (B, C, H, W).

        Returns
        -------
        tops, lefts : torch.Tensor
            int64, shape ``(B,)``, offsets into the *padded* images.
        """
        b, _, h, w = shape
        max_top = h + 2 * self.padding - self.size[0]
        max_left = w + 2 * self.padding - self.size[1]
        if max_top < 0 or max_left < 0:
            raise InvalidOptionError(f"crop {self.size} larger than padded image "
                             f"{(h + 2 * self.padding, w + 2 * self.padding)}")
        tops = torch.randint(0, max_top + 1, (b,), generator=generator)
        lefts = torch.randint(0, max_left + 1, (b,), generator=generator)
        return tops, lefts

    def apply(self, images: torch.Tensor, tops: torch.Tensor,
              lefts: torch.Tensor) -> torch.Tensor:
        """Crop with given offsets into the padded images; same dtype as input."""
        _check_batch(images)
        p = self.padding
        padded = torch.nn.functional.pad(images, (p, p, p, p)) if p else images
        rows = tops.to(images.device)[:, None] + torch.arange(self.size[0], device=images.device)
        cols = lefts.to(images.device)[:, None] + torch.arange(self.size[1], device=images.device)
        batch = torch.arange(images.shape[0], device=images.device)[:, None, None]
        # Advanced indexing over (batch, row, col) moves channels last: (B, h, w, C).
        out = padded.permute(0, 2, 3, 1)[batch, rows[:, :, None], cols[:, None, :]]
        return out.permute(0, 3, 1, 2).contiguous()

    def __call__(self, images: torch.Tensor,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        _check_batch(images)
        tops, lefts = self.sample(images.shape, _need_generator(generator, "RandomCrop"))
        return self.apply(images, tops, lefts)

    def __repr__(self) -> str:
        return f"RandomCrop(size={self.size}, padding={self.padding})"


class RandomHorizontalFlip(Transform):
    """Mirror each image left-right with probability ``p``.

    Parameters
    ----------
    p : float, default 0.5
        Flip probability per image; one ``torch.rand`` of length B decides
        (flip where the draw is below ``p``).
    """

    def __init__(self, p: float = 0.5) -> None:
        if not 0.0 <= p <= 1.0:
            raise InvalidOptionError(f"p must be in [0, 1], not {p}")
        self.p = float(p)

    def sample(self, batch_size: int, generator: torch.Generator) -> torch.Tensor:
        """Boolean mask of shape ``(batch_size,)``: which images to flip."""
        return torch.rand(batch_size, generator=generator) < self.p

    def apply(self, images: torch.Tensor, flip: torch.Tensor) -> torch.Tensor:
        """Flip the images where ``flip`` (bool, shape ``(B,)``) is true."""
        _check_batch(images)
        mask = flip.to(images.device)[:, None, None, None]
        return torch.where(mask, images.flip(-1), images)

    def __call__(self, images: torch.Tensor,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        _check_batch(images)
        flip = self.sample(images.shape[0], _need_generator(generator, "RandomHorizontalFlip"))
        return self.apply(images, flip)

    def __repr__(self) -> str:
        return f"RandomHorizontalFlip(p={self.p})"


class Compose(Transform):
    """Apply ``transforms`` in order, passing the same generator to each.

    Parameters
    ----------
    transforms : sequence of callables
        Each ``t(images, generator) -> images``.
    """

    def __init__(self, transforms: Sequence[Transform]) -> None:
        self.transforms = list(transforms)

    def __call__(self, images: torch.Tensor,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        for t in self.transforms:
            images = t(images, generator)
        return images

    def __repr__(self) -> str:
        return f"Compose({self.transforms!r})"
