"""The data a worker trains on: loaded once per process, augmented as the recipe says."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from posteriorzoo.data import (
    ArrayDataset,
    Compose,
    Normalize,
    RandomCrop,
    RandomHorizontalFlip,
    load_dataset,
)
from posteriorzoo.data.transforms import Transform
from train_zoo.recipes import Recipe


@dataclass(frozen=True)
class TrainingData:
    """Train and test splits of one dataset (uint8 images, int64 labels)."""

    train: ArrayDataset
    test: ArrayDataset


@lru_cache(maxsize=4)
def load_training_data(dataset: str, data_dir: str | None = None) -> TrainingData:
    """Both splits of ``dataset``, cached per process (workers load them once)."""
    return TrainingData(load_dataset(dataset, "train", data_dir=data_dir),
                        load_dataset(dataset, "test", data_dir=data_dir))


def check_channels(architecture: str, model_options: Mapping[str, Any],
                   data: TrainingData) -> None:
    """Refuse, in one line, a model whose input channels are not the data set's (a
    ResNet of 3 channels on Fashion-MNIST's 1): before any training, not as a
    convolution's traceback in every worker. Models whose input is not an image (an MLP)
    are not checked here."""
    from posteriorzoo.errors import InvalidOptionError
    from posteriorzoo.models import input_shape, model_entry

    shape = input_shape(architecture, **model_options)
    channels = data.train.image_shape[0]
    if len(shape) == 3 and shape[0] != channels:
        fix = (f"set model_options in_channels = {channels}"
               if "in_channels" in model_entry(architecture).options else "choose another model")
        raise InvalidOptionError(
            f"{architecture} takes {shape[0]}-channel images, but {data.train.name} has "
            f"{channels} channel{'s' if channels != 1 else ''}: {fix}")


def train_transform(recipe: Recipe, dataset: ArrayDataset) -> Compose:
    """Random crop (if ``crop_padding``), horizontal flip (if asked), then normalisation."""
    _, height, width = dataset.image_shape
    steps: list[Transform] = []
    if recipe.crop_padding:
        steps.append(RandomCrop((height, width), padding=recipe.crop_padding))
    if recipe.horizontal_flip:
        steps.append(RandomHorizontalFlip())
    steps.append(Normalize(dataset.mean, dataset.std))
    return Compose(steps)


def eval_transform(dataset: ArrayDataset) -> Normalize:
    """Normalisation only (evaluation sees unaugmented images)."""
    return Normalize(dataset.mean, dataset.std)
