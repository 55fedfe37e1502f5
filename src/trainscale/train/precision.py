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
    device = named_device(name)
    if device.type == "cuda" and device.index is None:  # name the GPU, so results and the environment say which
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def named_device(name: str) -> torch.device:
    """The device ``name`` names, checked to be on this machine (a one-line ConfigError if not), without creating
    a CUDA context: a parent process that only starts the runs can check their ``--device`` and stay off the GPU.
    A bare ``cuda`` stays without an index."""
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
    elif device.type != "cpu":
        raise ConfigError(f"--device '{name}' is not supported; use auto, cpu, cuda or cuda:N")
    return device


PRECISIONS = ("fp32", "bf16", "fp16")
PRECISION_CHOICES = (*PRECISIONS, "auto")


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` computes bf16 in units of its own: a GPU that supports it, or a CPU where oneDNN has bf16
    kernels (AVX-512 and up). Below that (AVX2) bf16 convolutions fall back to slow reference code: an airbench
    step at batch 64 took 13 s in bf16 against 1 s in fp32 on a 2-core AVX2 CPU."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN
        return False


def resolve_precision(name: str, device: torch.device) -> str:
    """``auto``: bf16 where ``device`` computes it natively (:func:`native_bf16`), else fp32; any other name as is."""
    if name != "auto":
        return name
    return "bf16" if native_bf16(device) else "fp32"


def slow_bf16_note(name: str, device: torch.device) -> str:
    """A line for a run that asked for bf16 where it is emulated (empty otherwise): it trains, several times slower."""
    if name != "bf16" or device.type != "cpu" or native_bf16(device):
        return ""
    capability = torch.backends.cpu.get_cpu_capability()
    return (
        f"--precision bf16 on this CPU ({capability}): oneDNN has no bf16 kernels below AVX-512, so every step runs "
        "several times slower than in fp32; --precision auto takes fp32 here and bf16 where it is native"
    )


@dataclass
class Precision:
    """What ``--precision`` means on a device: the autocast dtype and whether a grad scaler is needed (``auto``
    becomes the precision :func:`resolve_precision` picks for the device)."""

    name: str
    device: torch.device

    def __post_init__(self) -> None:
        self.name = resolve_precision(self.name, self.device)
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
