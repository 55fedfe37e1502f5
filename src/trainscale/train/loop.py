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

from trainscale.parallel import all_reduce_sum, is_main_process
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


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


def train_one_epoch(model: nn.Module, batches, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                    precision: Precision, lr_at: Callable[[float], float], epoch: int, label_smoothing: float = 0.0,
                    progress: bool = True) -> PassStats:
    """Train over this rank's shard of epoch ``epoch``; ``seconds`` covers the whole pass, device-synced."""
    model.train()
    acc = Accumulator(precision.device)
    steps = len(batches)
    bar = tqdm(total=steps, desc=f"epoch {epoch + 1}", leave=False, disable=not (progress and is_main_process()),
               unit="batch", dynamic_ncols=True)
    synchronize(precision.device)
    start = time.perf_counter()
    for step, (images, labels) in enumerate(batches.epoch(epoch)):
        set_lr(optimizer, lr_at(epoch + step / steps))
        with precision.autocast():
            logits = model(images)
            loss = F.cross_entropy(logits.float(), labels, label_smoothing=label_smoothing)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
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
def evaluate(model: nn.Module, batches, precision: Precision, tta_flip: bool = False) -> PassStats:
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
