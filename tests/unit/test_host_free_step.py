"""Nothing on the host inside a training step: the loop's step (``loop.EpochStep``) reads no value from the
device (``aten::_local_scalar_dense``: ``.item()``, ``bool()``, ``float()``), for SGD and batched Muon, fp32 and
bf16; the epoch reads the device only where documented (the stop guard every ``CHECK_EVERY`` steps and after
the last, the first loss and the sums at the epoch's end). The compiled step (``--train-step compiled``) gives
the eager step's parameters; ``--train-step`` auto picks eager on a CPU, and the choice reaches summary.json."""

from __future__ import annotations

import contextlib
import copy
import gc
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from trainscale.app.config import build_config
from trainscale.app.run import build_trainer
from trainscale.config import CoreConfig
from trainscale.data import AugmentConfig, DeviceBatches, synthetic_dataset
from trainscale.errors import ConfigError
from trainscale.models import MODELS, is_builtin_model
from trainscale.models.airbench import AirbenchNet, airbench94
from trainscale.modes.base import LocalMode
from trainscale.results import read_history
from trainscale.runtime.job import Job
from trainscale.train import loop
from trainscale.train import trainer as trainer_module
from trainscale.train.checks import check_step
from trainscale.train.loop import EpochStep, NonFiniteGuard, evaluate, predict, predict_selective, train_one_epoch
from trainscale.train.optimizers import build_optimizer
from trainscale.train.precision import Precision
from trainscale.train.step import (
    CAPTURE_WARM_STEPS,
    CapturedForward,
    CapturedStep,
    StepChoice,
    StepNotCaptured,
    choose_step,
    compiled_eval,
    compiled_step,
    create_state,
)
from trainscale.train.trainer import eval_batch_sizes, optimizer_state, restore_optimizer_state

CPU = torch.device("cpu")
SMALL_RUN = dict(
    model="mlp", dataset="synthetic", train_subset=128, test_subset=64, batch_size=64, epochs=2, progress=False
)
STEPS = 12  # a guard read at step 10 and after step 12


class HostReads(TorchDispatchMode):
    """Counts the ops that copy a device value to the host (a sync on a GPU)."""

    READS = {torch.ops.aten._local_scalar_dense.default}

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in self.READS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def batches(n: int = 8 * STEPS) -> DeviceBatches:
    return DeviceBatches(
        synthetic_dataset(n, 32, seed=1), 8, train=True, augment=AugmentConfig(crop_padding=2), device=CPU, seed=2
    )


def setup(optimizer: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = airbench94(widths=(8, 16, 16)).to(memory_format=torch.channels_last)
    cfg = CoreConfig()
    cfg.optim.optimizer, cfg.optim.muon_lr = optimizer, 0.1
    return model, build_optimizer(cfg, model, lr=0.05)


@pytest.mark.parametrize(("optimizer", "precision"), [("sgd", "fp32"), ("muon", "bf16")])
def test_no_host_read_inside_a_step_and_only_the_documented_ones_in_an_epoch(
    optimizer: str, precision: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, opt = setup(optimizer)
    prec = Precision(precision, CPU)
    in_steps = HostReads()
    step = EpochStep.__call__

    def counted(self: EpochStep, *args: Any) -> torch.Tensor:
        with in_steps:
            return step(self, *args)

    monkeypatch.setattr(EpochStep, "__call__", counted)
    in_epoch = HostReads()
    with in_epoch:
        stats = train_one_epoch(model, batches(), opt, prec.grad_scaler(), prec, lambda t: 0.05, 0, 0.2, False)
    assert stats.steps == STEPS and stats.first_loss is not None
    assert in_steps.count == 0
    guard_reads = -(-STEPS // NonFiniteGuard.CHECK_EVERY)
    assert in_epoch.count == guard_reads + 1  # + the first loss, read once the epoch is over


def test_the_stop_guard_still_names_the_first_bad_step_from_its_device_record() -> None:
    guard = NonFiniteGuard(CPU, epoch=0, lr_at=lambda t: 0.1, steps=30)
    with HostReads() as reads:
        for step in range(7):
            guard.admit(step, torch.tensor(float("nan") if step >= 4 else 1.0), None)  # type: ignore[arg-type]
    assert reads.count == 0
    with pytest.raises(loop.NonFiniteLoss, match="at epoch 1 step 5"):
        for step in range(7, 10):
            guard.between_steps(step)


class Copied:
    """Stands in for ``torch.cuda.Event`` on a machine without a GPU: the copy it marks is done."""

    def record(self) -> None: ...

    def synchronize(self) -> None: ...


def test_on_a_gpu_the_stop_guard_reads_mid_epoch_what_it_copied_at_its_previous_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A GPU's guard (its pinned copy and event stood in for) reads at each mid-epoch check the record copied at
    the previous one, so a NaN at step 5 stops training at the second check, named as step 5; the check after the
    epoch's last step reads the current record."""
    monkeypatch.setattr(torch.cuda, "Event", Copied)
    for nan_at, steps, stops_after in ((4, 40, 20), (33, 36, 36)):
        guard = NonFiniteGuard(CPU, epoch=0, lr_at=lambda t: 0.1, steps=steps)
        guard._copy = torch.full((), -1, dtype=torch.int64)  # where a GPU's guard copies its record to
        checked: list[int] = []
        with pytest.raises(loop.NonFiniteLoss, match=f"at epoch 1 step {nan_at + 1} "):
            for step in range(steps):
                guard.admit(step, torch.tensor(float("nan") if step == nan_at else 1.0), None)  # type: ignore[arg-type]
                checked.append(step + 1)
                guard.between_steps(step)
        assert checked[-1] == stops_after


def test_auto_is_eager_on_a_cpu_and_a_step_that_cannot_run_is_refused() -> None:
    cuda = torch.device("cuda")
    assert choose_step("auto", CPU, "bf16", "none", "stop").kind == "eager"
    assert choose_step("auto", cuda, "bf16", "none", "stop").kind == "captured"
    assert choose_step("auto", cuda, "bf16", "none", "stop", user_model=True).kind == "eager"
    assert choose_step("graphed", cuda, "bf16", "none", "stop").kind == "graphed"
    assert choose_step("auto", cuda, "fp16", "none", "stop").kind == "eager"
    assert "DDP" in choose_step("auto", cuda, "bf16", "ddp", "stop").reason
    assert choose_step("compiled", CPU, "fp32", "none", "stop").kind == "compiled"
    assert choose_step("compiled", cuda, "bf16", "ddp", "stop").kind == "compiled"
    with pytest.raises(ConfigError, match="cannot capture DDP's gradient hooks"):
        choose_step("graphed", cuda, "bf16", "ddp", "stop")
    with pytest.raises(ConfigError, match="the mode exchanges inside the step"):
        choose_step("compiled", cuda, "bf16", "mode", "stop")
    with pytest.raises(ConfigError, match="graphed .*CUDA graphs need a CUDA device"):
        choose_step("graphed", CPU, "fp32", "none", "stop")
    assert choose_step("captured", cuda, "bf16", "none", "stop") == StepChoice("captured", "asked for")
    with pytest.raises(ConfigError, match="captured .*CUDA graphs need a CUDA device"):
        choose_step("captured", CPU, "bf16", "none", "stop")
    with pytest.raises(ConfigError, match="captured .*cannot capture DDP's gradient hooks"):
        choose_step("captured", cuda, "bf16", "ddp", "stop")
    with pytest.raises(ConfigError, match="--nonfinite skip"):
        choose_step("compiled", CPU, "fp32", "none", "skip")


def epochs(model: torch.nn.Module, opt: torch.optim.Optimizer, step_fn: Any) -> Iterator[tuple[float, float]]:
    prec = Precision("fp32", CPU)
    for epoch in range(2):
        stats = train_one_epoch(
            model, batches(32), opt, prec.grad_scaler(), prec, lambda t: 0.05 * (1 - t / 4), epoch, 0.2, False,
            step_fn=step_fn,
        )  # fmt: skip
        yield stats.loss, stats.acc


def tiny(optimizer: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The smallest net with what the step must carry: a conv filter for Muon, BatchNorm, a head for SGD."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1, bias=False),
        torch.nn.BatchNorm2d(8),
        torch.nn.GELU(),
        torch.nn.AdaptiveMaxPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(8, 10),
    )
    cfg = CoreConfig()
    cfg.optim.optimizer, cfg.optim.muon_lr = optimizer, 0.1
    opt = build_optimizer(cfg, model, lr=0.05)
    opt.ns_dtype = torch.float32  # type: ignore[attr-defined]  # bf16 would amplify the kernels' rounding
    return model, opt


@pytest.mark.slow
def test_the_compiled_step_gives_the_eager_steps_parameters() -> None:
    """Two epochs (8 steps, a falling lr through the tensor lrs) eager and compiled from the same start, Muon on
    the filter and Nesterov SGD on the rest: the same parameters, losses and accuracies (the compiled step counts
    the correct predictions inside its graph). Through the ``aot_eager`` backend: the graphs the step is compiled
    into (forward with its backward, the optimizer step reading the tensor lrs) without inductor's kernel
    generation, which takes minutes on a shared 2-core CPU (the batched Muon's inductor graph is compared in
    test_muon)."""
    eager_model, eager_opt = tiny("muon")
    model, opt = tiny("muon")
    step_fn = compiled_step(model, opt, Precision("fp32", CPU), 0.2, graphed=False, backend="aot_eager")
    eager = list(epochs(eager_model, eager_opt, None))
    compiled = list(epochs(model, opt, step_fn))
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-5)
    for a, b in zip(model.state_dict().values(), eager_model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def replaying(run: Any) -> tuple[Any, tuple[torch.Tensor, ...]]:
    """A CPU stand-in for ``cuda_graph_capture`` that keeps a CUDA graph's contract: the warm steps run, the capture
    itself runs nothing, and every replay runs the step on what its input tensors hold then, writing the same
    output tensors."""
    for _ in range(CAPTURE_WARM_STEPS):
        last = run()
    outputs = tuple(torch.empty_like(t) for t in last)

    def replay() -> None:
        for out, new in zip(outputs, run()):
            out.copy_(new)

    return replay, outputs


def prime(
    step: CapturedStep, model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> None:
    """Capture ``step`` for batches shaped as ``x``, ``y`` as the trainer's warm-up does (on random images, then
    weights and optimizer state put back in place), and seal it."""
    saved, state = copy.deepcopy(model.state_dict()), optimizer_state(opt)
    step(torch.randn_like(x), torch.zeros_like(y))
    model.load_state_dict(saved)
    restore_optimizer_state(opt, state)
    model.zero_grad(set_to_none=False)
    step.seal()


@pytest.mark.slow
def test_the_captured_step_gives_the_eager_steps_parameters() -> None:
    """The whole-step capture (``--train-step captured``), primed as the trainer's warm-up primes it (a capture on
    random images, then weights and optimizer state put back in place) and sealed, trains two epochs as the eager
    step does: each replay reads the batch copied into its inputs and the lrs filled before it; and once sealed, a
    change the warm-up did not capture (a parameter frozen) is refused, not captured on the run's data."""
    eager_model, eager_opt = tiny("muon")
    model, opt = tiny("muon")
    inner = compiled_step(model, opt, Precision("fp32", CPU), 0.2, graphed=False, backend="aot_eager")
    step = CapturedStep(inner, model, opt, capture=replaying)
    x, y = next(iter(batches(32).epoch(0)))
    prime(step, model, opt, x, y)
    compiled = list(epochs(model, opt, step))
    eager = list(epochs(eager_model, eager_opt, None))
    assert len(step.graphs) == 1
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-5)
    for a, b in zip(model.state_dict().values(), eager_model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    next(model.parameters()).requires_grad_(False)
    with pytest.raises(StepNotCaptured, match="the warm-up did not capture; use --train-step graphed"):
        step(x, y)


def test_a_captured_step_refuses_an_optimizer_that_keeps_its_state_on_the_host() -> None:
    """LAMB counts its steps in a Python int: a captured graph would replay its first bias correction forever."""
    model, opt = tiny("lamb")
    inner = compiled_step(model, opt, Precision("fp32", CPU), 0.2, graphed=False, backend="aot_eager")
    x, y = next(iter(batches(32).epoch(0)))
    with pytest.raises(StepNotCaptured, match="keeps its step off the device.*use --train-step graphed"):
        CapturedStep(inner, model, opt, capture=replaying)(x, y)


def test_a_step_the_capture_refuses_is_one_line_that_names_the_way_out() -> None:
    """A CUDA graph cannot capture a read back to the host (Adafactor's ``.item()`` inside its step): torch's
    capture error becomes the step's own refusal, naming the step that runs it."""

    def refusing(run: Any) -> Any:
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore detail")

    model, opt = tiny("sgd")
    inner = compiled_step(model, opt, Precision("fp32", CPU), 0.2, graphed=False, backend="aot_eager")
    x, y = next(iter(batches(32).epoch(0)))
    with pytest.raises(StepNotCaptured, match=r"read back to the host.*when stream is capturing; use --train-step"):
        CapturedStep(inner, model, opt, capture=refusing)(x, y)


@contextlib.contextmanager
def step_chosen(choice: StepChoice, make: Any) -> Iterator[None]:
    """The trainer choosing ``choice`` and building its step with ``make`` (``make_step``'s signature)."""
    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(trainer_module, "choose_step", lambda *a, **k: choice)
        patched.setattr(trainer_module, "make_step", make)
        yield


def aot_eager_step(
    kind: str, model: torch.nn.Module, opt: Any, precision: Precision, smoothing: float, **_: Any
) -> Any:
    """``make_step``'s compiled step without inductor's kernel generation (``aot_eager``), for ``step_chosen``."""
    return compiled_step(model, opt, precision, smoothing, graphed=False, backend="aot_eager")


def bias_for_one_epoch(num_classes: int = 10) -> torch.nn.Module:
    """A narrow airbench net whose whitening bias trains for the first epoch only."""
    return AirbenchNet(num_classes, widths=(8, 16, 16), output_scale=None, bias_epochs=1.0)


def small_airbench94(num_classes: int = 10) -> torch.nn.Module:
    """airbench94 narrowed (its whitening bias still trains for the first 3 epochs only)."""
    return airbench94(num_classes, widths=(8, 16, 16))


@pytest.mark.slow
def test_a_captured_run_trains_as_an_eager_run(tmp_path: Any) -> None:
    """Through the trainer, ``--train-step captured`` (captured on the CPU by ``replaying``, compiled by
    ``aot_eager``): the warm-up captures both graphs the airbench94 net needs (its whitening bias freezes after 3
    epochs), puts everything back and seals the step; the run's losses and accuracies are an eager run's."""
    steps: list[CapturedStep] = []

    def captured(kind: str, model: torch.nn.Module, opt: Any, precision: Precision, smoothing: float, **_: Any) -> Any:
        inner = compiled_step(model, opt, precision, smoothing, graphed=False, backend="aot_eager")
        steps.append(CapturedStep(inner, model, opt, capture=replaying))
        return steps[-1]

    def run(out: Any) -> tuple[dict[str, Any], list[tuple[float, float]]]:
        settings = {"model": f"{__name__}:small_airbench94", "epochs": 4, "train_subset": 256}
        summary = build_trainer(build_config(SMALL_RUN, {"out": str(out), **settings}), CPU, LocalMode(), Job()).fit()
        return summary, [(row["train_loss"], row["test_acc"]) for row in read_history(out)]

    with step_chosen(StepChoice("captured", "asked for"), captured):
        summary, rows = run(tmp_path / "captured")
    _, eager_rows = run(tmp_path / "eager")
    assert summary["train_step"] == "captured"
    assert len(steps[0].graphs) == 2 and steps[0].sealed
    torch.testing.assert_close(rows, eager_rows, rtol=1e-4, atol=1e-4)


def test_a_parameter_frozen_in_a_compiled_run_stays_where_an_eager_run_leaves_it(tmp_path: Any) -> None:
    """airbench94's whitening bias freezes after epoch 1 here; LARS puts the lr before its momentum, so a compiled
    step that kept the frozen bias's zeroed gradient went on stepping it on its momentum alone. Frozen, it has no
    gradient in either step, and both runs leave it where its last trained step put it."""

    def bias_after(out: Any) -> torch.Tensor:
        settings = {"model": f"{__name__}:bias_for_one_epoch", "epochs": 3, "train_subset": 128, "out": str(out)}
        cfg = build_config(SMALL_RUN, {**settings, "optimizer": "lars", "lr": 0.5, "momentum": 0.9})
        trainer = build_trainer(cfg, CPU, LocalMode(), Job())
        trainer.fit()
        return trainer.model.whiten.bias.detach().clone()

    with step_chosen(StepChoice("compiled", "asked for"), aot_eager_step):
        frozen_compiled = bias_after(tmp_path / "compiled")
    torch.testing.assert_close(frozen_compiled, bias_after(tmp_path / "eager"), rtol=1e-4, atol=1e-5)


class Scripted(torch.nn.Module):
    """Logits that depend on the image only through its mean pixel: confident for bright images, unsure for dim
    ones; each call counted with its batch size."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(x.shape[0])
        m = x.mean((1, 2, 3))
        return torch.stack([m * 10, torch.zeros_like(m)], 1)


def test_selective_tta_gives_the_extra_views_to_the_least_confident_fraction_only() -> None:
    x = torch.stack([torch.full((3, 8, 8), v) for v in (0.9, 0.01, 0.5, -0.02, 0.7, 0.03, 0.8, 0.6)])
    x[:, :, :, :4] += 0.001  # mirrored images differ a little
    model = Scripted()
    full = predict(model, x, flip=True, translate=1)
    model.calls.clear()
    mixed = predict_selective(model, x, flip=True, translate=1, select=0.25)
    assert model.calls == [8, 10]  # the plain view, then the 5 other views of the 2 least sure images at once
    plain = model(x).float()
    unsure = [1, 3]  # the dimmest: logits closest to a tie
    torch.testing.assert_close(mixed[unsure], full[unsure])
    sure = [i for i in range(8) if i not in unsure]
    torch.testing.assert_close(mixed[sure], plain[sure])
    torch.testing.assert_close(predict_selective(model, x, True, 1, 1.0), full)


def test_selective_views_in_one_forward_are_predicts_views_and_stay_within_twice_the_batch() -> None:
    """The chosen images' five extra views go through the model together, in forwards of at most twice the
    evaluation batch: with every image chosen, a conv net's logits are ``predict``'s to rounding."""
    CL = torch.channels_last
    torch.manual_seed(0)
    nn = torch.nn
    net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(256, 3))
    sizes: list[int] = []
    layouts: list[bool] = []
    net.register_forward_pre_hook(lambda _, args: sizes.append(args[0].shape[0]))
    net.register_forward_pre_hook(lambda _, args: layouts.append(args[0].is_contiguous(memory_format=CL)))
    net.eval()
    x = torch.randn(8, 3, 8, 8).contiguous(memory_format=CL)
    with torch.no_grad():
        full = predict(net, x, flip=True, translate=1)
        sizes.clear()
        every = predict_selective(net, x, flip=True, translate=1, select=0.999)  # k = 8 of 8, not predict's path
    assert sizes == [8, 16, 16, 8]  # the plain view, then 40 extra views in forwards of at most 16
    assert all(layouts)  # in the layout they came in (index_select alone would give NCHW)
    torch.testing.assert_close(every, full, rtol=1e-5, atol=1e-6)


def test_the_warm_up_meets_every_evaluation_batch_size() -> None:
    data = synthetic_dataset(1200, 32, seed=1)
    assert eval_batch_sizes(DeviceBatches(data, 500, train=False, augment=None, device=CPU)) == [500, 200]
    assert eval_batch_sizes(DeviceBatches(data, 600, train=False, augment=None, device=CPU)) == [600]
    assert eval_batch_sizes(DeviceBatches(data, 2000, train=False, augment=None, device=CPU)) == [1200]


@pytest.mark.parametrize("optimizer", ["muon", "lamb", "nadam"])
def test_the_warm_up_leaves_the_optimizer_as_a_fresh_one(optimizer: str) -> None:
    """After the warm-up's steps the state is put back (zeroed where it did not exist): the run's first step
    equals a fresh optimizer's, Nesterov SGD and Muon alike, LAMB, whose step count is a Python int, and NAdam,
    whose running product starts at 1."""
    warmed, fresh = tiny(optimizer), tiny(optimizer)
    for (model, opt), warm in ((warmed, True), (fresh, False)):
        saved, state = copy.deepcopy(model.state_dict()), optimizer_state(opt)
        if warm:
            for _ in range(2):
                model(torch.randn(4, 3, 8, 8)).sum().backward()
                opt.step()
                opt.zero_grad()
            model.load_state_dict(saved)
            restore_optimizer_state(opt, state)
        for seed in range(2):
            model(torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(seed))).sum().backward()
            opt.step()
            opt.zero_grad()
    for a, b in zip(warmed[0].state_dict().values(), fresh[0].state_dict().values()):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize(
    ("settings", "why"),
    [
        ({"precision": "fp16"}, "grad scaler"),
        ({"nonfinite": "skip"}, "--nonfinite skip"),
        ({"workers": 2, "mode": "localsgd"}, "the mode exchanges inside the step"),
        ({"workers": 2, "mode": "async"}, "the mode exchanges inside the step"),
        ({"workers": 2, "mode": "sync", "device": "cuda", "train_step": "graphed"}, "cannot capture DDP's"),
        ({"device": "cpu", "train_step": "graphed"}, "CUDA graphs need a CUDA device"),
        ({"device": "cpu", "train_step": "captured"}, "CUDA graphs need a CUDA device"),
        ({"workers": 2, "mode": "sync", "device": "cuda", "train_step": "captured"}, "cannot capture DDP's"),
        ({"accumulate": 2}, "--accumulate runs micro-batches outside"),
        ({"clip_grad_norm": 1.0}, "--clip-grad-norm is applied outside"),
    ],
)
def test_a_compiled_step_that_cannot_run_is_refused_before_training(settings: dict[str, Any], why: str) -> None:
    cfg = CoreConfig.from_flat({"train_step": "compiled", **settings})
    with pytest.raises(ConfigError, match=f"--train-step .*{why}"):
        check_step(cfg)
    check_step(CoreConfig.from_flat({**settings, "train_step": "eager"}))


def test_a_compiled_step_under_ddp_passes_the_checks() -> None:
    check_step(CoreConfig.from_flat({"train_step": "compiled", "workers": 2, "mode": "sync"}))


@pytest.mark.parametrize("step", ["compiled", "graphed"])
def test_a_compiled_step_is_checked_against_the_mode_the_run_resolves_to(step: str) -> None:
    """``--mode auto`` (the default) is a single local process here, which may compile its step (a check of the
    unresolved ``auto`` once refused every compiled step as "a mode that exchanges"); with parameter servers it
    is asynchronous and refused."""
    device = {"device": "cuda"} if step == "graphed" else {}
    if step == "compiled" or torch.cuda.is_available():
        assert build_config({"train_step": step, **device}).run.train_step == step
    with pytest.raises(ConfigError, match="the mode exchanges inside the step"):
        build_config({"train_step": "compiled", "servers": 1, "workers": 2})


@pytest.mark.parametrize("optimizer", ["muon", "sgd"])
def test_momentum_created_before_the_first_step_changes_no_step(optimizer: str) -> None:
    """A captured step needs its momentum buffers in place before the first capture (``create_state``); made
    at zero, they give the same three steps as buffers made by the first step."""
    runs = []
    for early in (True, False):
        model, opt = tiny(optimizer)
        if early:
            create_state(opt)
            assert all("momentum_buffer" in opt.state[p] for g in opt.param_groups for p in g["params"])
        for seed in range(3):
            model(torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(seed))).sum().backward()
            opt.step()
            opt.zero_grad()
        runs.append(model.state_dict())
    for a, b in zip(runs[0].values(), runs[1].values()):
        torch.testing.assert_close(a, b)


def test_the_compiled_step_compiles_once_not_every_step() -> None:
    """The compiled optimizer step guards on the gradient tensors: were they new each step (``zero_grad`` to
    None), it would recompile every step (on a GPU, most of a step's time). After the first epoch, no new graph."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model, opt = tiny("muon")
    step_fn = compiled_step(model, opt, Precision("fp32", CPU), 0.2, graphed=False, backend="aot_eager")
    graphs = []
    for _ in epochs(model, opt, step_fn):
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] > 0 and graphs[1] == graphs[0]


def test_auto_trains_eagerly_when_every_compiled_step_fails_in_the_warm_up(tmp_path: Any) -> None:
    """Steps ``--train-step auto`` tries that break in the warm-up (here after moving every weight, as a capture
    failing half-way might: the captured step, then the graphed one) leave nothing of themselves: the run trains
    with the eager step exactly as an eager run of the same seed does, and summary.json says why."""
    tried: list[str] = []

    def broken(kind: str, model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        tried.append(kind)

        def step(images: torch.Tensor, labels: torch.Tensor) -> Any:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
            raise RuntimeError(f"cannot capture this graph ({kind})")

        return step

    def run(out: Any) -> tuple[dict[str, Any], list[float]]:
        cfg = build_config(SMALL_RUN, {"out": str(out)})
        summary = build_trainer(cfg, CPU, LocalMode(), Job()).fit()
        return summary, [row["train_loss"] for row in read_history(out)]

    with step_chosen(StepChoice("captured", "auto: one process"), broken):
        summary, losses = run(tmp_path / "fell-back")
    eager_summary, eager_losses = run(tmp_path / "eager")
    assert tried == ["captured", "graphed"]
    assert summary["train_step"] == "eager"
    assert summary["train_step_reason"] == (
        "auto: the captured step failed in the warm-up (RuntimeError: cannot capture this graph (captured)); "
        "the graphed step failed in the warm-up (RuntimeError: cannot capture this graph (graphed))"
    )
    assert losses == eager_losses
    assert summary["final_test_acc"] == eager_summary["final_test_acc"]


@pytest.mark.slow
def test_auto_trains_with_the_graphed_step_where_the_optimizer_cannot_be_captured(tmp_path: Any) -> None:
    """LAMB keeps its step count on the host, which a captured step would freeze: ``auto``'s captured step is
    refused in the warm-up, and the run trains with the graphed one (on a CPU: captured by ``replaying``, the
    graphed step compiled by ``aot_eager`` without CUDA graphs) as an eager run does."""

    def steps(kind: str, model: torch.nn.Module, opt: Any, precision: Precision, smoothing: float, **_: Any) -> Any:
        inner = compiled_step(model, opt, precision, smoothing, graphed=False, backend="aot_eager")
        return CapturedStep(inner, model, opt, capture=replaying) if kind == "captured" else inner

    def run(out: Any) -> tuple[dict[str, Any], list[float]]:
        cfg = build_config(SMALL_RUN, {"out": str(out), "optimizer": "lamb", "lr": 0.01})
        summary = build_trainer(cfg, CPU, LocalMode(), Job()).fit()
        return summary, [row["train_loss"] for row in read_history(out)]

    with step_chosen(StepChoice("captured", "auto: one process"), steps):
        summary, losses = run(tmp_path / "graphed")
    _, eager_losses = run(tmp_path / "eager")
    assert summary["train_step"] == "graphed"
    assert summary["train_step_reason"].startswith(
        "auto: the captured step failed in the warm-up (StepNotCaptured: the optimizer keeps its step off the device"
    )
    torch.testing.assert_close(losses, eager_losses, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("extra", [{}, {"ema": 0.9}])
def test_a_warmed_up_run_trains_exactly_as_one_that_was_not(extra: dict[str, Any], tmp_path: Any) -> None:
    """The warm-up (training steps, the evaluation's shapes, an epoch's on-device augmentation) runs on a GPU before
    the timers; nothing of it may reach the run: weights, optimizer state, the weight average, random generators
    and data order."""
    histories = []
    for warm in (True, False):
        out = tmp_path / str(warm)
        cfg = build_config(SMALL_RUN, {"out": str(out), "model": "airbench", "train_subset": 256, **extra})
        trainer = build_trainer(cfg, CPU, LocalMode(), Job())
        if warm:
            trainer.warm_up()
        trainer.fit()
        histories.append([(r["train_loss"], r["test_acc"], r.get("ema_test_loss")) for r in read_history(out)])
    assert histories[0] == histories[1]
    assert all(row[2] is not None for row in histories[0]) == bool(extra)


def test_the_warm_up_steps_as_the_epoch_loop_does(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """The warm-up's steps are the loop's own (``EpochStep``: learning rates, the stop guard's record, the sums
    beside the step), a few with every parameter training and a few more after each freeze the run meets (the
    airbench net's whitening bias), so that the first timed epoch launches no kernel for the first time; its
    guard reads nothing."""
    calls: list[int] = []
    step = EpochStep.__call__

    def counted(self: EpochStep, *args: Any) -> torch.Tensor:
        calls.append(sum(p.requires_grad for p in self.model.parameters()))
        return step(self, *args)

    monkeypatch.setattr(EpochStep, "__call__", counted)
    cfg = build_config(SMALL_RUN, {"out": str(tmp_path), "model": "airbench94", "train_subset": 256})
    trainer = build_trainer(cfg, CPU, LocalMode(), Job())
    training = sum(p.requires_grad for p in trainer.model.parameters())
    with HostReads() as reads:
        trainer.warm_up()
    assert calls == [training] * trainer_module.WARM_STEPS + [training - 1] * trainer_module.WARM_STEPS
    assert reads.count == 0


def test_a_compiled_evaluation_predicts_as_the_eager_one_and_the_warm_up_compiles_all_it_meets() -> None:
    """``compiled_eval`` (``aot_eager`` here; inductor on a GPU) shares the model's weights, gives the eager
    accuracy and loss with every test-time view and selective ones, and after the warm-up's shapes (``_eval_shapes``) an
    evaluation pass compiles nothing more (its graphs are per batch shape: the full batch, the last partial one
    and the selected fractions of each)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model, _ = setup("sgd")
    data = synthetic_dataset(100, 32, seed=3)
    test = DeviceBatches(data, 32, train=False, augment=None, device=CPU, channels_last=True)
    compiled = compiled_eval(model, backend="aot_eager")
    compiled.eval()
    prec = Precision("fp32", CPU)
    with torch.no_grad():
        for x, _ in test.epoch(0):
            predict(compiled, x, True)
            predict_selective(compiled, x, True, 1, 0.25)
        warmed = counters["stats"]["unique_graphs"]
        for p in model.parameters():  # the compiled forward reads the weights at each call
            p.mul_(1.1)
    for flip, translate, select in ((True, 1, 0.25), (True, 0, 1.0)):
        eager = evaluate(model, test, prec, flip, translate, select)
        got = evaluate(compiled, test, prec, flip, translate, select)
        assert got.acc == eager.acc
        assert got.loss == pytest.approx(eager.loss, rel=1e-5)
    assert counters["stats"]["unique_graphs"] == warmed


def test_a_captured_evaluation_predicts_as_the_eager_one_with_a_graph_per_shape() -> None:
    """``CapturedForward`` (captured by ``replaying`` on a CPU, which keeps a CUDA graph's contract: one output
    tensor per graph, rewritten at each replay) gives the eager accuracy and loss with every view and selective
    ones, reads the weights where they are at each replay, keeps one graph per shape and layout the evaluation
    meets (a batch in another layout is copied into the captured one), and hands out logits that the next call of
    the same shape does not overwrite."""
    model, _ = setup("sgd")
    data = synthetic_dataset(100, 32, seed=3)
    test = DeviceBatches(data, 32, train=False, augment=None, device=CPU, channels_last=True)
    captured = CapturedForward(compiled_eval(model, backend="aot_eager"), capture=replaying)
    prec = Precision("fp32", CPU)
    evaluate(captured, test, prec, True, 1, 0.25)
    shapes = {key[:2] for key in captured.graphs}
    assert len(shapes) == len(captured.graphs) == 4  # the batch of 32, the last of 4, their selected views
    for p in model.parameters():
        p.data.mul_(1.1)
    for flip, translate, select in ((True, 1, 0.25), (True, 0, 1.0)):
        eager = evaluate(model, test, prec, flip, translate, select)
        got = evaluate(captured, test, prec, flip, translate, select)
        assert got.acc == eager.acc
        assert got.loss == pytest.approx(eager.loss, rel=1e-5)
    assert len(captured.graphs) == 4
    x = next(iter(test.epoch(0)))[0]
    with torch.no_grad():
        plain, mirrored = captured(x), captured(x.flip(3))
        torch.testing.assert_close(plain, model(x))
        torch.testing.assert_close(mirrored, model(x.flip(3)))
        torch.testing.assert_close(captured(x.contiguous()), plain)  # NCHW: copied into the channels_last graph
    assert len(captured.graphs) == 4


def test_a_captured_evaluation_captures_nothing_with_gradients_or_in_train_mode() -> None:
    """Only an evaluation's forward (no gradients, eval mode) is captured: a replayed graph keeps no autograd
    history and runs BatchNorm with the statistics it was captured with."""
    model, _ = setup("sgd")
    captured = CapturedForward(compiled_eval(model, backend="aot_eager"), capture=replaying)
    x = torch.randn(8, 3, 32, 32).contiguous(memory_format=torch.channels_last)
    captured.eval()
    assert captured(x).requires_grad
    captured.train()
    with torch.no_grad():
        captured(x)
    assert not captured.graphs


def test_the_evaluation_is_compiled_beside_a_compiled_step_on_a_gpu_only(tmp_path: Any) -> None:
    """``_eval_forward``: the model compiled for evaluation on a GPU beside a compiled, graphed or captured step,
    and captured in CUDA graphs beside the captured step; the module itself beside the eager step, on a CPU,
    where ``--compile`` compiled it already and under a wrapper (DDP), where no warm-up runs."""
    trainer = build_trainer(build_config(SMALL_RUN, {"out": str(tmp_path)}), CPU, LocalMode(), Job())
    assert trainer._eval_forward("captured") is trainer.model
    trainer.precision = Precision("fp32", torch.device("cuda"))
    assert trainer._eval_forward("eager") is trainer.model
    for kind in ("compiled", "graphed", "captured"):
        forward = trainer._eval_forward(kind)
        assert isinstance(forward, CapturedForward) == (kind == "captured")
        compiled = forward.compiled if isinstance(forward, CapturedForward) else forward
        assert getattr(compiled, "_orig_mod", None) is trainer.model
    trainer.cfg = build_config(SMALL_RUN, {"out": str(tmp_path), "compile": True})
    assert trainer._eval_forward("captured") is trainer.model
    trainer.cfg, trainer.train_model = (
        build_config(SMALL_RUN, {"out": str(tmp_path)}),
        torch.nn.Sequential(trainer.model),
    )
    assert trainer._eval_forward("compiled") is trainer.model


def test_the_evaluation_compiles_in_the_default_mode_beside_a_max_autotuned_step(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """max-autotune would time every convolution again for each evaluation batch shape: the evaluation's forward
    takes torch.compile's default mode whatever ``--compile-mode`` says."""
    modes: list[Any] = []
    monkeypatch.setattr(
        torch, "compile", lambda model, **kw: modes.append(kw.get("mode")) or torch.nn.Sequential(model)
    )
    trainer = build_trainer(
        build_config(SMALL_RUN, {"out": str(tmp_path), "compile_mode": "max-autotune"}), CPU, LocalMode(), Job()
    )
    trainer.precision = Precision("fp32", torch.device("cuda"))
    assert trainer._eval_forward("captured") is not trainer.model and modes == [None]


def eval_forwards(kind: str) -> Any:
    """A ``Trainer._eval_forward`` that gives what a GPU run evaluates with, on a CPU: ``compiled_eval``'s module
    (``aot_eager``), captured by ``replaying`` for ``captured``; the model itself for ``eager``."""

    def forward(self: trainer_module.Trainer, step_kind: str) -> torch.nn.Module:
        if kind == "eager" or step_kind == "eager":
            return self.model
        compiled = compiled_eval(self.model, backend="aot_eager")
        return CapturedForward(compiled, capture=replaying) if kind == "captured" else compiled

    return forward


@pytest.mark.parametrize("kind", ["compiled", "captured"])
def test_a_run_beside_a_compiled_step_evaluates_as_an_eager_evaluation_does(
    kind: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole run (warm-up, every evaluation) with ``compiled_eval``'s module, as on a GPU (``aot_eager`` here),
    and with it captured (``replaying`` here), of a model that is no ``nn.Sequential`` (a compiled module is never
    tested for truth: its ``len()`` raises): every epoch's test figures are those of an eager evaluation."""
    histories, summaries = [], []
    for forward in (kind, "eager"):
        monkeypatch.setattr(trainer_module.Trainer, "_eval_forward", eval_forwards(forward))
        out = tmp_path / forward
        with step_chosen(StepChoice("compiled", "asked for"), aot_eager_step):
            cfg = build_config(SMALL_RUN, {"out": str(out), "model": "resnet20", "tta": True})
            summaries.append(build_trainer(cfg, CPU, LocalMode(), Job()).fit())
        histories.append([(r["test_acc"], r["test_loss"]) for r in read_history(out)])
    assert summaries[0]["eval_forward"] == kind and summaries[0]["train_step"] == "compiled"
    assert [acc for acc, _ in histories[0]] == [acc for acc, _ in histories[1]]
    assert [loss for _, loss in histories[0]] == pytest.approx([loss for _, loss in histories[1]], rel=1e-5)


class Broken(torch.nn.Module):
    """A compiled evaluation that cannot compile."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("cannot compile this graph")


def refusing_capture(run: Any) -> Any:
    raise RuntimeError("CUDA error: operation not permitted when stream is capturing")


@pytest.mark.parametrize(
    ("forward", "falls_back_to", "said"),
    [
        (lambda model: Broken(), "eager", "the compiled evaluation failed in the warm-up (RuntimeError: cannot "
         "compile this graph); evaluating eagerly"),
        (lambda model: CapturedForward(compiled_eval(model, backend="aot_eager"), capture=refusing_capture),
         "compiled", "the captured evaluation failed in the warm-up (RuntimeError: CUDA error: operation not "
         "permitted when stream is capturing); evaluating with the compiled forward"),
    ],
)  # fmt: skip
def test_an_evaluation_that_fails_in_the_warm_up_leaves_the_step_and_evaluates_with_the_next_forward(
    forward: Any, falls_back_to: str, said: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    """A captured evaluation that cannot be captured evaluates with the compiled forward, a compiled one that
    cannot compile eagerly; the training step stays, and the log says why."""
    monkeypatch.setattr(trainer_module.Trainer, "_eval_forward", lambda self, kind: forward(self.model))
    with step_chosen(StepChoice("compiled", "asked for"), aot_eager_step):
        summary = build_trainer(build_config(SMALL_RUN, {"out": str(tmp_path)}), CPU, LocalMode(), Job()).fit()
    assert summary["eval_forward"] == falls_back_to and summary["train_step"] == "compiled"
    assert summary["final_test_acc"] is not None
    assert said in caplog.text


def test_auto_compiles_only_the_models_of_trainscale() -> None:
    """``--train-step auto`` compiles a model of trainscale's; one by import path, one a user's package registers
    and an instance given to ``trainscale.fit`` (registered for the call from outside ``trainscale.models``) may
    not trace, and stay eager."""
    assert is_builtin_model("speedrun94") and is_builtin_model("resnet9")
    assert not is_builtin_model("tests.userpkg.nets:small_cnn")
    MODELS.register("users_net", input_size=32, description="a user's", recipe="defaults")(
        lambda: torch.nn.Linear(2, 2)
    )
    try:
        assert not is_builtin_model("users_net")
    finally:
        MODELS.remove("users_net")


@pytest.mark.parametrize(
    ("compile_mode", "graphed", "expected"),
    [
        ("default", False, None),
        ("default", True, "reduce-overhead"),
        ("max-autotune", False, "max-autotune-no-cudagraphs"),
        ("max-autotune", True, "max-autotune"),
    ],
)
def test_the_compile_mode_reaches_both_compiled_graphs(
    compile_mode: str, graphed: bool, expected: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--compile-mode`` picks torch.compile's mode for the forward+backward and the optimizer step alike, with
    CUDA graphs only for a graphed step."""
    modes: list[str | None] = []

    def recording(fn: Any = None, *, mode: str | None = None, **kwargs: Any) -> Any:
        modes.append(mode)
        return fn if fn is not None else (lambda f: f)

    monkeypatch.setattr(torch, "compile", recording)
    model, opt = tiny("sgd")
    compiled_step(model, opt, Precision("fp32", CPU), 0.0, graphed=graphed, compile_mode=compile_mode)
    assert modes == [expected, expected]


def test_a_compile_mode_with_nothing_to_compile_is_refused() -> None:
    with pytest.raises(ConfigError, match="--compile-mode max-autotune applies to a compiled step or model"):
        check_step(CoreConfig.from_flat({"train_step": "eager", "compile_mode": "max-autotune"}))
    for settings in (
        {"train_step": "eager", "compile": True},
        {"train_step": "auto"},
        {"train_step": "compiled", "mode": "local"},
    ):
        check_step(CoreConfig.from_flat({**settings, "compile_mode": "max-autotune"}))


def test_the_epochs_run_with_the_heap_frozen_and_hand_it_back(tmp_path: Any, monkeypatch: Any) -> None:
    """What is alive before the first epoch (a compiled warm-up's graphs and guards) is out of the collector's
    full passes while the epochs run, and back in them after, also when an epoch fails."""
    seen: list[int] = []
    real = trainer_module.train_one_epoch

    def epoch(*args: Any, **kwargs: Any) -> Any:
        seen.append(gc.get_freeze_count())
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "train_one_epoch", epoch)
    cfg = build_config(SMALL_RUN, {"out": str(tmp_path / "run")})
    build_trainer(cfg, CPU, LocalMode(), Job()).fit()
    assert seen and all(n > 0 for n in seen)
    assert gc.get_freeze_count() == 0

    monkeypatch.setattr(trainer_module, "train_one_epoch", lambda *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        build_trainer(build_config(SMALL_RUN, {"out": str(tmp_path / "failed")}), CPU, LocalMode(), Job()).fit()
    assert gc.get_freeze_count() == 0
