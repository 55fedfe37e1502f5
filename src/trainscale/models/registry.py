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

A model may also be any callable given by import path, ``--model my_pkg.nets:build`` (see ``trainscale.registry``),
called with the ``--model-arg`` values as keywords. Such a factory declares nothing: its input size is the data's
(or ``--image-size``), its recipe ``defaults`` (trainscale's own settings), unless the user's module registers it
with ``register_model`` (then its metadata is used). ``num_classes`` (the data's number of classes) is passed only
when the factory takes a parameter of that name (or ``**kwargs``), ``image_size`` only when it names that
parameter; a ``--model-arg`` of either name wins over the data's.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from trainscale.errors import ConfigError
from trainscale.registry import Registry, is_import_path

# What a model given by import path declares: nothing (input size from the data, trainscale's defaults).
IMPORTED_MODEL = {
    "input_size": None,
    "description": "",
    "default_dataset": "",
    "recipe": "defaults",
    "data_init_images": 0,
}
MODELS: Registry[nn.Module] = Registry("model", importable=IMPORTED_MODEL)

ModelFactory = Callable[..., nn.Module]


@runtime_checkable
class DataInitModel(Protocol):
    """A model registered with ``data_init_images=N``: the engine calls ``data_init`` once before training."""

    def data_init(self, images: torch.Tensor) -> None: ...


@dataclass(frozen=True)
class ModelInfo:
    """What a caller needs to feed a model without building it: its input side and usual dataset."""

    name: str
    input_size: int | None  # None: the data's (a model given by import path)
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


def is_builtin_model(name: str) -> bool:
    """Whether ``name`` is one of trainscale's own models (not one by import path, registered by a user's package,
    or an instance given to ``trainscale.fit``): their forward passes are known to compile."""
    if is_import_path(name) or name not in MODELS:
        return False
    return MODELS.get(name).factory.__module__.startswith("trainscale.models.")


def create_model(name: str, num_classes: int = 10, image_size: int | None = None, **kwargs: Any) -> nn.Module:
    """Build a model by name or import path, with ``kwargs`` (``--model-arg``); an unknown name raises ConfigError
    with a did-you-mean hint. ``num_classes`` and ``image_size`` go to the factory only where it takes them
    (see the module docstring); ``kwargs`` it does not take, a factory that raises TypeError or ValueError, or a
    result that is no ``nn.Module``, are a ConfigError naming the model."""
    entry = MODELS.get(name)
    params = _parameters(entry.factory)
    keywords = params is None
    given: dict[str, Any] = {}
    if keywords or "num_classes" in (params or ()):
        given["num_classes"] = num_classes
    if image_size is not None and "image_size" in (params or ()):
        given["image_size"] = image_size
    unknown = sorted(k for k in kwargs if not keywords and k not in (params or ()))
    if unknown:
        takes = ", ".join(p for p in params or () if p not in ("num_classes", "image_size")) or "none"
        raise ConfigError(
            f"--model-arg {unknown[0]}: model {name} takes no argument '{unknown[0]}' (its arguments: {takes})"
        )
    try:
        model = entry.factory(**given, **kwargs)
    except (TypeError, ValueError) as exc:
        if not is_import_path(name):
            raise
        reason = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
        raise ConfigError(f"model {name}{_args_text(kwargs)} failed: {type(exc).__name__}: {reason}") from None
    except SystemExit as exc:  # a user's script-style code: its status alone would end the run with no word
        raise ConfigError(
            f"model {name}{_args_text(kwargs)} called sys.exit({exc.code!r}) while building the network; return the "
            "network instead"
        ) from None
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"model {name} returned {type(model).__name__}, not a torch.nn.Module; return the network from it"
        )
    return model


def _parameters(factory: Callable[..., Any]) -> tuple[str, ...] | None:
    """The keyword parameters of ``factory``, None when it takes ``**kwargs`` (any name)."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin without a signature: give it everything
        return None
    kinds = signature.parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in kinds):
        return None
    return tuple(p.name for p in kinds if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def _args_text(kwargs: dict[str, Any]) -> str:
    return f" ({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})" if kwargs else ""


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
