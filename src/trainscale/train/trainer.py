"""The epoch loop around ``loop.py``: schedule, evaluation, metrics, checkpoints and resume."""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import logging
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from trainscale.config import CoreConfig
from trainscale.data import Batches, DeviceBatches
from trainscale.errors import ConfigError
from trainscale.models import is_builtin_model
from trainscale.recipes import get_recipe
from trainscale.record import EXCHANGE_SPLIT, METRICS, K, config_mismatches, merge, scaling_efficiency
from trainscale.results import RunWriter
from trainscale.runtime.dist import (
    all_reduce_max,
    all_reduce_sum,
    barrier,
    broadcast_object,
    is_distributed,
    is_main_process,
    world_size,
)
from trainscale.train.callbacks import Callbacks, Writes
from trainscale.train.checkpoint import load_checkpoint, rng_state, save_checkpoint, set_rng_state
from trainscale.train.ema import WeightAverage
from trainscale.train.loop import (
    Accumulator,
    EpochStep,
    NonFiniteGuard,
    PassStats,
    StepOptions,
    evaluate,
    predict,
    predict_selective,
    train_one_epoch,
    views_per_image,
)
from trainscale.train.precision import Precision, peak_memory_mb, reset_peak_memory, synchronize
from trainscale.train.step import (
    FALLBACK,
    CapturedForward,
    CapturedStep,
    StepFn,
    choose_step,
    compiled_eval,
    float_lrs,
    make_step,
)
from trainscale.train.steplog import StepLog
from trainscale.train.utilisation import Utilisation

log = logging.getLogger("trainscale.train")

TIMER_SCOPE = (
    "training steps only, device-synchronised: includes on-device augmentation and the optimizer step; "
    "excludes the initial data load and checksum, model construction, evaluation and checkpointing"
)
NOT_LEARNING = 1.05  # an epoch's mean loss this far above the first step's: diverging, not noise (chance-level
# data hovers within a few percent of its first loss)
REFERENCE_SCOPE = (
    "airbench's: the model's data-based init (the whitening fit), the training steps and the last epoch's "
    "evaluation (with its test-time augmentation); excludes data loading, model construction, compile "
    "warm-up, checkpoints and the earlier epochs' evaluations"
)


@dataclass
class RunState:
    """What a checkpoint restores besides the tensors: where the run is and its running totals."""

    next_epoch: int = 0
    elapsed_seconds: float = 0.0
    best_test_acc: float = 0.0
    time_to_target_seconds: float | None = None
    epoch_to_target: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Trainer:
    cfg: CoreConfig
    model: nn.Module
    optimizer: torch.optim.Optimizer
    precision: Precision
    train_batches: Batches
    test_batches: Batches
    lr_at: Callable[[float], float]
    summary_base: dict[str, Any]
    writer: RunWriter | None = None
    train_model: nn.Module | None = None
    callbacks: Callbacks = field(default_factory=Callbacks)
    baseline: dict[str, Any] | None = None
    state: RunState = field(default_factory=RunState)
    cores: float = 0.0  # what this worker may keep busy, for cpu_util (0: its torch threads)
    step_wrapping: str = "mode"  # what wraps the step (train.step.WRAPPINGS): none and ddp may compile it
    step_log: StepLog | None = None  # live metrics every --log-every steps (the main process)
    first_loss: float | None = field(default=None, init=False)  # the run's first step's, for _check_learning
    warned_not_learning: bool = field(default=False, init=False)
    step_fn: StepFn | None = field(default=None, init=False)  # a compiled step (train.step), else the eager one
    eval_model: nn.Module = field(init=False)  # what evaluates: the model or its compiled forward (``_eval_forward``)
    trained_steps: int = field(default=0, init=False)  # this process's steps in the last epoch it ran

    def __post_init__(self) -> None:
        """``model`` is the bare module (checkpoints, evaluation); ``train_model`` is what the mode
        wrapped it in (e.g. DDP) and is what the training steps call."""
        self.scaler = self.precision.grad_scaler()
        self.cores = self.cores or float(torch.get_num_threads())
        if self.train_model is None:
            self.train_model = self.model
        self.eval_model = self.model
        self.ema = WeightAverage(self.model, self.cfg.optim.ema) if self.cfg.optim.ema is not None else None
        self.step_options = StepOptions(self.cfg.optim.accumulate, self.cfg.optim.clip_grad_norm, self.ema)

    def resume(self) -> None:
        """Restore the last finished epoch from the run folder (same data order, same LR from there)."""
        assert self.writer is not None or not is_main_process()
        ckpt = self._shared_checkpoint()
        self.restore(ckpt)
        set_rng_state(ckpt["rng"])
        if self.writer is not None:
            self.writer.restore_history(self.state.next_epoch)
            self.writer.restore_steps(self.state.next_epoch)
            log.info("resumed from %s after epoch %d", self.writer.checkpoint_path, self.state.next_epoch)

    def snapshot(self) -> dict[str, Any]:
        """The whole training state but the RNGs: what a checkpoint holds, and what a healing replica copies."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "state": self.state.to_dict(),
            "mode": self.callbacks.state_dict(),
            **({"ema": self.ema.state_dict()} if self.ema is not None else {}),
        }

    def restore(self, snapshot: dict[str, Any]) -> None:
        self.model.load_state_dict(snapshot["model"])
        self.optimizer.load_state_dict(snapshot["optimizer"])
        self.scaler.load_state_dict(snapshot["scaler"])
        self.state = RunState(**snapshot["state"])
        self.callbacks.load_state_dict(snapshot.get("mode") or {})
        if self.ema is not None and "ema" in snapshot:
            self.ema.load_state_dict(snapshot["ema"])

    def heal_state(self) -> dict[str, Any]:
        """What a peer healing from this process copies: the training state (``snapshot``) and the run's rows
        this process knows (``RunWriter.history``, its own rows of epochs another wrote among them), so that the
        healed one, elected later, writes an epoch whose elected writer died before writing it."""
        return {**self.snapshot(), "rows": list(self.writer.history) if self.writer is not None else []}

    def heal_from(self, state: dict[str, Any]) -> None:
        """Take a peer's ``heal_state``."""
        self.restore(state)
        if self.writer is not None:
            self.writer.adopt(state.get("rows") or [])

    def _shared_checkpoint(self) -> dict[str, Any]:
        """The main process reads the checkpoint and sends it to every rank, so all resume from the same
        state even when only node 0 has the run folder (an error there is raised on every rank)."""
        if not is_distributed():
            assert self.writer is not None  # the only process is the main one (see ``resume``)
            return load_checkpoint(self.writer.checkpoint_path, map_location=self.precision.device)
        loaded: tuple[str, Any] = ("ok", None)
        if self.writer is not None:
            try:
                loaded = ("ok", load_checkpoint(self.writer.checkpoint_path, map_location="cpu"))
            except ConfigError as exc:
                loaded = ("error", str(exc))
        status, value = broadcast_object(loaded)
        if status == "error":
            raise ConfigError(value)
        return value

    def fit(self) -> dict[str, Any]:
        self.callbacks.before_fit(self.heal_state, self.heal_from)
        if is_main_process() and self.state.next_epoch < self.cfg.optim.epoch_count:
            log.info("%s", self.start_line())
        choice = choose_step(
            self.cfg.run.train_step,
            self.precision.device,
            self.cfg.run.precision,
            self.step_wrapping,
            self.cfg.optim.nonfinite,
            self.cfg.optim.accumulate,
            self.cfg.optim.clip_grad_norm,
            user_model=not is_builtin_model(self.cfg.data.model),
        )
        self._use_step(choice.kind, choice.reason)
        warm = self.cfg.run.compile or self.precision.device.type == "cuda" or self.step_fn is not None
        if warm and self.train_model is self.model:  # a wrapper's (DDP's) hooks would see the backward
            self.summary_base[K.warmup_seconds] = self._warm_up_or_fall_back()
        if isinstance(self.step_fn, CapturedStep):
            self.step_fn.seal()
        with heap_frozen():
            for epoch in range(self.state.next_epoch, self.cfg.optim.epoch_count):
                row = self.run_epoch(epoch)
                self._record(row)
                barrier()
        return self.summary()

    def _record(self, row: dict[str, Any]) -> None:
        """The epoch's row, the summary and the checkpoint into the run folder where this process writes it now;
        where another was elected (its writer and this one take turns), the row is kept by this one's writer, in
        case the one elected dies before writing it."""
        if self.writer is None:
            return
        writes = self.callbacks.writes_run_folder()
        assert writes is not Writes.SHARED or self.writer.shared, "a mode that writes in turns needs shared writers"
        if writes is Writes.NOT_NOW:
            self.writer.keep_epoch(row)
            return
        healed_as_it_ended = writes is Writes.SHARED and self.trained_steps == 0  # trained none of the epoch
        if not (healed_as_it_ended and self.writer.take_written(row[K.epoch])):  # else the trainers' row stands
            self.writer.add_epoch(row)
        self.writer.write_summary(self.summary())
        self._checkpoint()

    def start_line(self) -> str:
        """What the run is before its first epoch: the run folder, device(s), world size and recipe."""
        base, env = self.summary_base, self.summary_base.get(K.environment) or {}
        device = env.get("device_name") or env.get("device") or str(self.precision.device)
        world = base.get(K.world_size) or 1
        devices = f"{world} x {device}" if world > 1 else device
        return (
            f"run folder {base.get(K.out) or '(none)'}; {base.get(K.model)} on {base.get(K.dataset)}, "
            f"{devices}, world size {world}, mode {base.get(K.mode)}, recipe {self.cfg.optim.recipe or 'none'}"
        )

    def _use_step(self, kind: str, reason: str) -> None:
        """Train with the ``kind`` step from now on (built here), recorded for summary.json with ``reason``."""
        self.summary_base.update({K.train_step: kind, K.train_step_reason: reason})
        self._evaluate_with(self._eval_forward(kind))
        if kind == "eager":
            self.step_fn = None
            float_lrs(self.optimizer)
            return
        self.step_fn = make_step(
            kind,
            self.train_model or self.model,
            self.optimizer,
            self.precision,
            self.cfg.optim.label_smoothing,
            compile_mode=self.cfg.run.compile_mode,
        )

    def _eval_forward(self, kind: str) -> nn.Module:
        """What evaluates: on a GPU beside a compiled training step, the model compiled for the evaluation's shapes
        too (``step.compiled_eval``), and beside the captured step those compiled forwards captured as CUDA graphs
        (``step.CapturedForward``); the module itself elsewhere, where ``--compile`` compiled it already, and
        under a wrapper (DDP), where no warm-up runs to compile it (and to fall back if it fails)."""
        unwarmed = self.train_model is not self.model  # set in ``__post_init__``: the model, or its wrapper
        if kind == "eager" or self.precision.device.type != "cuda" or self.cfg.run.compile or unwarmed:
            return self.model
        compiled = compiled_eval(self.model)
        return CapturedForward(compiled) if kind == "captured" else compiled

    def _evaluate_with(self, model: nn.Module) -> None:
        self.eval_model = model
        forward = "captured" if isinstance(model, CapturedForward) else "compiled"
        self.summary_base[K.eval_forward] = "eager" if model is self.model else forward

    def _warm_up_or_fall_back(self) -> float:
        """The warm-up; where ``--train-step auto`` chose a step that fails to compile or capture there, the next
        one of ``FALLBACK`` (captured, then graphed, then eager), said in the log and in summary.json's
        ``train_step_reason``. Each failed try leaves nothing behind (``warm_up`` puts everything back)."""
        failures: list[str] = []
        while True:
            try:
                return self.warm_up()
            except Exception as exc:  # torch.compile's and CUDA graphs' failures have no common type
                if self.step_fn is None or self.cfg.run.train_step != "auto":
                    raise
                kind = self.summary_base[K.train_step]
                failure = f"{type(exc).__name__}: {exc}".splitlines()[0]
                failures.append(f"the {kind} step failed in the warm-up ({failure})")
                why = "auto: " + "; ".join(failures)
                log.warning("%s; training with the %s step", why, FALLBACK[kind])
                self._use_step(FALLBACK[kind], why)

    def warm_up(self) -> float:
        """``torch.compile`` compiles on first use (CUDA graphs record on the first replays), and on a GPU the
        first passes also pick cuDNN's algorithms and create the cuBLAS handles; do that here, before any timer,
        for every shape and path the run meets: the training step as the epoch loop takes it (``_loop_step``;
        with ``step_fn``, the compiled step, optimizer included), and the evaluation of every batch size the test
        set yields (its last partial batch too) with every test-time view of the run. On random images, not the
        run's data; then weights, BN statistics, optimizer state, the weight average and RNGs are put back in
        place (compiled graphs keep their tensors), so that one-off cost stays out of every timer (airbench's
        warm-up run). Returns its seconds."""
        started = time.perf_counter()
        saved, rng = copy.deepcopy(self.model.state_dict()), rng_state()
        state = optimizer_state(self.optimizer)
        averaged = copy.deepcopy(self.ema.state_dict()) if self.ema is not None else None
        device, batch = self.precision.device, self.summary_base[K.batch_per_worker]
        size = self.summary_base[K.image_size]
        layout = torch.channels_last if self.cfg.run.channels_last else torch.contiguous_format
        images = torch.randn(batch, 3, size, size, device=device).contiguous(memory_format=layout)
        labels = torch.zeros(batch, dtype=torch.int64, device=device)
        if isinstance(self.train_batches, DeviceBatches):  # the on-device augmentation of an epoch, drawn again
            next(iter(self.train_batches.epoch(self.state.next_epoch)), None)  # by the epoch (its own generators)
        try:
            self._warm_train(images, labels)
            self._warm_eval(size, layout)
        finally:  # also when a step fails (a compiled one that cannot compile, say): nothing of it stays
            self.model.zero_grad(set_to_none=self.step_fn is None)  # a compiled step keeps its gradient tensors
            self.model.train()
            self.model.load_state_dict(saved)
            restore_optimizer_state(self.optimizer, state)
            if self.ema is not None and averaged is not None:
                self.ema.load_state_dict(averaged)
            set_rng_state(rng)
        synchronize(device)
        return time.perf_counter() - started

    def _warm_eval(self, size: int, layout: torch.memory_format) -> None:
        """The evaluation of every batch size the test set yields, with every view the run's evaluations take;
        where the captured evaluation fails here, the run evaluates with the compiled forward, and where that
        fails, eagerly (its training step stays)."""
        while True:
            try:
                self._eval_shapes(self.eval_model, size, layout)
                return
            except Exception as exc:  # torch.compile's and CUDA graphs' failures have no common type
                if self.eval_model is self.model:
                    raise
                failed = self.summary_base[K.eval_forward]
                nxt = self.eval_model.compiled if isinstance(self.eval_model, CapturedForward) else self.model
                self._evaluate_with(nxt)
                failure = f"{type(exc).__name__}: {exc}".splitlines()[0]
                log.warning(
                    "the %s evaluation failed in the warm-up (%s); evaluating %s",
                    failed,
                    failure,
                    "eagerly" if nxt is self.model else "with the compiled forward",
                )

    def _eval_shapes(self, model: nn.Module, size: int, layout: torch.memory_format) -> None:
        model.eval()
        optim, device = self.cfg.optim, self.precision.device
        with torch.no_grad(), self.precision.autocast():
            for n in eval_batch_sizes(self.test_batches):
                x = torch.randn(n, 3, size, size, device=device).contiguous(memory_format=layout)
                predict(model, x, optim.tta)
                predict_selective(model, x, optim.tta, optim.tta_translate, optim.tta_select)

    def _warm_train(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        self.model.train()
        if self.step_fn is None and self.scaler.is_enabled():
            # fp16: a step on random images would move the grad scaler's scale, which has no copy to restore
            with self.precision.autocast():
                loss = nn.functional.cross_entropy(self.model(images).float(), labels)
            loss.backward()
            return
        self._warm_steps(self._loop_step(), images, labels)

    def _loop_step(self) -> Callable[[torch.Tensor, torch.Tensor], Any]:
        """The step as the epoch loop takes it (``loop.EpochStep``): the schedule's learning rates set, the step
        itself (compiled, or the eager one with its optimizer: Muon compiles its iteration on first use), the
        stop guard's record, the weight average and the running sums, so that none of their kernels is first
        launched (on a GPU: loaded) inside the first timed epoch. The guard only records: nothing is read."""
        device, epoch, optim = self.precision.device, self.state.next_epoch, self.cfg.optim
        guard = NonFiniteGuard(device, epoch, self.lr_at, WARM_STEPS)
        run = EpochStep(
            self.model,
            self.optimizer,
            self.scaler,
            self.precision,
            self.lr_at,
            optim.label_smoothing,
            guard,
            Accumulator(device),
            self.step_fn,
            self.step_options,
        )
        return functools.partial(run, 0, float(epoch))

    def _warm_steps(
        self, step: Callable[[torch.Tensor, torch.Tensor], Any], images: torch.Tensor, labels: torch.Tensor
    ) -> None:
        """The step as the run meets it: with every parameter training, then, where the model trains some only
        at first (``train_until``, frozen by ``freeze_finished``), with each set of them frozen that the run meets
        as their epochs end (another graph each when compiled)."""
        until = getattr(self.model, "train_until", {})
        named = dict(self.model.named_parameters())
        names = [n for n in until if n in named and named[n].requires_grad]
        kept = {named[n]: named[n].grad for n in names}  # a compiled step's gradient tensors, back after
        stages = [[named[n] for n in names if until[n] <= end] for end in sorted({until[n] for n in names})]
        for frozen in ([], *stages):
            freeze(frozen)
            for _ in range(WARM_STEPS):
                step(images, labels)
        for p, grad in kept.items():
            p.requires_grad_(True)
            p.grad = grad

    def run_epoch(self, epoch: int) -> dict[str, Any]:
        reset_peak_memory(self.precision.device)
        self.freeze_finished(epoch)
        self.callbacks.before_train_epoch(epoch)
        assert self.train_model is not None  # set in ``__post_init__``
        with Utilisation(self.precision.device, self.cores) as busy:
            train = train_one_epoch(
                self.train_model,
                self.train_batches,
                self.optimizer,
                self.scaler,
                self.precision,
                self.lr_at,
                epoch,
                self.cfg.optim.label_smoothing,
                self.cfg.run.progress,
                self.cfg.optim.nonfinite,
                self.step_fn,
                self.step_log,
                self.step_options,
                self.cfg.optim.steps_in_epoch(epoch, len(self.train_batches)),
            )
        if train.skipped_steps and is_main_process():
            log.warning(
                "epoch %d: skipped %d step(s) with a non-finite loss or gradients (--nonfinite skip)",
                epoch + 1,
                train.skipped_steps,
            )
        self.callbacks.after_train_epoch(self.model)
        self.trained_steps = train.steps
        train.samples = self.callbacks.epoch_samples(train.samples)
        last = epoch + 1 == self.cfg.optim.epoch_count
        translate = self.cfg.optim.tta_translate if last else 0
        select = self.cfg.optim.tta_select if last else 1.0
        test = (
            evaluate(self.eval_model, self.test_batches, self.precision, self.cfg.optim.tta, translate, select)
            if self.evaluates(epoch)
            else None
        )
        averaged = self._evaluate_average(translate) if test else None
        self._account(epoch, train, test)
        self._check_learning(epoch, train)
        views: dict[str, int] = {K.test_views: views_per_image(self.cfg.optim.tta, translate) if test else 0}
        row = merge(
            self._row(epoch, train, test),
            views,
            {K.ema_test_loss: averaged.loss, K.ema_test_acc: averaged.acc} if averaged else {},
            mean_over_workers(busy.result()),
            self.callbacks.epoch_stats(),
            file=METRICS,
        )
        tested = f"test loss {test.loss:.4f} acc {test.acc:.4f}" if test else "not evaluated (--eval-every)"
        if averaged:
            tested += f" (EMA: {averaged.acc:.4f})"
        full = len(self.train_batches)
        part = "" if train.steps == full else f" ({train.steps} of {full} steps)"
        log.info(
            "epoch %d/%d%s: train loss %.4f acc %.4f | %s | %.1fs, %.0f img/s",
            epoch + 1,
            self.cfg.optim.epoch_count,
            part,
            train.loss,
            train.acc,
            tested,
            row[K.epoch_seconds],
            row[K.samples_per_sec],
        )
        return row

    def _evaluate_average(self, translate: int) -> PassStats | None:
        """The weight average's test figures (``--ema``), its BatchNorm statistics first made the same on every
        rank."""
        if self.ema is None:
            return None
        self.ema.average_over_ranks()
        return evaluate(self.ema.module, self.test_batches, self.precision, self.cfg.optim.tta, translate)

    def evaluates(self, epoch: int) -> bool:
        """Whether epoch ``epoch`` (0-based) ends with an evaluation: every ``eval_every``-th and the last."""
        every = self.cfg.run.eval_every
        return epoch + 1 == self.cfg.optim.epoch_count or (every > 0 and (epoch + 1) % every == 0)

    def freeze_finished(self, epoch: int) -> None:
        """A parameter whose training has ended (``model.train_until``; its lr is zero from then on) stops taking
        gradients, so backward stops short of it: airbench94's whitening bias, after which the first conv's input
        gradient is no longer computed (~7% of a step). Not inside a process group (a DDP reducer or a parameter
        server waits for every parameter's gradient); torchft replicas, each a world of its own, all freeze at the
        same epoch, so the gradients they average still match."""
        if is_distributed():
            return
        until = getattr(self.model, "train_until", {})
        freeze([p for n, p in self.model.named_parameters() if n in until and epoch >= until[n]])

    def _account(self, epoch: int, train: PassStats, test: PassStats | None) -> None:
        slowest = float(all_reduce_max(torch.tensor([train.seconds], dtype=torch.float64)).item())
        train.seconds = slowest
        self.state.next_epoch = epoch + 1
        self.state.elapsed_seconds += slowest
        if test is None:
            return
        self.state.best_test_acc = max(self.state.best_test_acc, test.acc)
        target = self.cfg.run.target_acc
        if target is not None and self.state.time_to_target_seconds is None and test.acc >= target:
            self.state.time_to_target_seconds = self.state.elapsed_seconds
            self.state.epoch_to_target = epoch + 1

    def _check_learning(self, epoch: int, train: PassStats) -> None:
        """One warning when a whole epoch's mean training loss stays above the run's first step's (by 5%): the run
        is not learning, nearly always a learning rate too high for this model and batch."""
        if epoch == 0:
            self.first_loss = train.first_loss
        if self.first_loss is None or self.warned_not_learning or train.loss <= NOT_LEARNING * self.first_loss:
            return
        if not self.summary_base[K.lr]:  # --lr 0 asks for no learning: nothing to warn of
            return
        self.warned_not_learning = True
        if is_main_process():
            log.warning(
                "epoch %d: the mean training loss %.3f is above the first step's %.3f: the run is not "
                "learning; the learning rate (%g at batch %d) is probably too high for %s: lower --lr and "
                "start again",
                epoch + 1,
                train.loss,
                self.first_loss,
                self.summary_base[K.lr],
                self.summary_base[K.batch_size],
                self.cfg.data.model,
            )

    def _row(self, epoch: int, train: PassStats, test: PassStats | None) -> dict[str, Any]:
        memory = float(all_reduce_max(torch.tensor([peak_memory_mb(self.precision.device)])).item())
        return {
            K.epoch: epoch + 1,
            K.lr: float(self.optimizer.param_groups[0]["lr"]),
            K.train_loss: train.loss,
            K.train_acc: train.acc,
            K.test_loss: test.loss if test else None,
            K.test_acc: test.acc if test else None,
            K.epoch_seconds: train.seconds,
            K.eval_seconds: test.seconds if test else 0.0,
            K.step_seconds: train.seconds / train.steps if train.steps else None,
            K.elapsed_seconds: self.state.elapsed_seconds,
            K.samples_per_sec: train.samples / train.seconds if train.seconds > 0 else 0.0,
            K.train_samples: train.samples,
            K.peak_memory_mb: memory,
            K.world_size: self.summary_base[K.world_size],
            K.skipped_steps: train.skipped_steps,
        }

    def _reference_scope(self, rows: list[dict[str, Any]]) -> dict[str, Any] | None:
        """Only for a run that has finished all its epochs (the reference times a whole run)."""
        count = self.cfg.optim.epoch_count
        if not rows or self.state.next_epoch < count or rows[-1][K.epoch] != count:
            return None
        if not self.cfg.optim.recipe or get_recipe(self.cfg.optim.recipe).reference is None:
            return None  # the reference's scope means something only for a run of the reference's recipe
        return reference_scope(
            self.summary_base.get(K.data_init_seconds) or 0.0,
            self.state.elapsed_seconds,
            rows[-1],
            self.cfg.run.target_acc,
        )

    def _checkpoint(self) -> None:
        if not self.cfg.run.checkpoint:
            return
        assert self.writer is not None  # ``fit`` checkpoints only where it writes
        save_checkpoint(self.writer.checkpoint_path, {**self.snapshot(), "rng": rng_state()})

    def summary(self) -> dict[str, Any]:
        """summary.json from its producers' parts (``record.merge``, a later part winning): the run's
        description, the engine's results, the mode's figures, the step split; then what is derived from
        those (the dilated cluster's projection, the scaling against ``--baseline``)."""
        rows = self.writer.history if self.writer else []
        summary = merge(self.summary_base, self._results(rows), self.callbacks.run_stats(), step_split(rows))
        for derived in self.callbacks.derived_stats():
            summary = merge(summary, derived(summary))
        return merge(summary, self._scaling(summary))

    def _scaling(self, summary: dict[str, Any]) -> dict[str, Any]:
        if self.baseline is None or not summary[K.samples_per_sec]:
            return {}
        return {
            K.scaling_efficiency: scaling_efficiency(summary, self.baseline),
            K.scaling_baseline: {
                "out": self.baseline.get(K.out),
                "world_size": self.baseline.get(K.world_size),
                "config_mismatches": config_mismatches(summary, self.baseline),
            },
        }

    def _whole_epochs(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The rows of whole epochs: the last epoch of a fractional ``--epochs`` trains part of its steps, so its
        seconds are no epoch's (its step time is a step's like any other)."""
        optim = self.cfg.optim
        return [r for r in rows if r[K.epoch] != optim.epoch_count] if optim.partial_last_epoch else rows

    def _average_results(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        return _average_results_of(rows) if self.ema is not None else {}

    def _results(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        seconds = [r[K.epoch_seconds] for r in self._whole_epochs(rows)]
        samples = sum(r[K.train_samples] for r in rows)
        return {
            K.epochs_completed: self.state.next_epoch,
            K.best_test_acc: self.state.best_test_acc,
            K.final_test_acc: rows[-1][K.test_acc] if rows else None,
            **self._average_results(rows),
            K.mean_epoch_seconds: statistics.fmean(seconds) if seconds else None,
            K.steady_epoch_seconds: statistics.fmean(seconds[1:]) if len(seconds) > 1 else None,
            K.samples_per_sec: samples / self.state.elapsed_seconds if self.state.elapsed_seconds else None,
            K.peak_memory_mb: max((r[K.peak_memory_mb] for r in rows), default=None),
            K.total_train_seconds: self.state.elapsed_seconds,
            K.total_eval_seconds: sum(r[K.eval_seconds] for r in rows),
            K.skipped_steps: sum(r.get(K.skipped_steps, 0) for r in rows),
            K.target_acc: self.cfg.run.target_acc,
            K.time_to_target_seconds: self.state.time_to_target_seconds,
            K.epoch_to_target: self.state.epoch_to_target,
            K.timer_scope: TIMER_SCOPE,
            K.reference_scope: self._reference_scope(rows),
            **{key: _steady_mean(rows, key) for key in (K.cpu_util, K.gpu_util, K.gpu_clock_mhz, K.gpu_power_w)},
        }


WARM_STEPS = 3  # a compiled step compiles on the first, CUDA graphs record on the second and replay from the third


@contextlib.contextmanager
def heap_frozen() -> Iterator[None]:
    """The Python objects alive before the first epoch (after a compiled warm-up some 420,000: torch.compile's
    graphs, guards and kernels) kept out of the garbage collector's full passes while the epochs run, then handed
    back. A full pass otherwise walks them all whenever it comes: 0.2 s on a 2-core CPU after the speedrun94
    warm-up, 0.3 ms with them frozen; inside a timed epoch that is a pause of the host that feeds the GPU. (No
    collection first: it would cost that pause once more; garbage caught in the freeze waits for a pass after.)"""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def eval_batch_sizes(batches: Batches) -> list[int]:
    """The batch sizes an evaluation pass yields: the full one and the last partial one, if any."""
    full, total = getattr(batches, "batch_size", 0), getattr(batches, "shard_size", 0)
    if not full or not total:
        return []
    return sorted({min(full, total), total % full} - {0}, reverse=True)


def optimizer_state(optimizer: torch.optim.Optimizer) -> dict[int, dict[str, Any]]:
    """A copy of the optimizer's per-parameter state (tensors cloned, counters copied), by parameter id."""
    return {
        id(p): {k: v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v) for k, v in st.items()}
        for p, st in optimizer.state.items()
    }


def freeze(params: list[nn.Parameter]) -> None:
    """No gradient for ``params`` from now on, and none kept: an optimizer skips a parameter without one, as in an
    eager step; a compiled step's zeroed gradient tensor would have it stepped on its momentum alone (LARS, whose
    lr comes before its momentum, moved a frozen parameter that way)."""
    for p in params:
        p.requires_grad_(False)
        p.grad = None


STATE_STARTS = {"mu_product": 1.0}  # state torch creates at another value than zero (NAdam's running product)


def restore_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict[int, dict[str, Any]]) -> None:
    """Put the state ``optimizer_state`` copied back, tensors in place (a captured step keeps reading them).
    State created since is set in place to where it starts (zero, or ``STATE_STARTS``: an SGD or Muon momentum
    buffer at zero takes its first step exactly as one not yet made), or dropped where it holds a counter off
    the device (LAMB's step): fresh again."""
    for p, st in optimizer.state.items():
        old = saved.get(id(p)) or {}  # none then, or an empty entry (a lookup in torch's defaultdict makes one)
        if not old and not all(isinstance(v, torch.Tensor) for v in st.values()):
            st.clear()
            continue
        for k, v in st.items():
            was = old.get(k)
            if isinstance(v, torch.Tensor):
                v.copy_(was) if was is not None else v.fill_(STATE_STARTS.get(k, 0.0))
            else:
                st[k] = was


def _average_results_of(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The weight average's final and best test accuracy (``--ema``), beside the model's."""
    accs = [r[K.ema_test_acc] for r in rows if r.get(K.ema_test_acc) is not None]
    if not accs:
        return {}
    return {K.ema_final_test_acc: rows[-1].get(K.ema_test_acc), K.ema_best_test_acc: max(accs)}


def reference_scope(
    data_init_seconds: float, train_seconds: float, last: dict[str, Any], target: float | None
) -> dict[str, Any]:
    """The run's time as airbench counts it (``REFERENCE_SCOPE``), and its time to ``target`` in that scope: the
    whole time when the last evaluation reaches the target (the reference judges only that one), else None."""
    seconds = data_init_seconds + train_seconds + last[K.eval_seconds]
    reached = target is not None and last[K.test_acc] >= target
    return {
        "name": "airbench",
        "seconds": seconds,
        "test_acc": last[K.test_acc],
        "test_views": last.get(K.test_views),
        "target_acc": target,
        "time_to_target_seconds": seconds if reached else None,
        "scope": REFERENCE_SCOPE,
    }


def step_split(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The steady epochs' (all after the first, when there are several) mean step time and, where the mode
    measures it per epoch (``comm_seconds_per_step``), its split into communication and compute, so that
    both halves come from the same epochs; likewise the exchange's own split (encode, in flight, hidden
    under backward, decode) where the mode reports it."""
    steady = rows[1:] if len(rows) > 1 else rows
    steps = [r[K.step_seconds] for r in steady if r.get(K.step_seconds)]
    if not steps or len(steps) != len(steady):
        return {}
    out: dict[str, Any] = {K.step_seconds: statistics.fmean(steps)}
    comm = [r[K.comm_seconds_per_step] for r in steady if r.get(K.comm_seconds_per_step) is not None]
    if len(comm) == len(steady):
        out[K.comm_seconds_per_step] = statistics.fmean(comm)
        out[K.compute_seconds_per_step] = max(0.0, out[K.step_seconds] - out[K.comm_seconds_per_step])
    for key in EXCHANGE_SPLIT:
        values = [r[key] for r in steady if r.get(key) is not None]
        if len(values) == len(steady):
            out[key] = statistics.fmean(values)
    return out


def _steady_mean(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in (rows[1:] if len(rows) > 1 else rows) if r.get(key) is not None]
    return statistics.fmean(values) if values else None


def mean_over_workers(values: dict[str, float | None]) -> dict[str, float | None]:
    """Each figure's mean over the workers (None where this worker has none, e.g. no NVML)."""
    present = {k: v for k, v in values.items() if v is not None}
    keys = sorted(present)
    if not keys:
        return dict(values)
    summed = all_reduce_sum(torch.tensor([float(present[k]) for k in keys], dtype=torch.float64)) / world_size()
    return {**values, **{k: float(v) for k, v in zip(keys, summed.tolist())}}
