"""One training epoch and one evaluation pass: the hot loop, kept free of I/O and host syncs (but for
``--nonfinite skip``, which must read every step's verdict before applying it: see ``NonFiniteSkipper``; the
stop guard's one read every ``NonFiniteGuard.CHECK_EVERY`` steps; and the progress bar's loss on a terminal).
The step itself reads nothing from the device: the learning rate is a float (a kernel argument) or, for a
compiled step, a device tensor filled in place; the first loss is kept on the device until the epoch ends.

Loss and accuracy are accumulated on the device and read once per epoch (or every few steps for the
progress bar), then summed over ranks, so the same code serves one process and many.
"""

from __future__ import annotations

import contextlib
import itertools
import math
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
from trainscale.runtime.dist import all_reduce_sum, any_rank, is_main_process
from trainscale.train.ema import WeightAverage
from trainscale.train.optimizers import set_lr
from trainscale.train.precision import Precision, synchronize
from trainscale.train.step import StepFn, correct_count
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
        self.add_counted(correct_count(logits, labels), loss, labels.numel())

    def add_counted(self, correct: torch.Tensor, loss: torch.Tensor, n: int) -> None:
        """A batch of ``n`` samples whose correct predictions were counted where its logits were made (a
        compiled step counts them inside its graph)."""
        self.loss_sum.add_(loss.detach(), alpha=n)
        self.correct.add_(correct)
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
    """Stops an epoch at the first step whose loss is not finite, naming the epoch and step. The first bad step
    is recorded on the device (no per-step sync) and read every ``CHECK_EVERY`` steps and at the epoch's end (on a
    CPU it keeps the step free of reads, so the step is the same code everywhere).

    On a GPU a read in mid-epoch takes the record as it was ``CHECK_EVERY`` steps earlier, copied then to pinned
    memory: the host waits only for that old copy, not for the steps queued since, so the GPU never runs dry at
    a check (a read of the current record would wait for every queued step, then leave the GPU idle while the
    host prepares the next). A bad step stops training within ``2 * CHECK_EVERY`` steps, at the same step on
    every rank; the read at the epoch's end is of the current record."""

    CHECK_EVERY = 10
    skipped = 0  # it never skips: the first bad step ends training

    def __init__(self, device: torch.device, epoch: int, lr_at: Callable[[float], float], steps: int) -> None:
        self.epoch, self.lr_at, self.steps = epoch, lr_at, steps
        self.every = self.CHECK_EVERY
        self.first = torch.full((), -1, dtype=torch.int64, device=device)
        cuda = self.first.device.type == "cuda"
        self._copy = torch.full((), -1, dtype=torch.int64, pin_memory=True) if cuda else None
        self._copied: torch.cuda.Event | None = None

    def admit(self, step: int, loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> bool:
        """Every step is applied (its verdict recorded on the device); a bad one stops training within
        ``CHECK_EVERY`` steps (on a GPU ``2 * CHECK_EVERY``: ``between_steps``)."""
        self.record(step, loss)
        return True

    def finish(self) -> None:
        """Nothing left to check: the last step always reads the device."""

    def add(self, step: int, loss: torch.Tensor) -> None:
        """``record`` then ``between_steps``."""
        self.record(step, loss)
        self.between_steps(step)

    def record(self, step: int, loss: torch.Tensor) -> None:
        bad = ~torch.isfinite(loss.detach())
        self.first = torch.where((self.first < 0) & bad, step, self.first)

    def between_steps(self, step: int) -> None:
        """The read, when due: every ``every`` steps (on a GPU, of the record copied at the previous one) and of
        the current record after the last."""
        if step + 1 == self.steps:
            self.check()
        elif (step + 1) % self.every == 0:
            self._check_earlier() if self._copy is not None else self.check()

    def check(self) -> None:
        self._stop_if_bad(int(self.first))

    def _stop_if_bad(self, first: int) -> None:
        """``first``: a read of the record (-1: every step so far finite)."""
        if first >= 0:
            self._fail(first)

    def _check_earlier(self) -> None:
        """The record copied at the previous check (its copy long done: no wait for the steps queued since),
        then the current record copied, to read at the next."""
        assert self._copy is not None
        if self._copied is not None:
            self._copied.synchronize()
            self._stop_if_bad(int(self._copy))
        self._copy.copy_(self.first, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()

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

    def between_steps(self, step: int) -> None:
        """Nothing: each step's verdict was read before it was applied."""

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
    step_fn: StepFn | None = None,
    step_log: StepLog | None = None,
    options: StepOptions = StepOptions(),
    max_steps: int | None = None,
) -> PassStats:
    """Train over this rank's shard of epoch ``epoch``; ``seconds`` covers the whole pass, device-synced.
    ``max_steps``: stop after that many steps (the last epoch of a fractional ``--epochs``); the learning rate
    still follows the whole epoch's clock, so the schedule ends where the run does.
    ``nonfinite``: what a NaN/inf step does, ``stop`` training or be ``skip``ped (see ``NonFiniteSkipper``).
    ``step_fn``: a compiled step (``train.step``) in place of the eager one (``--nonfinite stop`` only).
    ``step_log``: live metrics every few steps (``steplog``); the progress bar shows only on a terminal."""
    model.train()
    acc = Accumulator(precision.device)
    full = len(batches)
    steps = full if max_steps is None else min(full, max_steps)
    guard: NonFiniteGuard | NonFiniteSkipper = (
        NonFiniteGuard(precision.device, epoch, lr_at, steps)
        if nonfinite == "stop"
        else NonFiniteSkipper(epoch, lr_at, steps, check_gradients=not scaler.is_enabled())
    )
    first_loss: torch.Tensor | None = None
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
    run = EpochStep(model, optimizer, scaler, precision, lr_at, label_smoothing, guard, acc, step_fn, options)
    if step_log is not None:
        step_log.start_epoch(epoch, steps, acc, start)
    source = batches.epoch(epoch)
    for step, (images, labels) in enumerate(source if steps == full else itertools.islice(source, steps)):
        loss = run(step, epoch + getattr(batches, "progress", step / full), images, labels)
        if step == 0:
            first_loss = loss.detach().clone()
        guard.between_steps(step)
        _tick(bar, step, labels.numel(), start, loss)
        if step_log is not None:
            step_log.after_step(step, labels.numel(), optimizer.param_groups[0]["lr"])
    guard.finish()
    synchronize(precision.device)
    seconds = time.perf_counter() - start
    bar.close()
    stats = acc.reduce(seconds)
    stats.skipped_steps, stats.steps = guard.skipped, steps
    stats.first_loss = float(first_loss) if first_loss is not None else None
    return stats


@dataclass
class EpochStep:
    """One training step of the epoch loop, as the loop runs it: the schedule's learning rates, forward and
    backward, the guard's verdict (the stop guard records it on the device), the optimizer step and the
    running sums. It reads nothing from the device but for ``--nonfinite skip`` and fp16's grad scaler (see the
    module docstring); tests count the reads inside it."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    precision: Precision
    lr_at: Callable[[float], float]
    label_smoothing: float
    guard: NonFiniteGuard | NonFiniteSkipper
    acc: Accumulator
    step_fn: StepFn | None = None
    options: StepOptions = StepOptions()

    def __call__(self, step: int, t: float, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Step ``step`` at fractional epoch ``t``; returns its loss (on the device)."""
        set_lr(self.optimizer, self.lr_at(t), t)
        if self.step_fn is not None:
            correct, loss = self.step_fn(images, labels)
            admitted = self.guard.admit(step, loss, self.optimizer)  # the stop guard: always True
        else:
            logits, loss = compute_gradients(
                self.model,
                images,
                labels,
                self.optimizer,
                self.scaler,
                self.precision,
                self.label_smoothing,
                self.options.accumulate,
            )
            admitted = self.guard.admit(step, loss, self.optimizer)
            if admitted:
                apply_gradients(self.optimizer, self.scaler, self.options.clip_grad_norm)
                correct = correct_count(logits, labels)
        if not admitted:
            self.acc.skip(labels.numel())
            return loss
        if self.options.ema is not None:
            self.options.ema.update()
        self.acc.add_counted(correct, loss, labels.numel())
        return loss


def _tick(bar: tqdm, step: int, batch: int, start: float, loss: torch.Tensor) -> None:
    bar.update(1)
    if not bar.disable and step % 10 == 0:
        rate = batch * (step + 1) / max(time.perf_counter() - start, 1e-9)
        bar.set_postfix(img_s=f"{rate:.0f}", loss=f"{loss.item():.3f}")


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Batches,
    precision: Precision,
    tta_flip: bool = False,
    translate: int = 0,
    select: float = 1.0,
) -> PassStats:
    """Test loss and accuracy; with ``tta_flip`` the logits of each image and its mirror are averaged, and with
    ``translate`` too those of the images shifted by that many pixels (see ``predict``); ``select`` < 1: those
    extra views for the least confident fraction of each batch only (see ``predict_selective``)."""
    model.eval()
    acc = Accumulator(precision.device)
    start = time.perf_counter()
    for images, labels in batches.epoch(0):
        with precision.autocast():
            logits = predict_selective(model, images, tta_flip, translate, select)
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
    views = [predict(model, x, flip) for x in shifted(images, translate)]
    return 0.5 * logits + 0.25 * (views[0] + views[1])


def shifted(images: torch.Tensor, translate: int) -> list[torch.Tensor]:
    """``images`` shifted by ``translate`` pixels up-left and down-right (reflect padding), in their layout."""
    h, w = images.shape[-2:]
    padded = F.pad(images, (translate,) * 4, mode="reflect")
    layout = memory_format(images)
    return [
        x.contiguous(memory_format=layout) for x in (padded[..., :h, :w], padded[..., 2 * translate :, 2 * translate :])
    ]


def memory_format(images: torch.Tensor) -> torch.memory_format:
    return torch.channels_last if images.is_contiguous(memory_format=torch.channels_last) else torch.contiguous_format


def predict_selective(
    model: nn.Module, images: torch.Tensor, flip: bool = False, translate: int = 0, select: float = 1.0
) -> torch.Tensor:
    """``predict`` with its extra views (flip, translations) for the ``select`` fraction of ``images`` the model
    is least sure of (lowest top softmax probability on the plain view), the plain view's logits for the rest.
    Selective test-time augmentation: the extra views change mostly the predictions that were close calls, so
    most of TTA's gain costs a fraction of its passes. The count per batch is fixed by the batch size (static
    shapes), and the choice is made on the device (no sync). The chosen images' plain logits are the ones already
    made, and their five extra views go through the model together (``extra_views``): one forward where separate
    views take five, each a fifth the size, which on a GPU costs the host fewer launches and fills the device better."""
    if select >= 1.0 or not flip:
        return predict(model, images, flip, translate)
    logits = model(images).float()
    k = math.ceil(select * images.shape[0])
    if k == 0:
        return logits
    unsure = logits.softmax(1).amax(1).topk(k, largest=False).indices
    plain = logits.index_select(0, unsure)
    chosen = images.index_select(0, unsure).contiguous(memory_format=memory_format(images))  # index_select: NCHW
    views = extra_views(model, chosen, translate, limit=2 * images.shape[0])
    averaged = 0.5 * (plain + views[0])
    if translate:  # predict's weights: a half for the plain view and its mirror, an eighth for each other view
        averaged = 0.5 * averaged + 0.125 * (views[1] + views[2] + views[3] + views[4])
    return logits.index_copy(0, unsure, averaged)


def extra_views(model: nn.Module, chosen: torch.Tensor, translate: int, limit: int) -> torch.Tensor:
    """Float logits of ``chosen``'s mirror and, with ``translate``, of its two shifted views and their mirrors
    (``predict``'s views but the plain one), stacked (views, images, classes); made by forwards of at most
    ``limit`` images (an evaluation's forward keeps no activations for a backward, so twice its batch holds
    less than a training step does)."""
    views = [chosen.flip(3)]
    for x in shifted(chosen, translate) if translate else ():
        views += [x, x.flip(3)]
    batch = torch.cat(views).contiguous(memory_format=memory_format(chosen))
    logits = torch.cat([model(part) for part in batch.split(limit)]).float()
    return logits.unflatten(0, (len(views), chosen.shape[0]))


def views_per_image(flip: bool, translate: int) -> int:
    """How many forward passes ``predict`` makes per image."""
    return (2 if flip else 1) * (3 if flip and translate else 1)
