"""The built-in recipes: each model's published training settings (see :mod:`trainscale.recipes`).

Settings use trainscale's conventions: the loss is the batch mean (a recipe written for a summed loss has its
learning rate multiplied by its batch size and its weight decay divided by it), and BatchNorm momentum is PyTorch's.
A recipe sets what its source states; anything else keeps trainscale's default. Precision is the machine's choice,
not the recipe's (``--precision auto``: bf16 where the device computes it natively, fp32 elsewhere).
"""

from __future__ import annotations

from trainscale.recipes import register_recipe

AIRBENCH94_BATCH = 2000
AIRBENCH94_BIAS_LR = 0.053  # per summed-loss unit, as airbench94_muon writes it
AIRBENCH94_HEAD_LR = 0.67
AIRBENCH94_DECAY = 2e-6 * AIRBENCH94_BATCH  # lr x weight decay per step, the same in every SGD group

register_recipe(
    "cifar10-fast",
    source="Page 2018, cifar10-fast (DAWNBench; the layer-wise compression study's net): ResNet-9 to 94% in 24 epochs",
    epochs=24,
    batch_size=512,
    lr=0.4,
    momentum=0.9,
    nesterov=True,
    weight_decay=5e-4,
    schedule="onecycle",
    crop_padding=4,
    flip=True,
    cutout=8,
)  # one-cycle's default peak: 5/24 of the run

register_recipe(
    "he2016-cifar",
    source="He et al. 2016, sec. 4.2: batch 128, lr 0.1 (/10 at 32k and 48k iterations, "
    "stop at 64k), weight decay 1e-4, momentum 0.9, 4-pixel crops and flips",
    epochs=164,
    batch_size=128,
    lr=0.1,
    momentum=0.9,
    nesterov=False,  # not scaled: the paper trains at one batch
    weight_decay=1e-4,
    schedule="step",
    milestones=[83, 124],
    gamma=0.1,
    crop_padding=4,
    flip=True,
    cutout=0,
)

register_recipe(
    "goyal2017",
    source="Goyal et al. 2017: lr 0.1 per 256 images (linear scaling), 5 warm-up epochs, "
    "/10 at epochs 30, 60, 80 of 90, weight decay 1e-4",
    epochs=90,
    batch_size=256,
    lr=0.1,
    lr_scaling="linear",
    base_batch_size=256,
    momentum=0.9,
    nesterov=False,
    weight_decay=1e-4,
    schedule="step",
    milestones=[31, 61, 81],
    gamma=0.1,
    warmup_epochs=5.0,
)

register_recipe(
    "mxnet-cifar",
    source="MXNet 0.11 example/image-classification/train_cifar10.py (the MXNet multi-GPU and distributed pages): "
    "lr 0.05 "
    "per batch of 128, /10 at epochs 200 and 250 of 300, weight decay 1e-4, momentum 0.9",
    epochs=300,
    batch_size=128,
    lr=0.05,
    lr_scaling="linear",
    base_batch_size=128,
    momentum=0.9,
    nesterov=False,
    weight_decay=1e-4,
    schedule="step",
    milestones=[201, 251],
    gamma=0.1,
)

register_recipe(
    "mxnet-mnist",
    source="MXNet 0.11 example/image-classification/train_mnist.py (the MXNet distributed page's mlp): lr 0.05 per "
    "batch of 64, weight decay 1e-4, momentum 0.9",
    lr=0.05,
    lr_scaling="linear",
    base_batch_size=64,
    momentum=0.9,
    nesterov=False,
    weight_decay=1e-4,
)

register_recipe(
    "krizhevsky2012",
    source="Krizhevsky et al. 2012: lr 0.01 per batch of 128, momentum 0.9, weight decay 5e-4",
    lr=0.01,
    lr_scaling="linear",
    base_batch_size=128,
    momentum=0.9,
    nesterov=False,
    weight_decay=5e-4,
)

register_recipe(
    "keras-mxnet",
    source="the Keras-MXNet scaling profile (Inception-v3 on CIFAR-10): SGD lr 0.05 per batch "
    "of 32, momentum 0.9, weight decay 5e-4",
    lr=0.05,
    lr_scaling="linear",
    base_batch_size=32,
    momentum=0.9,
    nesterov=False,
    weight_decay=5e-4,
    schedule="constant",
)

register_recipe(
    "airbench-sgd",
    source="trainscale's SGD tuning of the airbench net (make demo before airbench94; the "
    "slow-links grid): 88% in 3 epochs on a CPU, 92.7% in 10 on an H100",
    epochs=10,
    batch_size=512,
    lr=0.4,
    momentum=0.9,
    nesterov=True,
    weight_decay=5e-4,
    schedule="onecycle",
    warmup_epochs=0.75,
    label_smoothing=0.2,
    crop_padding=2,
    flip=True,
    cutout=0,
)

AIRBENCH94 = register_recipe(
    "airbench94",
    source="Jordan 2024, airbench94_muon.py: 94.01% mean in 8 epochs (2.59 s on an A100): Muon on "
    "the filters, Nesterov SGD on the rest, batch 2000, label smoothing 0.2, alternating flips, 2-pixel "
    "translation, 6-view test-time augmentation",
    reference="airbench94_muon.py",
    model="airbench94",
    epochs=8,
    batch_size=AIRBENCH94_BATCH,
    optimizer="muon",
    muon_lr=0.24,
    muon_momentum=0.6,
    lr=AIRBENCH94_BIAS_LR * AIRBENCH94_BATCH,
    lr_scaling="linear",
    base_batch_size=AIRBENCH94_BATCH,
    head_lr_factor=AIRBENCH94_HEAD_LR / AIRBENCH94_BIAS_LR,
    momentum=0.85,
    nesterov=True,
    weight_decay=AIRBENCH94_DECAY / (AIRBENCH94_BIAS_LR * AIRBENCH94_BATCH),
    schedule="onecycle",
    warmup_epochs=0.0,
    label_smoothing=0.2,
    crop_padding=2,
    flip=True,
    alternate_flip=True,
    cutout=0,
    tta=True,
    tta_translate=1,
)

register_recipe(
    "defaults",
    source="trainscale's own defaults (the values `trainscale train --help` shows), for a model given by import "
    "path that names no recipe of its own",
)

SPEEDRUN94_BATCH = 1536

register_recipe(
    "speedrun94",
    source="trainscale's speed recipe after the published facts of the 2025 CIFAR-10 speed record: the airbench94 "
    "recipe at batch 1536 (learning rates scaled linearly, Muon's not), SiLU, test-time augmentation for the "
    "least confident 25% of each test batch only; with the whole step captured as one CUDA graph 93.94% mean over "
    "25 runs in 1.14 s on an H200, in airbench's scope (2.22 s with the eager step)",
    reference=AIRBENCH94.reference,
    **{**AIRBENCH94.settings, "model": "speedrun94", "batch_size": SPEEDRUN94_BATCH, "tta_select": 0.25},
)
