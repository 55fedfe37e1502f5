"""Image-classification networks, found by name: ``create_model("resnet9")``.

Importing this package registers every model family (one module each); building happens only on ``create_model``.
A model may define ``data_init(images)``; the trainer calls it once before training with a normalised batch of
training images (see :mod:`trainscale.models.registry`).
"""

from trainscale.models import (  # noqa: F401  (imported for their registrations)
    airbench,
    alexnet,
    inception_bn,
    inception_v3,
    mlp,
    recipes,
    resnet9,
    resnet50,
    resnet_cifar,
    resnet_mxnet,
)
from trainscale.models.registry import (
    MODELS,
    ModelInfo,
    count_parameters,
    create_model,
    is_builtin_model,
    list_models,
    model_info,
    register_model,
)

__all__ = [
    "MODELS",
    "ModelInfo",
    "count_parameters",
    "create_model",
    "is_builtin_model",
    "list_models",
    "model_info",
    "register_model",
]
