"""Which samples each rank sees in an epoch, and the seeds that make it reproducible.

Training: one permutation of all samples per epoch, drawn from a generator seeded by (seed, epoch)
so it is identical on every rank; the remainder ``n % world_size`` is dropped and rank ``r`` takes
the strided shard ``perm[r::world_size]`` of the rest, so the shards are disjoint and equal-sized.
Evaluation: no shuffling; rank ``r`` takes a contiguous block, block sizes differing by at most one,
and together the blocks cover every sample exactly once.
"""

from __future__ import annotations

import torch

from trainscale.errors import ConfigError

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def mix_seed(*values: int) -> int:
    """Combine integers into one well-spread 63-bit seed (stable across processes and platforms)."""
    h = 0x2545F4914F6CDD1D
    for v in values:
        h = _splitmix64(h ^ (int(v) & _MASK64))
    return h & ((1 << 63) - 1)


def seeded_generator(*values: int) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded from ``values`` (e.g. (seed, epoch) or (seed, epoch, rank))."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(mix_seed(*values))
    return gen


def check_world(num_samples: int, rank: int, world_size: int) -> None:
    if world_size < 1:
        raise ConfigError(f"world size must be at least 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank must be in 0..{world_size - 1} for world size {world_size}, got {rank}")
    if world_size > num_samples:
        raise ConfigError(
            f"world size {world_size} is larger than the {num_samples} samples, so some ranks would get no data; "
            f"use at most {num_samples} processes or more data"
        )


def train_shard_size(num_samples: int, world_size: int) -> int:
    return num_samples // world_size


def batches_per_epoch(shard_size: int, batch_size: int, drop_last: bool) -> int:
    """Batches a rank yields per epoch from its ``shard_size`` samples; ``drop_last`` drops a partial one."""
    if drop_last:
        return shard_size // batch_size
    return -(-shard_size // batch_size)


def train_shard(num_samples: int, rank: int, world_size: int, seed: int, epoch: int) -> torch.Tensor:
    """Indices (int64, CPU) rank ``rank`` trains on in ``epoch``; see the module docstring."""
    check_world(num_samples, rank, world_size)
    perm = torch.randperm(num_samples, generator=seeded_generator(seed, epoch))
    usable = train_shard_size(num_samples, world_size) * world_size
    return perm[:usable][rank::world_size]


def eval_range(num_samples: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, stop) of the contiguous evaluation block of ``rank``; sizes differ by at most one."""
    check_world(num_samples, rank, world_size)
    base, extra = divmod(num_samples, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)
