"""One training epoch and one evaluation pass: the hot loop, kept free of I/O and host syncs.

Loss and accuracy are accumulated on the device and read once per epoch (or every few steps for the
progress bar), then summed over ranks, so the same code serves one process and many.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from trainscale.data import Batches
from trainscale.errors import TrainscaleError
from trainscale.runtime import all_reduce_sum, is_main_process
from trainscale.train.precision import Precision, synchronize


@dataclass
class PassStats:
    loss: float
    acc: float
    samples: int
    seconds: float


class Accumulator:
    """Running sums of loss and correct predictions, kept on the device (two in-place adds per step, no
    sync); the sample count stays on the host, since building it on a GPU each step would be a
    host-to-device copy that waits for the GPU."""

    def __init__(self, device: torch.device) -> None:
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.correct = torch.zeros((), dtype=torch.float64, device=device)
        self.count = 0

    def add(self, logits: torch.Tensor, labels: torch.Tensor, loss: torch.Tensor) -> None:
        n = labels.numel()
        self.loss_sum.add_(loss.detach(), alpha=n)
        self.correct.add_((logits.argmax(dim=1) == labels).sum())
        self.count += n

    def reduce(self, seconds: float) -> PassStats:
        totals = torch.stack([self.loss_sum, self.correct, self.loss_sum.new_tensor(float(self.count))])
        loss_sum, correct, count = all_reduce_sum(totals).tolist()
        count = max(count, 1.0)
        return PassStats(loss_sum / count, correct / count, int(count), seconds)


class NonFiniteLoss(TrainscaleError):
    """The loss became NaN or infinite: training cannot recover from it (usually a learning rate too high)."""


class NonFiniteGuard:
    """Stops an epoch at the first step whose loss is not finite, naming the epoch and step. It reads the
    device every step on the CPU (where the loss is already computed, so it costs nothing) and every
    ``GPU_CHECK_EVERY`` steps on a GPU, recording the first bad step on the device meanwhile (no per-step sync)."""

    GPU_CHECK_EVERY = 10

    def __init__(self, device: torch.device, epoch: int, lr_at: Callable[[float], float], steps: int) -> None:
        self.epoch, self.lr_at, self.steps = epoch, lr_at, steps
        self.every = 1 if device.type == "cpu" else self.GPU_CHECK_EVERY
        self.first = torch.full((), -1, dtype=torch.int64, device=device)

    def add(self, step: int, loss: torch.Tensor) -> None:
        bad = ~torch.isfinite(loss.detach())
        if self.every == 1:
            if bool(bad):
                self._fail(step)
            return
        self.first = torch.where((self.first < 0) & bad, step, self.first)
        if (step + 1) % self.every == 0 or step + 1 == self.steps:
            self.check()

    def check(self) -> None:
        first = int(self.first)
        if first >= 0:
            self._fail(first)

    def _fail(self, step: int) -> None:
        lr = self.lr_at(self.epoch + step / self.steps)
        raise NonFiniteLoss(f"the training loss is not finite (NaN or inf) at epoch {self.epoch + 1} step {step + 1} "
                            f"(lr {lr:g}): training stopped; lower --lr (or raise --warmup-epochs) and start again")


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def train_step(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, optimizer: torch.optim.Optimizer,
               scaler: torch.amp.GradScaler, precision: Precision,
               label_smoothing: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step on one batch: forward under the precision's autocast, loss in fp32, backward
    through the grad scaler, step. Returns (logits, loss) without a host sync, so it can be timed alone
    (synchronise the device around it) or called in a loop."""
    with precision.autocast():
        logits = model(images)
        loss = F.cross_entropy(logits.float(), labels, label_smoothing=label_smoothing)
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return logits, loss


def train_one_epoch(model: nn.Module, batches: Batches, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                    precision: Precision, lr_at: Callable[[float], float], epoch: int, label_smoothing: float = 0.0,
                    progress: bool = True) -> PassStats:
    """Train over this rank's shard of epoch ``epoch``; ``seconds`` covers the whole pass, device-synced."""
    model.train()
    acc = Accumulator(precision.device)
    steps = len(batches)
    guard = NonFiniteGuard(precision.device, epoch, lr_at, steps)
    bar = tqdm(total=steps, desc=f"epoch {epoch + 1}", leave=False, disable=not (progress and is_main_process()),
               unit="batch", dynamic_ncols=True)
    synchronize(precision.device)
    start = time.perf_counter()
    for step, (images, labels) in enumerate(batches.epoch(epoch)):
        set_lr(optimizer, lr_at(epoch + step / steps))
        logits, loss = train_step(model, images, labels, optimizer, scaler, precision, label_smoothing)
        guard.add(step, loss)
        acc.add(logits, labels, loss)
        _tick(bar, step, labels.numel(), start, loss)
    synchronize(precision.device)
    seconds = time.perf_counter() - start
    bar.close()
    return acc.reduce(seconds)


def _tick(bar: tqdm, step: int, batch: int, start: float, loss: torch.Tensor) -> None:
    bar.update(1)
    if not bar.disable and step % 10 == 0:
        rate = batch * (step + 1) / max(time.perf_counter() - start, 1e-9)
        bar.set_postfix(img_s=f"{rate:.0f}", loss=f"{loss.item():.3f}")


@torch.no_grad()
def evaluate(model: nn.Module, batches: Batches, precision: Precision, tta_flip: bool = False) -> PassStats:
    """Test loss and accuracy; with ``tta_flip`` the logits of each image and its mirror are averaged."""
    model.eval()
    acc = Accumulator(precision.device)
    start = time.perf_counter()
    for images, labels in batches.epoch(0):
        with precision.autocast():
            logits = model(images).float()
            if tta_flip:
                logits = 0.5 * (logits + model(images.flip(3)).float())
        acc.add(logits, labels, F.cross_entropy(logits, labels))
    synchronize(precision.device)
    return acc.reduce(time.perf_counter() - start)
