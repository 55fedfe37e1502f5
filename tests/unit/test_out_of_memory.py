"""A run that asks for more memory than its device has ends in one line naming what to shrink, not a traceback
from deep inside a model or an augmentation (``--image-size 100000``), and not silently killed by the kernel
(``--image-size 2048`` on synthetic data)."""

from __future__ import annotations

import pytest
import torch

from trainscale.data import synthetic
from trainscale.errors import ConfigError, OutOfMemory, memory_errors_as_one_line

CPU_ALLOCATOR = (
    "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to "
    "allocate 1920000000000 bytes. Error code 12 (Cannot allocate memory)"
)
CUDA = (
    "CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 79.10 GiB of which 2 GiB is free."
)


@pytest.mark.parametrize(
    "error, said",
    [
        (RuntimeError(CPU_ALLOCATOR), "the run tried to allocate 1,788.1 GiB"),
        (torch.OutOfMemoryError(CUDA), "CUDA out of memory. Tried to allocate 20.00 GiB."),
    ],
)
def test_torch_out_of_memory_errors_become_one_line(error, said):
    with pytest.raises(OutOfMemory) as raised, memory_errors_as_one_line():
        raise error
    message = str(raised.value)
    assert message.startswith(f"out of memory: {said}") and "\n" not in message, message
    assert message.endswith("a smaller --batch-size (or --batch-per-worker), --image-size or model fits")


def test_other_runtime_errors_pass_unchanged():
    with pytest.raises(RuntimeError, match="^shapes do not match$"), memory_errors_as_one_line():
        raise RuntimeError("shapes do not match")


def test_a_real_allocation_beyond_the_machine_is_one_line():
    with pytest.raises(OutOfMemory, match="out of memory: the run tried to allocate"), memory_errors_as_one_line():
        torch.empty(2**60, dtype=torch.uint8)


def test_synthetic_images_that_do_not_fit_in_free_memory_are_refused_before_they_are_made(monkeypatch):
    monkeypatch.setattr(synthetic, "available_memory", lambda: 2**30)
    with pytest.raises(ConfigError, match=r"^2,000 synthetic images of 3x512x512 take 1.5 GiB, more than the 1.0 GiB"):
        synthetic.synthetic_dataset(2000, 512)
    assert synthetic.synthetic_dataset(8, 32).images.shape == (8, 3, 32, 32)
