"""The model registry: every network is found by name so configs, the CLI and tests see one list.

A factory is ``fn(num_classes: int = 10, **kw) -> nn.Module`` registered with :func:`register_model`, which also
records the input size the net expects and the dataset it is usually trained on.

A model declares what it needs from the data when it registers: its input size (the data is cropped to a smaller
size or upscaled to a larger one) and, with ``data_init_images=N``, a data-based initialisation: the model defines
``data_init(images)`` and the engine calls it once before training with N normalised training images (float NCHW).
``airbench`` uses it to fit its frozen patch-whitening filters from 5,000 images.

Every model also names its default recipe (``recipe=``, see :mod:`trainscale.recipes`): the settings of its source
that fill every setting a user leaves unset. A model may list parameters that train only for the first epochs in
``model.train_until`` (name -> epochs; their learning rate falls linearly to zero by then), as airbench94 does with
its whitening bias.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from trainscale.registry import Registry

MODELS: Registry[nn.Module] = Registry("model")

ModelFactory = Callable[..., nn.Module]


@runtime_checkable
class DataInitModel(Protocol):
    """A model registered with ``data_init_images=N``: the engine calls ``data_init`` once before training."""

    def data_init(self, images: torch.Tensor) -> None: ...


@dataclass(frozen=True)
class ModelInfo:
    """What a caller needs to feed a model without building it: its input side and usual dataset."""

    name: str
    input_size: int
    description: str
    default_dataset: str
    recipe: str
    data_init_images: int = 0


def register_model(
    name: str,
    *,
    input_size: int,
    description: str,
    recipe: str,
    default_dataset: str = "cifar10",
    data_init_images: int = 0,
) -> Callable[[ModelFactory], ModelFactory]:
    """Register a factory under ``name``; the metadata lets data loaders size inputs to match the net,
    ``recipe`` names its default training settings, and ``data_init_images`` (> 0) asks for
    ``model.data_init(images)`` with that many training images."""
    return MODELS.register(
        name,
        input_size=input_size,
        description=description,
        default_dataset=default_dataset,
        recipe=recipe,
        data_init_images=data_init_images,
    )


def create_model(name: str, num_classes: int = 10, **kwargs: Any) -> nn.Module:
    """Build a model by name; an unknown name raises ConfigError with a did-you-mean hint."""
    return MODELS.create(name, num_classes=num_classes, **kwargs)


def list_models() -> list[str]:
    """All registered model names, sorted, so tests and the CLI can enumerate them."""
    return MODELS.names()


def model_info(name: str) -> ModelInfo:
    """The registered metadata of one model; unknown names raise ConfigError like create_model."""
    entry = MODELS.get(name)
    return ModelInfo(name=entry.name, **entry.meta)


def count_parameters(model: nn.Module) -> int:
    """Number of trainable scalars, the figure papers quote (frozen whitening/BN scales are excluded)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
