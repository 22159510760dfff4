"""The objects a symmetry structure is made of, and the warning about its gaps.

See :mod:`posteriorzoo.symmetry.structure` for how they are found.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from posteriorzoo._api import public


@dataclass(frozen=True)
class TensorAxis:
    """One axis of one state tensor, indexed by the units of a space.

    ``block``: each unit owns ``block`` consecutive entries (a flattened C x H x W input
    read by a dense layer). ``groups``: the tensor is a grouped convolution's weight read
    on its input axis, whose entries are local to each of ``groups`` blocks. ``power``:
    how the tensor scales with the unit's scale (1 for weights, 2 for a running variance,
    -1 for readers). ``epsilon``: a BatchNorm's epsilon, for its running variance, which
    maps to ``lambda**2 * (var + eps) - eps`` so that ``sqrt(var + eps)`` scales exactly
    by lambda (for ``lambda**2 < eps / (var + eps)`` the stored value is negative, which
    BatchNorm accepts: it only uses ``var + eps``, still positive).
    """

    key: str
    axis: int
    block: int = 1
    groups: int = 1
    power: int = 1
    epsilon: float = 0.0


@dataclass
class UnitSpace:
    """Units that one permutation reorders everywhere (see the module docstring)."""

    size: int
    writers: list[TensorAxis] = field(default_factory=list)
    readers: list[TensorAxis] = field(default_factory=list)
    fixed: bool = False
    #: grouped convolutions this space feeds (in) or leaves (out): (layer, groups).
    group_constraints: list[tuple[str, str, int]] = field(default_factory=list)


@dataclass
class ScaleVariable:
    """Units whose writers may be multiplied by lambda > 0 and readers divided by it.

    ``through_batchnorm``: a normalization layer (BatchNorm, FRN: the name is historical)
    normalises the scale away, so the weight mass has no minimum along it; its readers
    are the layer's statistics (BatchNorm's running mean and variance), or none at all
    (FRN computes its statistic from its input). ``epsilon``: the largest epsilon of a
    normalization that absorbs the scale only approximately (FRN divides by
    ``sqrt(nu2 + eps)``, see :mod:`posteriorzoo.symmetry.structure`); 0 where the scale
    is compensated exactly.
    """

    space: int
    writers: list[TensorAxis] = field(default_factory=list)
    readers: list[TensorAxis] = field(default_factory=list)
    fixed: bool = False
    through_batchnorm: bool = False
    epsilon: float = 0.0


@dataclass
class SignVariable:
    """Units whose writers and readers may all be multiplied by -1 (odd activations)."""

    space: int
    writers: list[TensorAxis] = field(default_factory=list)
    readers: list[TensorAxis] = field(default_factory=list)
    fixed: bool = False


@dataclass
class SymmetryStructure:
    """Unit spaces, scale and sign variables, the softmax bias, and what was not handled.

    ``notes``: everything worth saying about the trace; ``gaps``: the subset naming
    units left untouched by an unsupported operation (see :class:`SymmetryCoverageWarning`).
    """

    spaces: list[UnitSpace]
    scales: list[ScaleVariable]
    output_bias: str | None
    notes: list[str]
    signs: list[SignVariable] = field(default_factory=list)
    gaps: list[str] = field(default_factory=list)

    def permutable(self) -> list[int]:
        """Indices of the spaces that may be permuted."""
        return [i for i, space in enumerate(self.spaces) if not space.fixed and space.size > 1]

    def fixed_group_layers(self) -> set[str]:
        """Grouped layers with a fixed space on either side: their groups may not be swapped."""
        return {layer for space in self.spaces if space.fixed
                for layer, _, _ in space.group_constraints}

    def scalable(self) -> list[int]:
        """Indices of the scale variables that may be scaled: read by a next layer, or
        normalised away (an FRN's input has no reader: the layer itself absorbs it)."""
        return [i for i, var in enumerate(self.scales)
                if not var.fixed and not self.spaces[var.space].fixed
                and (var.readers or var.through_batchnorm)]

    def flippable(self) -> list[int]:
        """Indices of the sign variables that may be flipped."""
        return [i for i, var in enumerate(self.signs)
                if not var.fixed and not self.spaces[var.space].fixed and var.readers]


class SymmetryCoverageWarning(UserWarning):
    """A canonical form leaves some symmetries in place: the tracer could not follow them.

    The message is ``"symmetries not removed: "`` followed by the gaps joined with
    ``"; "``, each ``"<node> (<operation>) is not supported, so the units of <layers> are
    neither permuted, scaled nor sign-flipped"``; :attr:`gaps` holds them as a list.
    """

    def __init__(self, gaps: list[str]) -> None:
        self.gaps = list(gaps)
        super().__init__("symmetries not removed: " + "; ".join(self.gaps))


@public
def warn_coverage(structure: SymmetryStructure, stacklevel: int = 2) -> None:
    """Warn (:class:`SymmetryCoverageWarning`) if ``structure`` has gaps; else do nothing.

    ``stacklevel`` counts as in :func:`warnings.warn`, from the caller of this function.
    """
    if structure.gaps:
        warnings.warn(SymmetryCoverageWarning(structure.gaps), stacklevel=stacklevel + 1)
