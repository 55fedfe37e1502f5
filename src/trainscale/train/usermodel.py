"""What the engine needs to build any model, a built-in or one given by import path, from the config and the data.

A model's input size is, first, ``--image-size``; else the size the model registered; else (a model given by
import path) the data's own. Its number of classes is the data's. ``check_model_on_data`` builds the model on the
meta device (no memory, no compute) and runs two images of the data's shape through it, so a model that cannot
take the data, or whose output has fewer classes than the labels, is one line before any worker starts or any
step is taken. Data given as a Dataset keeps its own image size (its transform decides it) and, read by a
DataLoader rather than held in memory, is not for the parameter-server modes (their workers take over each
other's in-memory shards).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from trainscale.config import CoreConfig
from trainscale.data.tensors import ImageTensors
from trainscale.data.user import DatasetSplit, UserSplit
from trainscale.errors import ConfigError, TrainscaleError
from trainscale.models import create_model, model_info
from trainscale.registry import is_import_path, parse_args


def model_kwargs(cfg: CoreConfig) -> dict[str, Any]:
    """The ``--model-arg`` values, typed."""
    return parse_args(cfg.data.model_args)


def input_side(cfg: CoreConfig, data: UserSplit) -> int:
    """The side of the images the model is fed: ``--image-size``, the model's registered size, else the data's."""
    native = data.image_shape[-1]
    if isinstance(data, DatasetSplit):
        if cfg.data.image_size not in (None, native):
            raise ConfigError(
                f"--image-size {cfg.data.image_size}: the items of dataset {cfg.data.dataset} are {native} pixels "
                "wide and its transform sets their size; leave --image-size out or resize in the transform"
            )
        return native
    given = model_kwargs(cfg).get("image_size")
    side = cfg.data.image_size or (given if isinstance(given, int) else None)
    return side or model_info(cfg.data.model).input_size or native


def build(cfg: CoreConfig, num_classes: int, image_size: int | None = None) -> torch.nn.Module:
    """``create_model`` with the config's model, its arguments, and the data's class count and input size (a
    ``--model-arg num_classes=`` or ``image_size=`` wins over them)."""
    kwargs = model_kwargs(cfg)
    num_classes = kwargs.pop("num_classes", num_classes)
    image_size = kwargs.pop("image_size", image_size)
    return create_model(cfg.data.model, num_classes=num_classes, image_size=image_size, **kwargs)


def user_code(cfg: CoreConfig) -> bool:
    """Whether the model or the data is the user's, given by import path."""
    return is_import_path(cfg.data.model) or is_import_path(cfg.data.dataset)


def check_model_on_data(cfg: CoreConfig, train: UserSplit, uses_servers: bool = False) -> None:
    """The model (built on the meta device, with its ``--model-arg``) takes two of the data's images at the input size
    and returns one score per class (checked for a model or data given by import path, or any model given
    arguments); Dataset-given data is refused in the parameter-server modes (``uses_servers``)."""
    if uses_servers and isinstance(train, DatasetSplit):
        raise ConfigError(
            f"--mode {cfg.run.mode} needs in-memory data: return (images, labels) tensors from dataset "
            f"{cfg.data.dataset} rather than Datasets, or use --mode sync"
        )
    if not user_code(cfg) and not cfg.data.model_args:
        return
    side = input_side(cfg, train)
    check_model_takes(
        cfg.data.model,
        lambda: build(cfg, train.num_classes, side),
        (2, train.image_shape[0], side, side),
        train.num_classes,
        cfg.data.dataset,
        "change the model or --image-size",
    )


def check_model_takes(
    name: str, make: Callable[[], torch.nn.Module], shape: tuple[int, ...], classes: int, data: str, fix: str
) -> None:
    """The model ``make`` builds (on the meta device: shapes only, no memory or compute) has parameters to train,
    takes a batch of ``shape`` from ``data`` (``fix``: what to change when it cannot) and returns at least
    ``classes`` scores per image: each problem is one ConfigError, before any data is loaded or worker started,
    not a traceback in the first step."""
    images = f"the {'x'.join(map(str, shape[1:]))} images of {data}"
    try:
        with torch.device("meta"), torch.no_grad():
            model = make()  # its own errors are their own lines
            if not any(p.requires_grad for p in model.parameters()):
                raise ConfigError(
                    f"model {name} has no trainable parameters, so there is nothing to train; return a "
                    "module with parameters that require gradients"
                )
            out = model(torch.empty(shape))
    except NotImplementedError:  # an operation without a meta kernel: the first step will tell
        return
    except TrainscaleError:
        raise
    except (RuntimeError, ValueError, TypeError, IndexError) as exc:
        reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"model {name} cannot take {images} ({type(exc).__name__}: {reason}); {fix}") from None
    if not isinstance(out, torch.Tensor) or out.dim() != 2 or out.shape[0] != shape[0]:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ConfigError(
            f"model {name} must return one row of class scores per image (batch x classes); for "
            f"{shape[0]} images it returned {got}"
        )
    if out.shape[1] < classes:
        raise ConfigError(
            f"model {name} returns {out.shape[1]} class scores but {data} has {classes} classes; size its last "
            "layer by num_classes (a parameter of that name is passed the data's count)"
        )


def data_init_images(data: UserSplit, count: int, device: torch.device) -> torch.Tensor:
    """The first ``count`` training images, normalised float N x C x H x W on ``device`` (``data_init``)."""
    if isinstance(data, ImageTensors):
        images = data.images[:count].to(device)
        mean, std = data.mean, data.std
    else:
        images = data.first_images(count).to(device)
        if data.mean is None or data.std is None:
            return images.float() / 255 if images.dtype == torch.uint8 else images.float()
        mean, std = data.mean, data.std
    unit = 255.0 if images.dtype == torch.uint8 else 1.0
    m = torch.tensor(mean, device=device).view(1, -1, 1, 1)
    s = torch.tensor(std, device=device).view(1, -1, 1, 1)
    return (images.float() / unit - m) / s
