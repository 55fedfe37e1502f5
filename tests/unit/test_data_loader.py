"""trainscale.data.loader (DeviceBatches) and imagefolder.FolderBatches: sharding, determinism,
evaluation coverage, augmentation wiring and configuration errors."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

import trainscale.data.loader as loader_mod
from trainscale.data import (
    AugmentConfig,
    Batches,
    DeviceBatches,
    FolderBatches,
    ImageTensors,
    cutout,
    normalize,
    random_crop,
    random_flip,
)
from trainscale.data.augment import apply_brightness_contrast, brightness_contrast_params
from trainscale.data.loader import EpochDraws
from trainscale.data.sharding import eval_range, seeded_generator, train_shard
from trainscale.errors import ConfigError


def tagged(n: int = 103, size: int = 8) -> ImageTensors:
    """Images whose label is their index, so every yielded sample can be traced back."""
    images = torch.randint(0, 256, (n, 3, size, size), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    return ImageTensors(
        images=images, labels=torch.arange(n), num_classes=n, mean=(0.5,) * 3, std=(0.25,) * 3, name="tagged"
    )


def collect(batches: DeviceBatches | FolderBatches, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*batches.epoch(epoch))
    return torch.cat(xs), torch.cat(ys)


def test_train_shards_are_disjoint_and_equal() -> None:
    data = tagged(103)
    seen = []
    for rank in range(2):
        b = DeviceBatches(data, 10, train=True, augment=None, device="cpu", rank=rank, world_size=2, seed=4)
        assert len(b) == 5 and b.num_samples == 50 and b.shard_size == 51
        _, y = collect(b, 0)
        assert len(y) == 50
        seen.append(set(y.tolist()))
    assert not seen[0] & seen[1]
    # Without drop_last every rank gets its full shard: world_size * shard samples, none twice.
    full = []
    for rank in range(2):
        b = DeviceBatches(
            data, 10, train=True, augment=None, device="cpu", rank=rank, world_size=2, seed=4, drop_last=False
        )
        assert len(b) == 6 and b.num_samples == 51
        full.extend(collect(b, 0)[1].tolist())
    assert len(full) == len(set(full)) == 2 * (103 // 2)


def test_shard_matches_the_documented_rule() -> None:
    perm = torch.randperm(103, generator=seeded_generator(4, 2))
    assert torch.equal(train_shard(103, 1, 2, 4, 2), perm[:102][1::2])
    assert [eval_range(10, r, 3) for r in range(3)] == [(0, 4), (4, 7), (7, 10)]


def test_same_seed_and_epoch_give_identical_batches() -> None:
    data = tagged()
    aug = AugmentConfig(crop_padding=2, cutout=3)
    a = DeviceBatches(data, 16, train=True, augment=aug, device="cpu", seed=7)
    b = DeviceBatches(data, 16, train=True, augment=aug, device="cpu", seed=7)
    xa, ya = collect(a, 3)
    xb, yb = collect(b, 3)
    assert torch.equal(xa, xb) and torch.equal(ya, yb)
    x4, y4 = collect(a, 4)
    assert not torch.equal(ya, y4)  # another epoch, another order
    _, y_other_seed = collect(DeviceBatches(data, 16, train=True, augment=aug, device="cpu", seed=8), 3)
    assert not torch.equal(ya, y_other_seed)


def test_the_next_epochs_draws_are_made_as_an_epoch_ends_and_change_no_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before an epoch hands out its last batch its successor's draws are made (on a GPU, while the device still
    runs the steps queued, before the epoch's final read of it), and used when that epoch comes: the batches equal a
    fresh loader's; an epoch skipped to, or the shard of another rank taken through a shallow copy (a parameter
    server's hand-over), gets its own."""
    data = tagged()
    aug = AugmentConfig(crop_padding=2, flip=True, alternate_flip=True, cutout=3, brightness=0.2, contrast=0.2)
    made: list[tuple[int, int]] = []
    draw = DeviceBatches._draw

    def counted(self: DeviceBatches, epoch: int) -> EpochDraws:
        made.append((epoch, self.rank))
        return draw(self, epoch)

    def fresh(epoch: int, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        return collect(DeviceBatches(data, 16, train=True, augment=aug, device="cpu", rank=rank, world_size=2), epoch)

    expected = {(e, r): fresh(e, r) for e in (0, 1, 5, 6) for r in (0, 1)}
    monkeypatch.setattr(DeviceBatches, "_draw", counted)
    b = DeviceBatches(data, 16, train=True, augment=aug, device="cpu", world_size=2)
    for epoch in (0, 1, 5):
        x, y = collect(b, epoch)
        assert torch.equal(x, expected[epoch, 0][0]) and torch.equal(y, expected[epoch, 0][1])
    assert made == [(0, 0), (1, 0), (2, 0), (5, 0), (6, 0)]
    taken = []
    for i, _ in enumerate(b.epoch(6)):
        taken.append((i, made[-1]))
    assert taken[-2:] == [(len(b) - 2, (6, 0)), (len(b) - 1, (7, 0))]
    other = copy.copy(b)
    other.rank = 1
    x, y = collect(other, 6)
    assert torch.equal(x, expected[6, 1][0]) and torch.equal(y, expected[6, 1][1])
    assert made[6:] == [(6, 1), (7, 1)]
    assert torch.equal(collect(other, 5)[1], expected[5, 1][1])


def test_augmentation_matches_the_batch_functions(monkeypatch: pytest.MonkeyPatch) -> None:
    """Epoch e of rank r = shard of (seed, e), then crop, flip, cutout from a (seed, e, r) generator."""
    data = tagged(64, 12)
    aug = AugmentConfig(crop_padding=2, crop_size=10, flip=True, cutout=4)
    b = DeviceBatches(data, 8, train=True, augment=aug, device="cpu", rank=1, world_size=2, seed=3)
    x, y = collect(b, 5)
    idx = train_shard(64, 1, 2, 3, 5)
    g = seeded_generator(3, 5, 1)
    expected = random_crop(data.images[idx], 10, 2, gen=g)
    expected = cutout(random_flip(expected, g), 4, gen=g)
    assert torch.equal(y, idx)
    assert torch.equal(x, normalize(expected, data.mean, data.std))
    # Chunked augmentation (bounded memory) gives the same batches.
    monkeypatch.setattr(loader_mod, "AUGMENT_CHUNK_BYTES", 1)
    x_chunked, _ = collect(
        DeviceBatches(data, 8, train=True, augment=aug, device="cpu", rank=1, world_size=2, seed=3), 5
    )
    assert torch.equal(x_chunked, x)


def test_eval_covers_every_sample_once_in_order() -> None:
    data = tagged(103)
    labels, sizes = [], []
    for rank in range(3):
        b = DeviceBatches(data, 16, train=False, augment=AugmentConfig(cutout=8), device="cpu", rank=rank, world_size=3)
        x, y = collect(b, 0)
        assert len(y) == b.num_samples == b.shard_size and len(b) == -(-b.shard_size // 16)
        assert torch.equal(x, normalize(data.images[y], data.mean, data.std))  # no augmentation at eval
        labels.extend(y.tolist())
        sizes.append(len(y))
    assert labels == list(range(103)) and sizes == [35, 34, 34]
    assert torch.equal(collect(b, 0)[1], collect(b, 9)[1])  # eval ignores the epoch


def test_mxnet_style_crops_and_resize() -> None:
    data = tagged(20, 32)
    mx = AugmentConfig(crop_padding=0, crop_size=28)
    x, _ = collect(DeviceBatches(data, 5, train=True, augment=mx, device="cpu"), 0)
    assert x.shape == (20, 3, 28, 28)
    x, y = collect(DeviceBatches(data, 5, train=False, augment=mx, device="cpu"), 0)
    assert x.shape == (20, 3, 28, 28)
    assert torch.equal(x, normalize(data.images[:, :, 2:30, 2:30], data.mean, data.std))  # centre crop
    up = AugmentConfig(resize=299)
    for train in (True, False):
        b = DeviceBatches(data, 4, train=train, augment=up, device="cpu", dtype=torch.bfloat16, channels_last=True)
        x, _ = next(iter(b.epoch(0)))
        assert x.shape == (4, 3, 299, 299) and x.dtype == torch.bfloat16 and b.output_shape == (3, 299, 299)
        assert x.is_contiguous(memory_format=torch.channels_last)


def test_configuration_errors() -> None:
    data = tagged(10)
    with pytest.raises(ConfigError, match="world size 11 is larger than the 10 samples"):
        DeviceBatches(data, 1, train=True, augment=None, device="cpu", world_size=11)
    with pytest.raises(ConfigError, match="rank must be in 0..1"):
        DeviceBatches(data, 1, train=True, augment=None, device="cpu", rank=2, world_size=2)
    with pytest.raises(ConfigError, match="batch size 6 is larger than the 5 samples"):
        DeviceBatches(data, 6, train=True, augment=None, device="cpu", world_size=2)
    with pytest.raises(ConfigError, match="batch size must be a positive integer"):
        DeviceBatches(data, 0, train=True, augment=None, device="cpu")
    with pytest.raises(ConfigError, match="crop size 20"):
        DeviceBatches(data, 2, train=True, augment=AugmentConfig(crop_size=20), device="cpu")
    with pytest.raises(ConfigError, match="cutout"):
        AugmentConfig(cutout=-1)
    # Evaluation keeps partial batches, so a large batch is fine there.
    assert len(DeviceBatches(data, 64, train=False, augment=None, device="cpu")) == 1


def test_protocol() -> None:
    b = DeviceBatches(tagged(10), 2, train=True, augment=None, device="cpu")
    assert isinstance(b, Batches)


# ------------------------------------------------------------------------------------- FolderBatches


def make_folder(root: Path, per_class: int = 3) -> None:
    from PIL import Image

    for split in ("train", "val"):
        for c, cls in enumerate(("b_dogs", "a_cats")):
            (root / split / cls).mkdir(parents=True)
            for i in range(per_class):
                Image.new("RGB", (48 + 8 * i, 40), (40 * i, 100 + c * 50, 30)).save(
                    root / split / cls / f"{i}.{'png' if i % 2 else 'jpeg'}"
                )


def test_folder_batches_shapes_and_sharding(tmp_path: Path) -> None:
    make_folder(tmp_path)
    train = FolderBatches(tmp_path, "train", 224, 2, seed=1)
    assert isinstance(train, Batches) and train.classes == ["a_cats", "b_dogs"]
    assert len(train) == 3 and train.num_samples == 6
    x, y = collect(train, 0)
    assert x.shape == (6, 3, 224, 224) and x.dtype == torch.float32 and y.dtype == torch.int64
    x2, y2 = collect(FolderBatches(tmp_path, "train", 224, 2, seed=1), 0)
    assert torch.equal(x, x2) and torch.equal(y, y2)  # deterministic per (seed, epoch)
    shards = [set(FolderBatches(tmp_path, "train", 64, 1, rank=r, world_size=2).indices(0)) for r in range(2)]
    assert not shards[0] & shards[1] and len(shards[0] | shards[1]) == 6
    val = FolderBatches(tmp_path, "val", 299, 4, num_workers=1, channels_last=True)
    xv, yv = collect(val, 0)
    assert xv.shape == (6, 3, 299, 299) and yv.tolist() == [0, 0, 0, 1, 1, 1] and len(val) == 2
    with pytest.raises(ConfigError, match="batch size 7"):
        FolderBatches(tmp_path, "train", 64, 7)


def test_brightness_and_contrast_follow_the_crop_flip_and_cutout_draws(monkeypatch: pytest.MonkeyPatch) -> None:
    """Drawn after the other augmentations from the same generator (so turning them on changes none of the other
    draws), applied in 0..1 before normalising, the same whatever the chunk size; evaluation never gets them."""
    data = tagged(64, 12)
    plain = AugmentConfig(crop_padding=2, flip=True, cutout=4)
    aug = AugmentConfig(crop_padding=2, flip=True, cutout=4, brightness=0.3, contrast=0.2)
    x_plain, y_plain = collect(DeviceBatches(data, 8, train=True, augment=plain, device="cpu", seed=3), 5)
    x, y = collect(DeviceBatches(data, 8, train=True, augment=aug, device="cpu", seed=3), 5)
    assert torch.equal(y, y_plain)
    g = seeded_generator(3, 5, 0)
    idx = train_shard(64, 0, 1, 3, 5)
    cropped = cutout(random_flip(random_crop(data.images[idx], 12, 2, gen=g), g), 4, gen=g)
    bright, contrast = brightness_contrast_params(64, 0.3, 0.2, g)
    assert bright.min() >= 0.7 and bright.max() <= 1.3 and contrast.min() >= 0.8 and contrast.max() <= 1.2
    changed = apply_brightness_contrast(cropped.float() / 255, bright, contrast)
    assert torch.equal(x, normalize(changed, data.mean, data.std))
    assert torch.equal(x_plain, normalize(cropped, data.mean, data.std))
    monkeypatch.setattr(loader_mod, "AUGMENT_CHUNK_BYTES", 1)
    x_chunked, _ = collect(DeviceBatches(data, 8, train=True, augment=aug, device="cpu", seed=3), 5)
    assert torch.equal(x_chunked, x)
    test = DeviceBatches(data, 8, train=False, augment=aug, device="cpu", seed=3)
    assert torch.equal(collect(test, 0)[0], normalize(data.images, data.mean, data.std))


@pytest.mark.parametrize("name", ["brightness", "contrast"])
@pytest.mark.parametrize("value", [-0.1, 1.0])
def test_a_brightness_or_contrast_outside_0_to_1_is_refused(name: str, value: float) -> None:
    with pytest.raises(ConfigError, match=f"{name} must be in"):
        AugmentConfig(**{name: value})
