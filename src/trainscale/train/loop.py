"""One training epoch and one evaluation pass: the hot loop, kept free of I/O and host syncs (but for
``--nonfinite skip``, which must read every step's verdict before applying it: see ``NonFiniteSkipper``).

Loss and accuracy are accumulated on the device and read once per epoch (or every few steps for the
progress bar), then summed over ranks, so the same code serves one process and many.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from trainscale.data import Batches
from trainscale.errors import TrainscaleError
from trainscale.runtime import all_reduce_sum, is_main_process
from trainscale.runtime.dist import any_rank
from trainscale.train.ema import WeightAverage
from trainscale.train.optimizers import set_lr
from trainscale.train.precision import Precision, synchronize
from trainscale.train.steplog import StepLog


@dataclass
class PassStats:
    loss: float
    acc: float
    samples: int
    seconds: float
    skipped_steps: int = 0
    steps: int = 0
    first_loss: float | None = None  # the loss of the pass's first step (training)


class Accumulator:
    """Running sums of loss and correct predictions, kept on the device (two in-place adds per step, no
    sync); the sample count stays on the host, since building it on a GPU each step would be a
    host-to-device copy that waits for the GPU. Samples of skipped steps (``--nonfinite skip``) count for
    throughput only: they were computed, but their loss is no figure to average."""

    def __init__(self, device: torch.device) -> None:
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.correct = torch.zeros((), dtype=torch.float64, device=device)
        self.count = 0
        self.skipped = 0

    def add(self, logits: torch.Tensor, labels: torch.Tensor, loss: torch.Tensor) -> None:
        n = labels.numel()
        self.loss_sum.add_(loss.detach(), alpha=n)
        self.correct.add_((logits.argmax(dim=1) == labels).sum())
        self.count += n

    def skip(self, n: int) -> None:
        self.skipped += n

    def reduce(self, seconds: float) -> PassStats:
        counts = self.loss_sum.new_tensor([float(self.count), float(self.skipped)])
        loss_sum, correct, count, skipped = all_reduce_sum(
            torch.cat([self.loss_sum.view(1), self.correct.view(1), counts])
        ).tolist()
        return PassStats(loss_sum / max(count, 1.0), correct / max(count, 1.0), int(count + skipped), seconds)


class NonFiniteLoss(TrainscaleError):
    """The loss became NaN or infinite: training cannot recover from it (usually a learning rate too high)."""


class NonFiniteGuard:
    """Stops an epoch at the first step whose loss is not finite, naming the epoch and step. It reads the
    device every step on the CPU (where the loss is already computed, so it costs nothing) and every
    ``GPU_CHECK_EVERY`` steps on a GPU, recording the first bad step on the device meanwhile (no per-step sync)."""

    GPU_CHECK_EVERY = 10
    skipped = 0  # it never skips: the first bad step ends training

    def __init__(self, device: torch.device, epoch: int, lr_at: Callable[[float], float], steps: int) -> None:
        self.epoch, self.lr_at, self.steps = epoch, lr_at, steps
        self.every = 1 if device.type == "cpu" else self.GPU_CHECK_EVERY
        self.first = torch.full((), -1, dtype=torch.int64, device=device)

    def admit(self, step: int, loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> bool:
        """Every step is applied; a bad one stops training (at once on the CPU, within 10 steps on a GPU)."""
        self.add(step, loss)
        return True

    def finish(self) -> None:
        """Nothing left to check: the last step always reads the device."""

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
        raise NonFiniteLoss(
            f"the training loss is not finite (NaN or inf) at epoch {self.epoch + 1} step {step + 1} "
            f"(lr {lr:g}): training stopped; lower --lr (or raise --warmup-epochs) and start again"
        )


class NonFiniteSkipper:
    """``--nonfinite skip``: a step whose loss or gradients are NaN/inf is not applied, on every rank alike
    (``any_rank``: one all-reduce of one flag). Unlike the stop guard this must decide before each update,
    so it reads the device every step (one sync per step on a GPU). Under fp16's grad scaler the gradients
    are the scaler's business (it skips overflowing steps itself and lowers its scale); the loss is still
    checked here. An epoch in which every step is skipped stops training all the same."""

    def __init__(self, epoch: int, lr_at: Callable[[float], float], steps: int, check_gradients: bool) -> None:
        self.epoch, self.lr_at, self.steps, self.check_gradients = epoch, lr_at, steps, check_gradients
        self.skipped = 0

    def admit(self, step: int, loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> bool:
        bad = ~torch.isfinite(loss.detach())
        if self.check_gradients:
            grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            if grads:
                bad = bad | ~torch.stack([torch.isfinite(g).all() for g in grads]).all()
        if any_rank(bad):
            self.skipped += 1
            return False
        return True

    def finish(self) -> None:
        if self.skipped == self.steps:
            raise NonFiniteLoss(
                f"every step of epoch {self.epoch + 1} ({self.steps}) had a non-finite loss or "
                f"gradients and was skipped (--nonfinite skip; lr {self.lr_at(self.epoch):g} at its "
                "start): training stopped; lower --lr (or raise --warmup-epochs) and start again"
            )


def train_step(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    precision: Precision,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step on one batch: forward under the precision's autocast, loss in fp32, backward
    through the grad scaler, step. Returns (logits, loss) without a host sync, so it can be timed alone
    (synchronise the device around it) or called in a loop."""
    logits, loss = compute_gradients(model, images, labels, optimizer, scaler, precision, label_smoothing)
    apply_gradients(optimizer, scaler)
    return logits, loss


def compute_gradients(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    precision: Precision,
    label_smoothing: float = 0.0,
    accumulate: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first half of ``train_step``: forward and backward, gradients left in ``.grad`` (scaled by
    ``scaler``), so the caller can decide whether to apply them. ``accumulate`` > 1: see ``accumulate_gradients``."""
    if accumulate > 1:
        return accumulate_gradients(model, images, labels, optimizer, scaler, precision, label_smoothing, accumulate)
    with precision.autocast():
        logits = model(images)
        loss = F.cross_entropy(logits.float(), labels, label_smoothing=label_smoothing)
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    return logits, loss


def accumulate_gradients(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    precision: Precision,
    label_smoothing: float,
    micro: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``--accumulate``: the batch in ``micro`` equal micro-batches, each loss divided by ``micro`` so the summed
    gradients are the whole batch's mean (the same update as one step on it, for a model without BatchNorm).
    Inside DDP every micro-batch but the last runs under ``no_sync``: the gradients add up locally and only the
    last backward communicates (through the mode's hook, compressed or not, counted once per optimizer step)."""
    optimizer.zero_grad(set_to_none=True)
    parts, total = [], torch.zeros((), device=images.device)
    no_sync = getattr(model, "no_sync", None)
    for i, (x, y) in enumerate(zip(images.chunk(micro), labels.chunk(micro))):
        quiet = no_sync() if no_sync is not None and i < micro - 1 else contextlib.nullcontext()
        with quiet:
            with precision.autocast():
                logits = model(x)
                loss = F.cross_entropy(logits.float(), y, label_smoothing=label_smoothing)
            scaler.scale(loss / micro).backward()
        parts.append(logits.detach())
        total = total + loss.detach() / micro
    return torch.cat(parts), total


def apply_gradients(
    optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, clip_grad_norm: float | None = None
) -> None:
    """The second half of ``train_step``: the optimizer step through the grad scaler; ``clip_grad_norm``: the
    gradients' global L2 norm clipped to it first (unscaled, on the device: no host sync)."""
    if clip_grad_norm is not None:
        scaler.unscale_(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        torch.nn.utils.clip_grad_norm_(params, clip_grad_norm, foreach=True)
    scaler.step(optimizer)
    scaler.update()


@dataclass(frozen=True)
class StepOptions:
    """How each optimizer step is made beyond the plain one: micro-batches summed (``accumulate``), the gradient
    norm clipped (``clip_grad_norm``), a weight average updated after it (``ema``, a ``WeightAverage``)."""

    accumulate: int = 1
    clip_grad_norm: float | None = None
    ema: WeightAverage | None = None


def train_one_epoch(
    model: nn.Module,
    batches: Batches,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    precision: Precision,
    lr_at: Callable[[float], float],
    epoch: int,
    label_smoothing: float = 0.0,
    progress: bool = True,
    nonfinite: str = "stop",
    step_log: StepLog | None = None,
    options: StepOptions = StepOptions(),
) -> PassStats:
    """Train over this rank's shard of epoch ``epoch``; ``seconds`` covers the whole pass, device-synced.
    ``nonfinite``: what a NaN/inf step does, ``stop`` training or be ``skip``ped (see ``NonFiniteSkipper``).
    ``step_log``: live metrics every few steps (``steplog``); the progress bar shows only on a terminal."""
    model.train()
    acc = Accumulator(precision.device)
    steps = len(batches)
    guard: NonFiniteGuard | NonFiniteSkipper = (
        NonFiniteGuard(precision.device, epoch, lr_at, steps)
        if nonfinite == "stop"
        else NonFiniteSkipper(epoch, lr_at, steps, check_gradients=not scaler.is_enabled())
    )
    first_loss: float | None = None
    bar = tqdm(
        total=steps,
        desc=f"epoch {epoch + 1}",
        leave=False,
        disable=not (progress and is_main_process() and sys.stderr.isatty()),
        unit="batch",
        dynamic_ncols=True,
    )
    synchronize(precision.device)
    start = time.perf_counter()
    if step_log is not None:
        step_log.start_epoch(epoch, steps, acc, start)
    for step, (images, labels) in enumerate(batches.epoch(epoch)):
        t = epoch + getattr(batches, "progress", step / steps)
        set_lr(optimizer, lr_at(t), t)
        logits, loss = compute_gradients(
            model, images, labels, optimizer, scaler, precision, label_smoothing, options.accumulate
        )
        if step == 0:
            first_loss = float(loss.detach())
        if guard.admit(step, loss, optimizer):
            apply_gradients(optimizer, scaler, options.clip_grad_norm)
            if options.ema is not None:
                options.ema.update()
            acc.add(logits, labels, loss)
        else:
            acc.skip(labels.numel())
        _tick(bar, step, labels.numel(), start, loss)
        if step_log is not None:
            step_log.after_step(step, labels.numel(), optimizer.param_groups[0]["lr"])
    guard.finish()
    synchronize(precision.device)
    seconds = time.perf_counter() - start
    bar.close()
    stats = acc.reduce(seconds)
    stats.skipped_steps, stats.steps, stats.first_loss = guard.skipped, steps, first_loss
    return stats


def _tick(bar: tqdm, step: int, batch: int, start: float, loss: torch.Tensor) -> None:
    bar.update(1)
    if not bar.disable and step % 10 == 0:
        rate = batch * (step + 1) / max(time.perf_counter() - start, 1e-9)
        bar.set_postfix(img_s=f"{rate:.0f}", loss=f"{loss.item():.3f}")


@torch.no_grad()
def evaluate(
    model: nn.Module, batches: Batches, precision: Precision, tta_flip: bool = False, translate: int = 0
) -> PassStats:
    """Test loss and accuracy; with ``tta_flip`` the logits of each image and its mirror are averaged, and with
    ``translate`` too those of the images shifted by that many pixels (see ``predict``)."""
    model.eval()
    acc = Accumulator(precision.device)
    start = time.perf_counter()
    for images, labels in batches.epoch(0):
        with precision.autocast():
            logits = predict(model, images, tta_flip, translate)
        acc.add(logits, labels, F.cross_entropy(logits, labels))
    synchronize(precision.device)
    return acc.reduce(time.perf_counter() - start)


def predict(model: nn.Module, images: torch.Tensor, flip: bool = False, translate: int = 0) -> torch.Tensor:
    """Float logits of ``images``; ``flip``: the mean with the mirrored images' (2 views); ``translate`` (with
    ``flip``): airbench's 6 views, half that and half the mean of the images shifted by ``translate`` pixels up-left
    and down-right (reflect padding), each with its mirror."""
    logits = model(images).float()
    if flip:
        logits = 0.5 * (logits + model(images.flip(3)).float())
    if not translate:
        return logits
    h, w = images.shape[-2:]
    padded = F.pad(images, (translate,) * 4, mode="reflect")
    layout = torch.channels_last if images.is_contiguous(memory_format=torch.channels_last) else torch.contiguous_format
    shifted = [padded[..., :h, :w], padded[..., 2 * translate :, 2 * translate :]]
    views = [predict(model, x.contiguous(memory_format=layout), flip) for x in shifted]
    return 0.5 * logits + 0.25 * (views[0] + views[1])


def views_per_image(flip: bool, translate: int) -> int:
    """How many forward passes ``predict`` makes per image."""
    return (2 if flip else 1) * (3 if flip and translate else 1)
