"""Device and numeric precision: which device to train on, the autocast context and the grad scaler."""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from trainscale.errors import ConfigError


def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA when present, else the CPU; a bare ``cuda`` becomes the current GPU's index;
    an unavailable device is a clear error."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device '{name}' is not a device; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"--device {name}: CUDA is not available on this machine; use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) present")
        if device.index is None:  # name the GPU, so results and the environment record say which one
            device = torch.device("cuda", torch.cuda.current_device())
    elif device.type != "cpu":
        raise ConfigError(f"--device '{name}' is not supported; use auto, cpu, cuda or cuda:N")
    return device


@dataclass
class Precision:
    """What ``--precision`` means on a device: the autocast dtype and whether a grad scaler is needed."""

    name: str
    device: torch.device

    def __post_init__(self) -> None:
        if self.name == "fp16" and self.device.type != "cuda":
            raise ConfigError(
                "--precision fp16 needs a CUDA device (CPU fp16 convolutions are slow or "
                "unsupported); use --precision bf16 on the CPU"
            )
        if self.name == "bf16" and self.device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ConfigError("--precision bf16 is not supported by this GPU; use fp16 or fp32")

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.name)

    def autocast(self) -> AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def grad_scaler(self) -> torch.amp.GradScaler:
        return torch.amp.GradScaler(self.device.type, enabled=self.name == "fp16")


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels so wall-clock timers measure finished work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_mb(device: torch.device) -> float:
    """Peak allocated GPU memory on CUDA; on the CPU, the process's peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
