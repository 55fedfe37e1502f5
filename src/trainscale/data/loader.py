"""``DeviceBatches``: the on-device batch iterator every training mode uses for in-memory datasets.

The uint8 images go to the device once; each epoch draws the rank's shard (see ``sharding``), draws
every augmentation parameter of the shard at once from a generator seeded by (seed, epoch, rank) (made
before the epoch before hands out its last batch, while a GPU still runs the steps queued), then applies
them chunk by chunk on the device (chunks bound the memory of large images; the result does not depend on
the chunk size). Batches are normalised to float (optionally resized and channels-last) only when they are
yielded. Same (seed, epoch, rank) gives the same batches bit for bit, which is what makes a resumed run
identical to an uninterrupted one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from trainscale.data import augment as A
from trainscale.data.sharding import (
    batches_per_epoch,
    check_world,
    eval_range,
    seeded_generator,
    train_shard,
    train_shard_size,
)
from trainscale.data.tensors import ImageTensors
from trainscale.errors import ConfigError

Batch = tuple[torch.Tensor, torch.Tensor]

# Bytes of augmented uint8 images materialised at a time (CIFAR's 50,000 images are 154 MB: one chunk).
AUGMENT_CHUNK_BYTES = 512 * 1024 * 1024
ALTERNATE_FLIP_STREAM = 0x5F1F  # seeds the per-image coins of alternate flipping apart from the epochs' streams


@dataclass(frozen=True)
class EpochDraws:
    """One epoch's draws for a rank's shard, on the device: ``count`` samples in ``indices`` order with their
    ``labels``; crop corners (``oy``, ``ox``, windows of ``size``), flips, cutout corners, brightness and contrast
    factors, each None where that augmentation is off."""

    count: int
    size: int
    indices: torch.Tensor
    labels: torch.Tensor
    oy: torch.Tensor | None
    ox: torch.Tensor | None
    flips: torch.Tensor | None
    cy: torch.Tensor | None
    cx: torch.Tensor | None
    bright: torch.Tensor | None
    contrast: torch.Tensor | None


@runtime_checkable
class Batches(Protocol):
    """What a training loop iterates: ``epoch(e)`` yields (float NCHW inputs, int64 labels) on the device."""

    def __len__(self) -> int: ...

    @property
    def num_samples(self) -> int: ...

    def epoch(self, epoch: int) -> Iterator[Batch]: ...


@dataclass
class AugmentConfig:
    """Training-time augmentation; at evaluation only the deterministic parts apply (see DeviceBatches).

    crop_padding: pixels of reflect padding before the random crop (cifar10-fast: 4; 0 = none).
    crop_size: side of the random crop; None = the input size (32 for CIFAR), 28 for MXNet-style
        random 28x28 crops (with crop_padding=0).
    flip: random horizontal flips, p=0.5 per image.
    alternate_flip: with flip, each image is flipped in every other epoch (airbench): a coin per image, drawn once
        from the seed, decides the even epochs and the odd ones are its opposite, so every image is seen both ways
        in any two epochs in a row.
    cutout: side of the cutout square (0 = off, 8 = 8x8 as in cifar10-fast).
    brightness, contrast: strengths of a per-image brightness and contrast change (0 = off; 0.2: factors drawn
        uniformly in 0.8..1.2; see ``augment.apply_brightness_contrast``), applied after the crop, flip and cutout.
    resize: upscale to this side after augmentation (e.g. 299 for Inception-v3), None = keep.
    pad_mode: "reflect" (cifar10-fast) or "zero".
    """

    crop_padding: int = 4
    crop_size: int | None = None
    flip: bool = True
    alternate_flip: bool = False
    cutout: int = 0
    brightness: float = 0.0
    contrast: float = 0.0
    resize: int | None = None
    pad_mode: str = "reflect"

    def __post_init__(self) -> None:
        if self.crop_padding < 0:
            raise ConfigError(f"crop padding must be >= 0, got {self.crop_padding}")
        if self.crop_size is not None and self.crop_size < 1:
            raise ConfigError(f"crop size must be a positive integer, got {self.crop_size}")
        if self.cutout < 0:
            raise ConfigError(f"cutout size must be >= 0 (0 = off), got {self.cutout}")
        for name in ("brightness", "contrast"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(
                    f"{name} must be in [0, 1) (0 = off; 0.2: factors 0.8..1.2), got {getattr(self, name)}"
                )
        if self.resize is not None and self.resize < 1:
            raise ConfigError(f"resize must be a positive integer, got {self.resize}")
        if self.pad_mode not in A.PAD_MODES:
            raise ConfigError(f"unknown pad mode '{self.pad_mode}'; choose one of: {', '.join(A.PAD_MODES)}")


class DeviceBatches:
    """Batches of an in-memory ``ImageTensors`` on ``device``, sharded over ``world_size`` ranks.

    Training (``train=True``): each epoch a permutation seeded by (seed, epoch), identical on every
    rank; the last ``n % world_size`` samples of it are dropped and rank r takes ``perm[r::world_size]``
    (disjoint, equal-sized shards). Augmentation of the shard uses a generator seeded by
    (seed, epoch, rank): random crop (after padding), flip, cutout, brightness and contrast, in that order; then
    the optional resize. ``drop_last`` (default: True in training) drops the final partial batch.

    Evaluation (``train=False``): samples in order, no random augmentation, last partial batch kept
    (``drop_last`` default False); rank r takes a contiguous block, block sizes differing by at most
    one. When ``augment`` asks for a crop smaller than the images, evaluation takes the centre crop of
    that size, and ``augment.resize`` applies too, so eval inputs have the training shape.
    """

    def __init__(
        self,
        data: ImageTensors,
        batch_size: int,
        *,
        train: bool,
        augment: AugmentConfig | None,
        device: torch.device | str,
        dtype: torch.dtype = torch.float32,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        drop_last: bool | None = None,
        channels_last: bool = False,
    ) -> None:
        if batch_size < 1:
            raise ConfigError(f"batch size must be a positive integer, got {batch_size}")
        n = len(data)
        check_world(n, rank, world_size)
        self.name = data.name
        self.batch_size = batch_size
        self.train = train
        self.augment = augment
        self.device = torch.device(device)
        self.dtype = dtype
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.drop_last = train if drop_last is None else drop_last
        self.channels_last = channels_last
        self.mean, self.std = data.mean, data.std
        self.num_classes = data.num_classes
        self.total_samples = n

        if train:
            self.shard_size = train_shard_size(n, world_size)
            self._eval_start = 0
        else:
            self._eval_start, stop = eval_range(n, rank, world_size)
            self.shard_size = stop - self._eval_start
        if self.drop_last and batch_size > self.shard_size:
            raise ConfigError(
                f"batch size {batch_size} is larger than the {self.shard_size} samples rank {rank} of {world_size} "
                f"gets per epoch from {n} samples of {data.name}, so every batch would be dropped; use a batch size "
                f"of at most {self.shard_size} (per process)"
            )

        _, _, h, w = data.images.shape
        self.input_size = (int(h), int(w))
        aug = augment
        self.crop_size = aug.crop_size if aug and aug.crop_size is not None else None
        self._padding = aug.crop_padding if (train and aug) else 0
        if train and aug is not None and self.crop_size is None and h != w:
            raise ConfigError(f"random crops of non-square {h}x{w} images of {data.name} need an explicit crop size")
        if aug is not None and self.crop_size is not None and self.crop_size > min(h, w) + aug.crop_padding * 2:
            raise ConfigError(
                f"crop size {self.crop_size} is larger than the {h}x{w} images of {data.name} padded "
                f"by {aug.crop_padding}; use a crop size of at most {min(h, w) + 2 * aug.crop_padding}"
            )

        # The uint8 data go to the device once. With a padded random crop, the padded images are kept
        # instead (evaluation reads their interior), so no epoch pays for padding again.
        images = data.images.to(self.device)
        if self._padding:
            assert aug is not None  # padding only with augmentation
            images = A.pad(images, self._padding, aug.pad_mode)
        self._images = images
        self._labels = data.labels.to(self.device, dtype=torch.int64)
        self._drawn: tuple[tuple[int, int, int, int], EpochDraws] | None = None

    # ------------------------------------------------------------------------------------ sizes

    def __len__(self) -> int:
        return batches_per_epoch(self.shard_size, self.batch_size, self.drop_last)

    @property
    def num_samples(self) -> int:
        """Samples this rank is given per epoch (a dropped partial batch is not counted)."""
        return len(self) * self.batch_size if self.drop_last else self.shard_size

    @property
    def output_shape(self) -> tuple[int, int, int]:
        """(C, H, W) of the yielded batches."""
        c = int(self._images.shape[1])
        if self.augment is not None and self.augment.resize is not None:
            return c, self.augment.resize, self.augment.resize
        if self.crop_size is not None:
            return c, self.crop_size, self.crop_size
        return c, *self.input_size

    # ----------------------------------------------------------------------------------- epochs

    def epoch(self, epoch: int) -> Iterator[Batch]:
        """The batches of ``epoch`` for this rank: (normalised float NCHW on device, int64 labels on device)."""
        if self.train:
            return self._train_epoch(epoch)
        return self._eval_epoch()

    def _finish(self, x: torch.Tensor) -> torch.Tensor:
        out = A.normalize(x, self.mean, self.std, self.dtype)
        if self.augment is not None and self.augment.resize is not None:
            out = A.resize(out, self.augment.resize)
        if self.channels_last:
            out = out.contiguous(memory_format=torch.channels_last)
        return out

    def _unpadded(self) -> torch.Tensor:
        p = self._padding
        if not p:
            return self._images
        h, w = self.input_size
        return self._images[:, :, p : p + h, p : p + w]

    def _train_epoch(self, epoch: int) -> Iterator[Batch]:
        return (finish() for finish in self.lazy_epoch(epoch))

    def lazy_epoch(self, epoch: int) -> Iterator[Callable[[], Batch]]:
        """The training batches of ``epoch``, each as a function that makes it: augmentation is drawn for
        the whole shard as in ``epoch``, but a batch that is skipped is never normalised (fault-tolerant
        replicas walk the whole epoch and train on one batch in every few). The next epoch's draws
        (``draws``) are made just before the last batch is handed out: on a GPU the host makes them while the
        device still runs the steps queued before it, not after the epoch's final read of the device (the
        non-finite guard's), nor at the next epoch's start, with the device idle."""
        d = self.draws(epoch)
        aug = self.augment
        per_image = self._images[0].numel()
        chunk = max(1, AUGMENT_CHUNK_BYTES // max(1, per_image) // self.batch_size) * self.batch_size
        for start in range(0, d.count, chunk):
            stop = min(d.count, start + chunk)
            idx = d.indices[start:stop]
            if d.oy is not None and d.ox is not None:
                x = A.crop_windows(self._images, idx, d.size, d.oy[start:stop], d.ox[start:stop])
            else:
                x = self._images.index_select(0, idx)
            if d.flips is not None:
                x = A.apply_flip(x, d.flips[start:stop], inplace=True)
            if d.cy is not None and d.cx is not None:
                assert aug is not None
                x = A.apply_cutout(x, aug.cutout, d.cy[start:stop], d.cx[start:stop], inplace=True)
            for b in range(0, stop - start, self.batch_size):
                first, last = start + b, start + b + self.batch_size
                factors = (
                    None if d.bright is None or d.contrast is None else (d.bright[first:last], d.contrast[first:last])
                )
                if last >= d.count:
                    self.draws(epoch + 1)
                yield functools.partial(self._batch, x[b : b + self.batch_size], d.labels[first:last], factors)

    def draws(self, epoch: int) -> EpochDraws:
        """The sample order and every augmentation parameter of this rank's shard in ``epoch``, on the device;
        the last ones made are kept, so asking again for the same epoch (the warm-up's first batch, then the
        epoch itself) makes them once."""
        key = (epoch, self.rank, self.world_size, self.seed)
        if self._drawn is None or self._drawn[0] != key:
            self._drawn = (key, self._draw(epoch))
        return self._drawn[1]

    def _draw(self, epoch: int) -> EpochDraws:
        indices = train_shard(self.total_samples, self.rank, self.world_size, self.seed, epoch)
        count = len(self) * self.batch_size if self.drop_last else self.shard_size
        indices = indices[:count]
        gen = seeded_generator(self.seed, epoch, self.rank)
        aug = self.augment
        h, w = self.input_size
        size = self.crop_size if self.crop_size is not None else h
        crop = aug is not None and (self._padding > 0 or size != h or size != w)
        out_side = size if crop else None
        # Parameters of the whole shard, drawn in a fixed order: crop, flip, cutout, brightness and contrast.
        oy = ox = flips = cy = cx = bright = contrast = None
        if crop:
            oy, ox = A.crop_params(count, h, w, size, self._padding, gen)
        if aug is not None and aug.flip:
            flips = self._alternating_flips(indices, epoch) if aug.alternate_flip else A.flip_mask(count, gen)
        if aug is not None and aug.cutout > 0:
            cy, cx = A.cutout_params(count, out_side or h, out_side or w, gen)
        if aug is not None and (aug.brightness or aug.contrast):
            bright, contrast = A.brightness_contrast_params(count, aug.brightness, aug.contrast, gen)
        indices = self._upload(indices)
        oy, ox, flips, cy, cx, bright, contrast = (
            None if t is None else self._upload(t) for t in (oy, ox, flips, cy, cx, bright, contrast)
        )
        labels = self._labels.index_select(0, indices)
        return EpochDraws(count, size, indices, labels, oy, ox, flips, cy, cx, bright, contrast)

    def _upload(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on the device, sent from pinned memory on a GPU: a copy from pageable memory waits for every step
        queued on the stream, which would leave the GPU idle while the host draws the rest."""
        if self.device.type != "cuda":
            return t.to(self.device)
        return t.pin_memory().to(self.device, non_blocking=True)

    def _alternating_flips(self, indices: torch.Tensor, epoch: int) -> torch.Tensor:
        """The flip mask of ``indices`` in ``epoch`` under alternate flipping (see ``AugmentConfig``); the
        per-image coins come from the seed alone, so every rank and every epoch agree on them."""
        coins = A.flip_mask(self.total_samples, seeded_generator(self.seed, ALTERNATE_FLIP_STREAM))
        return coins[indices] ^ bool(epoch % 2)

    def _batch(
        self, x: torch.Tensor, labels: torch.Tensor, factors: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> Batch:
        """A training batch, normalised; ``factors``: its images' brightness and contrast factors, applied in 0..1
        before normalising."""
        if factors is not None:
            x = A.apply_brightness_contrast(x.to(torch.float32) / (255.0 if x.dtype == torch.uint8 else 1.0), *factors)
        return self._finish(x), labels

    def _eval_epoch(self) -> Iterator[Batch]:
        images = self._unpadded()
        start, stop = self._eval_start, self._eval_start + self.shard_size
        h, w = self.input_size
        center = self.crop_size is not None and (self.crop_size < h or self.crop_size < w)
        n_batches = len(self)
        for k in range(n_batches):
            b0 = start + k * self.batch_size
            b1 = min(stop, b0 + self.batch_size)
            x = images[b0:b1]
            if center:
                assert self.crop_size is not None
                x = A.center_crop(x, self.crop_size)
            yield self._finish(x), self._labels[b0:b1]
