"""Model registry and architectures.

>>> from posteriorzoo.models import build, parameter_count
>>> parameter_count("optunet")
392
>>> model = build("resnet18", num_classes=10, width=8)  # a small test network

Registered names: ``optunet``, ``optunet-v1``, ``resnet18``, ``resnet18-tiny``,
``resnet20-frn-silu`` (FRN and SiLU, the BDL competition's HMC reference), ``mlp``,
``small-cnn`` (the BYOV study's encoder), and for parameter-overhead figures
(:mod:`posteriorzoo.overhead`) ``resnet18-imagenet``, ``resnet50``, ``wrn28-10`` and
``mlp-bn`` (see :func:`available_models` and
:func:`model_entry`). Models of your own are registered by plugin modules: entry points of
the group ``posteriorzoo.models``, ``POSTERIORZOO_MODELS``, the command line's ``--models``
or :func:`load_models` (see :mod:`posteriorzoo.models.plugins`).
"""

from posteriorzoo.models.mlp import MLP
from posteriorzoo.models.mlp_bn import BatchNormMLP
from posteriorzoo.models.optunet import OptuNet, OptuNetV1
from posteriorzoo.models.plugins import ModelPluginError, load_models
from posteriorzoo.models.registry import (
    ModelEntry,
    available_models,
    build,
    input_shape,
    model_entry,
    register,
)
from posteriorzoo.models.resnet import BasicBlock, ImageNetResNet, ResNet18
from posteriorzoo.models.resnet20_frn import FilterResponseNorm2d, ResNet20FRN
from posteriorzoo.models.schema import check_state_dict, expected_state_shapes, parameter_count
from posteriorzoo.models.small_cnn import SmallCNN
from posteriorzoo.models.wide_resnet import WideResNet

__all__ = [
    "MLP",
    "BasicBlock",
    "BatchNormMLP",
    "FilterResponseNorm2d",
    "ImageNetResNet",
    "ModelEntry",
    "ModelPluginError",
    "OptuNet",
    "OptuNetV1",
    "ResNet18",
    "ResNet20FRN",
    "SmallCNN",
    "WideResNet",
    "available_models",
    "build",
    "check_state_dict",
    "expected_state_shapes",
    "input_shape",
    "load_models",
    "model_entry",
    "parameter_count",
    "register",
]
