"""The training step on a GPU: no host sync and no host-device copy inside a step (profiler-counted:
``cudaMemcpyAsync``, ``cudaStreamSynchronize``, ``cudaDeviceSynchronize`` within the step's range), eager and
graph-captured; a graph-captured run equals an eager run of the same seed. Marked ``gpu``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from tests.unit.test_host_free_step import STEPS, prime, setup, tiny
from trainscale.data import AugmentConfig, DeviceBatches, synthetic_dataset
from trainscale.train import loop
from trainscale.train.loop import EpochStep, NonFiniteGuard, predict, predict_selective, train_one_epoch
from trainscale.train.precision import Precision
from trainscale.train.step import CapturedForward, CapturedStep, compiled_eval, make_step

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
EPOCH_UPLOADS = 4  # the epoch's sample order, crop rows and columns, flips (fewer than STEPS)
SUM_UPLOADS = 1  # the sample counts beside the epoch's device sums (Accumulator.reduce: one all-reduce)
WAITS = {"cudaMemcpy", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"}  # host blocks


def batches(n: int = 8 * STEPS) -> DeviceBatches:
    data = synthetic_dataset(n, 32, seed=1)
    return DeviceBatches(data, 8, train=True, augment=AugmentConfig(crop_padding=2), device=CUDA, seed=2)


def run(
    model: torch.nn.Module, opt: torch.optim.Optimizer, step_fn: Any, epochs: int = 2, data: Any = None
) -> list[float]:
    prec = Precision("bf16", CUDA)
    return [
        train_one_epoch(
            model, batches() if data is None else data, opt, prec.grad_scaler(), prec, lambda t: 0.05 * (1 - t / 4),
            e, 0.2, False, step_fn=step_fn,
        ).loss
        for e in range(epochs)
    ]  # fmt: skip


@pytest.mark.parametrize("kind", ["eager", "graphed", "captured"])
def test_no_sync_and_no_copy_inside_a_step(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt = tiny("muon")
    model = model.to(CUDA)
    opt.muon_plan = ("pad", True)  # type: ignore[attr-defined]
    step_fn = None if kind == "eager" else make_step(kind, model, opt, Precision("bf16", CUDA), 0.2)
    run(model, opt, step_fn, epochs=1)  # compile, capture, pick kernels
    step = EpochStep.__call__

    def marked(self: EpochStep, *args: Any) -> torch.Tensor:
        with record_function("trainscale_step"):
            return step(self, *args)

    monkeypatch.setattr(EpochStep, "__call__", marked)
    data = batches()  # its images and labels go to the device here, before the profiler starts
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run(model, opt, step_fn, epochs=1, data=data)
    events = prof.events()
    marks = [e for e in events if e.name == "trainscale_step" and e.device_type == DeviceType.CPU]  # not the GPU's
    spans = [(e.time_range.start, e.time_range.end) for e in marks]
    assert len(spans) == STEPS
    inside = [e.name for e in events if e.name in WAITS and any(a <= e.time_range.start <= b for a, b in spans)]
    assert inside == []
    replays = [e for e in events if e.name == "cudaGraphLaunch" and any(a <= e.time_range.start <= b for a, b in spans)]
    if kind == "graphed":  # every step replays captured graphs (forward, backward and the optimizer step: at least 3)
        assert len(replays) >= 3 * STEPS, f"{len(replays)} graph launches in {STEPS} steps"
    if kind == "captured":  # the whole step: one replay
        assert len(replays) == STEPS, f"{len(replays)} graph launches in {STEPS} steps"
    # cudaMemcpyAsync also launches device-to-device copies (stacking Muon's filters): the copies to the device
    # are found by the op that launched them; none inside a step: the epoch's host-drawn order and augmentation
    # are sent once before its first step, the next epoch's once before the last step (drawn while the device
    # runs the steps queued), and the sums' sample counts once after the last
    uploads = [  # the profiler's own buffer requests aside
        e.time_range.start
        for e in events
        if e.device_type == DeviceType.CPU and e.name.startswith("aten::") and any("HtoD" in k.name for k in e.kernels)
    ]
    assert [t for t in uploads if any(a <= t <= b for a, b in spans)] == []
    assert len([t for t in uploads if t < spans[0][0]]) <= EPOCH_UPLOADS
    assert [t for t in uploads if spans[0][0] < t < spans[-2][1]] == []
    assert 0 < len([t for t in uploads if spans[-2][1] < t < spans[-1][0]]) <= EPOCH_UPLOADS
    # until the last step is queued the host waits only for the stop guard's copies (their events)
    stalls = [e for e in events if e.name in WAITS - {"cudaEventSynchronize"}]
    assert [e.name for e in stalls if spans[0][0] <= e.time_range.start <= spans[-1][1]] == []
    assert len([t for t in uploads if t > spans[-1][1]]) <= SUM_UPLOADS
    # from the device only the documented reads between steps (the stop guard every CHECK_EVERY steps and after
    # the last, the first loss, the sums)
    reads = [e for e in events if e.device_type == DeviceType.CUDA and e.name.startswith("Memcpy DtoH")]
    assert len(reads) <= -(-STEPS // NonFiniteGuard.CHECK_EVERY) + 3


@pytest.mark.parametrize("kind", ["graphed", "captured"])
def test_a_graph_captured_run_equals_an_eager_run_of_the_same_seed(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32 with TF32 off and Muon's iteration in fp32: what differs is the order of the compiled kernels'
    reductions (relative 1e-6 a step), which 24 steps grow to well under 1e-3. The whole-step capture is primed
    as the trainer's warm-up primes it (its capture runs the step a few times: weights and state put back)."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    results = []
    for graphed in (False, True):
        model, opt = tiny("muon")
        model = model.to(CUDA)
        step_fn = make_step(kind, model, opt, Precision("fp32", CUDA), 0.2) if graphed else None
        if isinstance(step_fn, CapturedStep):
            prime(step_fn, model, opt, *next(iter(batches().epoch(0))))
        prec = Precision("fp32", CUDA)
        losses = [
            train_one_epoch(
                model, batches(), opt, prec.grad_scaler(), prec, lambda t: 0.05, e, 0.2, False, step_fn=step_fn
            ).loss
            for e in range(2)
        ]
        results.append((losses, [p.detach().cpu() for p in model.parameters()]))
    (eager_losses, eager_params), (graph_losses, graph_params) = results
    torch.testing.assert_close(graph_losses, eager_losses, rtol=1e-3, atol=1e-4)
    for a, b in zip(graph_params, eager_params):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)


def test_the_stop_guard_reads_mid_epoch_what_it_copied_at_its_previous_check() -> None:
    """On a GPU a mid-epoch check reads the record copied at the previous one, waiting on that copy's event and
    never on the stream (the steps queued since keep the GPU busy): a NaN at step 5 of 40 stops training at the
    second check, named as step 5; a clean epoch waits on two events (the checks after steps 20 and 30) and reads
    the current record only after its last step."""
    loss = torch.ones((), device=CUDA)
    guard = NonFiniteGuard(CUDA, epoch=0, lr_at=lambda t: 0.1, steps=40)
    checked: list[int] = []
    with pytest.raises(loop.NonFiniteLoss, match="at epoch 1 step 5"):
        for step in range(40):
            guard.admit(step, loss * float("nan") if step == 4 else loss, None)  # type: ignore[arg-type]
            checked.append(step)
            guard.between_steps(step)
    assert checked[-1] == 2 * NonFiniteGuard.CHECK_EVERY - 1
    guard = NonFiniteGuard(CUDA, epoch=0, lr_at=lambda t: 0.1, steps=40)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:  # CUDA: the runtime's calls
        with record_function("guarded_steps"):  # the profiler's own sync as it stops aside
            for step in range(39):
                guard.admit(step, loss, None)  # type: ignore[arg-type]
                guard.between_steps(step)
    events = prof.events()
    (span,) = [e.time_range for e in events if e.name == "guarded_steps" and e.device_type == DeviceType.CPU]
    names = [e.name for e in events if span.start <= e.time_range.start <= span.end]
    assert names.count("cudaEventSynchronize") == 2
    assert not {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy"} & set(names)


def test_the_compiled_evaluation_predicts_as_the_eager_one_and_compiles_nothing_after_the_warm_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Inductor's evaluation graphs (``compiled_eval``, what a run beside a compiled step evaluates with) give the
    eager logits, every view and the selective ones, in fp32 with TF32 off (fusion reorders reductions only), and
    once each batch shape has been met no pass compiles again."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    torch._dynamo.reset()
    model, _ = setup("sgd")
    model = model.to(CUDA).eval()
    compiled = compiled_eval(model)
    x = torch.randn(96, 3, 32, 32, device=CUDA).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        for n in (96, 40):
            all_views(compiled, x[:n])
        warmed = counters["stats"]["unique_graphs"]
        for n in (96, 40):
            torch.testing.assert_close(all_views(compiled, x[:n]), all_views(model, x[:n]), rtol=1e-3, atol=1e-3)
    assert counters["stats"]["unique_graphs"] == warmed


def test_the_captured_evaluation_predicts_as_the_eager_one_with_one_replay_a_forward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``CapturedForward`` (what a run beside the captured step evaluates with) gives the eager logits of every
    view and the selective ones, reads weights changed in place after its capture, captures nothing more once
    each shape has been met, and a forward is one graph replay: no kernel launched on its own, no wait for the
    device, no copy from the host."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    torch._dynamo.reset()
    model, _ = setup("sgd")
    model = model.to(CUDA).eval()
    captured = CapturedForward(compiled_eval(model)).eval()
    x = torch.randn(96, 3, 32, 32, device=CUDA).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        for n in (96, 40):
            all_views(captured, x[:n])
        graphs = len(captured.graphs)
        for p in model.parameters():
            p.mul_(1.05)
        for n in (96, 40):
            torch.testing.assert_close(all_views(captured, x[:n]), all_views(model, x[:n]), rtol=1e-3, atol=1e-3)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            captured(x)
    assert len(captured.graphs) == graphs
    names = [e.name for e in prof.events()]
    assert names.count("cudaGraphLaunch") == 1
    assert not [n for n in names if n in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx")][2:]
    assert not WAITS & set(names)
    assert not [e for e in prof.events() if e.device_type == DeviceType.CUDA and e.name.startswith("Memcpy HtoD")]


def all_views(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch.cat([predict(model, x, True), predict_selective(model, x, True, 1, 0.25)])
