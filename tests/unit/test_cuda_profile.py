"""``trainscale profile`` on a GPU: each bucket's ready time read from the GPU's stream (the host only queues
the kernels and reaches DDP's hook early), and the overlap and DDP's costs measured with NCCL where the machine has
a second GPU. Marked ``gpu``: skipped where torch sees no CUDA device."""

from __future__ import annotations

import threading

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_a_gpu_profile_times_buckets_on_the_device_and_measures_what_one_gpu_can(tmp_path):
    from trainscale.plan.profile import ProfileConfig, load_profile, profile_command

    before = threading.active_count()
    out = tmp_path / "p.json"
    profile_command(
        ProfileConfig(
            model="resnet9", batch_size=512, precision="bf16", device="cuda", warmup=3, repeats=5, out=str(out)
        )
    )
    p = load_profile(out)
    ready = sorted(b.ready_seconds for b in p.buckets)
    assert len(ready) >= 2 and ready[0] > 0
    # the last bucket is ready when the GPU has computed the first layer's gradients: near backward's end
    assert 0.5 * p.backward.median < ready[-1] <= 1.05 * p.backward.max
    if torch.cuda.device_count() < 2:  # NCCL takes one rank per GPU: nothing of DDP's costs measured
        assert (p.overlap, p.step_overhead, p.bucket_overhead, p.overlap_seconds) == (None, None, None, {})
        assert p.overlap_unmeasured == "NCCL takes one rank per GPU and this machine has one"
    else:
        assert p.overlap_seconds["comm"] > 0 and p.step_overhead is not None
        assert p.bucket_overhead is not None and p.bucket_overhead > 0 and not p.overlap_unmeasured
    assert threading.active_count() == before
