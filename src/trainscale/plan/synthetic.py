"""A profile for a model that cannot be run here: its parameter count, its step time on the target device and
the bucket layout DDP would give it.

DDP packs gradients, last layers first, into a first bucket of 1 MiB and then buckets of ``bucket_cap_mb``
(25 MiB by default); a bucket is ready when its last gradient is. Without a measurement the gradients are
assumed to arrive evenly in bytes over backward, and backward to be two thirds of the step (a backward pass
costs about twice the forward, the usual rule for convolutional and transformer layers); the plan says both
are assumed.
"""

from __future__ import annotations

from trainscale.errors import ConfigError
from trainscale.plan.profile import Bucket, Profile, Timing

MIB = 2**20
FIRST_BUCKET_BYTES = 1 * MIB  # torch.distributed's _DEFAULT_FIRST_BUCKET_BYTES
BACKWARD_SHARE = 2.0 / 3.0  # assumed: backward costs twice the forward


def ddp_buckets(gradient_bytes: int, backward_seconds: float, bucket_mb: float = 25.0) -> list[Bucket]:
    """DDP's buckets for ``gradient_bytes`` of gradients (1 MiB, then ``bucket_mb`` MiB each), each ready when
    its share of backward has run (gradients assumed to arrive evenly in bytes)."""
    if gradient_bytes < 1 or backward_seconds <= 0 or bucket_mb <= 0:
        raise ValueError("buckets need gradients, a backward that takes time and a positive bucket size")
    sizes, left, cap = [], gradient_bytes, FIRST_BUCKET_BYTES
    while left > 0:
        sizes.append(min(cap, left))
        left -= sizes[-1]
        cap = int(bucket_mb * MIB)
    buckets, done = [], 0
    for i, n in enumerate(sizes):
        done += n
        buckets.append(Bucket(i, n, backward_seconds * done / gradient_bytes))
    return buckets


def _timing(seconds: float) -> Timing:
    return Timing(seconds, seconds, seconds, 1)


def synthetic_profile(
    params: int, step_seconds: float, batch_size: int, bucket_mb: float = 25.0, name: str | None = None
) -> Profile:
    """A profile of a ``params``-parameter model whose step (one device, no communication) takes
    ``step_seconds`` at ``batch_size``; fp32 gradients (a plan's ``--grad-dtype`` shrinks them)."""
    if params < 1 or not step_seconds > 0 or batch_size < 1:
        raise ConfigError(
            f"--params {params}, --step-time {step_seconds:g} s and --batch-size {batch_size}: all must be positive"
        )
    gradient_bytes = 4 * params
    backward = step_seconds * BACKWARD_SHARE
    return Profile(
        name or f"{params:,}-parameter model",
        batch_size,
        "fp32",
        "given (--params, --step-time)",
        1,
        None,
        _timing(0.0),
        _timing(step_seconds - backward),
        _timing(backward),
        _timing(0.0),
        gradient_bytes,
        params,
        ddp_buckets(gradient_bytes, backward, bucket_mb),
        0.0,
        environment={"device": "given"},
    )
