"""Canonicalizing a whole collection into a new one."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from posteriorzoo.errors import ChecksumError
from posteriorzoo.models import build, input_shape
from posteriorzoo.symmetry.canonical import canonicalize_state
from posteriorzoo.symmetry.structure import trace_structure
from posteriorzoo.zoo import Zoo, create_zoo, open_zoo

#: Largest relative change of the logits that ``verify`` accepts. BatchNorm's epsilon
#: makes rescaling its inputs exact only to about eps / running_var.
VERIFY_TOLERANCE = 1e-3


@dataclass
class CanonicalizeSummary:
    """What :func:`canonicalize_collection` did."""

    path: Path
    checkpoints: int
    dead_units: int
    verified: list[int]
    largest_change: float


def _model(zoo: Zoo) -> tuple[torch.nn.Module, tuple[int, ...]]:
    model = build(zoo.architecture, num_classes=zoo.num_classes, **zoo.model_options)
    return model.double().eval(), input_shape(zoo.architecture, **zoo.model_options)


def logit_change(model: torch.nn.Module, shape: tuple[int, ...], before: dict,
                 after: dict, seed: int) -> float:
    """Largest change of the centred logits (softmax-shift free) on random float64 inputs,
    relative to the largest logit."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(16, *shape, dtype=torch.float64, generator=generator)
    outputs = []
    with torch.no_grad():
        for state in (before, after):
            model.load_state_dict({k: v.double() if v.is_floating_point() else v
                                   for k, v in state.items()})
            logits = model(inputs)
            outputs.append(logits - logits.mean(dim=1, keepdim=True))
    return float((outputs[0] - outputs[1]).abs().max() / outputs[0].abs().max())


def canonicalize_collection(source: str | os.PathLike, target: str | os.PathLike, *,
                            permutation: str = "first", scaling: str = "norm",
                            softmax: bool = True, verify: int = 0, seed: int = 0,
                            progress: bool = False, command: str | None = None
                            ) -> CanonicalizeSummary:
    """Write the canonical form of every checkpoint of ``source`` to a new collection.

    The target keeps each checkpoint's metadata row and records in its ``annotations``
    attribute exactly what was removed and how. With ``verify = N``, N checkpoints drawn
    with ``seed`` are checked to compute the same function before and after (random
    float64 inputs; :class:`ChecksumError` if the logits move by more than
    :data:`VERIFY_TOLERANCE` relative). Computation is in float64; results are stored in
    the source's dtypes.
    """
    from tqdm.auto import tqdm

    source, target = Path(source), Path(target)
    with open_zoo(source) as zoo:
        model, shape = _model(zoo)
        structure = trace_structure(model, shape)
        annotations = {"canonicalized_from": source.name, "permutation": permutation,
                       "scaling": scaling, "softmax": softmax,
                       "softmax_rule": "output biases sum to zero" if softmax else None,
                       "permuted_spaces": len(structure.permutable()),
                       "scaled_variables": len(structure.scalable()),
                       "not_removed": structure.notes}
        count = len(zoo)
        checked = sorted(np.random.default_rng(seed).choice(count, min(verify, count),
                                                            replace=False).tolist())
        dead, largest = 0, 0.0
        out = create_zoo(target, architecture=zoo.architecture, dataset=zoo.dataset,
                         method=zoo.method, num_classes=zoo.num_classes,
                         model_options=zoo.model_options, template=zoo.spec,
                         recipe=zoo.recipe, annotations=annotations, command=command)
        with out, tqdm(total=count, desc="canonicalize", unit="ckpt",
                       disable=not progress) as bar:
            for index in range(count):
                original = zoo.state_dict(index)
                state = {k: v.double() if v.is_floating_point() else v
                         for k, v in original.items()}
                canonical, report = canonicalize_state(state, structure, permutation,
                                                       scaling, softmax)
                dead += len(report.dead_units)
                stored = {k: canonical[k].to(original[k].dtype) for k in original}
                if index in checked:
                    change = logit_change(model, shape, original, stored, seed + index)
                    largest = max(largest, change)
                    if not change < VERIFY_TOLERANCE:
                        raise ChecksumError(
                            f"checkpoint {index}: the canonical network's logits differ by "
                            f"{change:.3g} (relative); nothing more was written")
                row = zoo.metadata_dict(index)
                for automatic in ("sha256", "written_at"):
                    row.pop(automatic)
                row["source"] = f"canonical {source.name}[{index}]"[-256:]
                out.append(stored, **row)
                bar.update(1)
    return CanonicalizeSummary(target, count, dead, checked, largest)
