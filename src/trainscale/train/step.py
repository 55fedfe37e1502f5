"""How the training step runs: eager, compiled, or compiled and captured in CUDA graphs (``--train-step``).

- ``eager``: forward, backward and the optimizer step as PyTorch runs them, one kernel launch at a time;
- ``compiled``: the forward and its backward compiled as one graph (``torch.compile`` of the model; the backward
  is AOTAutograd's) and the optimizer step compiled as another, the learning rates held in 0-dim device tensors
  so that a new lr each step changes a tensor, not the graph;
- ``graphed``: ``compiled`` with CUDA graphs (``mode="reduce-overhead"``): each graph is replayed by one launch.
  Shapes must be static: training drops its last partial batch (the loader's ``drop_last``), and the
  evaluation's shapes (its last partial batch included) are captured in the warm-up.

- ``captured``: ``compiled`` (without CUDA graphs of its own), the whole step captured as one CUDA graph.

``auto`` picks ``captured`` for a single CUDA process in bf16 or fp32 whose steps never skip (``--nonfinite stop``)
and whose model is trainscale's (measured to pay: docs/speed-record.md); if that fails in the warm-up (an optimizer
that keeps state on the host, a read back inside the step), ``graphed``, then ``eager`` (``FALLBACK``);
``eager`` everywhere else. ``compiled`` also runs under DDP (several workers of sync
mode, compressed gradients included); a mode that exchanges inside the step (parameter server, local SGD/DiLoCo,
fault tolerance) keeps the eager step, fp16's grad scaler reads the device every step, and ``--nonfinite skip`` must
read it before each update. The choice and its reason go to summary.json (``train_step``, ``train_step_reason``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Protocol, TypeVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from trainscale.errors import ConfigError, TrainscaleError
from trainscale.train.optimizers import MuonWithSGD
from trainscale.train.precision import Precision

STEP_KINDS = ("auto", "eager", "compiled", "graphed", "captured")
GRAPH_KINDS = ("graphed", "captured")  # replayed as CUDA graphs: one CUDA process, no hooks inside the step
FALLBACK = {"captured": "graphed", "graphed": "eager", "compiled": "eager"}  # auto's next try after a failed warm-up
CAPTURE_WARM_STEPS = 3  # before a whole-step capture: compile, cuDNN's choices, the allocator's pools
RECOMPILE_LIMIT = 64
StepFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # -> (correct count, loss)


@dataclass(frozen=True)
class StepChoice:
    kind: str  # one of STEP_KINDS but auto
    reason: str


WRAPPINGS = ("none", "ddp", "mode")  # the bare model; a DDP wrapper; a mode that exchanges inside the step


def step_blockers(
    kind: str,
    wrapping: str,
    device_type: str,
    precision: str,
    nonfinite: str,
    accumulate: int = 1,
    clip_grad_norm: float | None = None,
) -> list[str]:
    """Why a ``compiled``, ``graphed`` or ``captured`` step cannot run with these settings (empty: it can). Under
    DDP the forward is compiled through DDP (dynamo splits the graph at DDP's buckets; the gradient hooks,
    compressors included, run as in an eager step); CUDA graphs cannot capture those hooks."""
    reasons = [
        (wrapping == "mode", "the mode exchanges inside the step (parameter server, averaging, fault tolerance)"),
        (wrapping == "ddp" and kind in GRAPH_KINDS, "CUDA graphs cannot capture DDP's gradient hooks (use compiled)"),
        (kind in GRAPH_KINDS and device_type != "cuda", "CUDA graphs need a CUDA device"),
        (precision == "fp16", "fp16's grad scaler reads the device every step"),
        (nonfinite == "skip", "--nonfinite skip reads the device before every update"),
        (accumulate > 1, "--accumulate runs micro-batches outside the compiled graphs"),
        (clip_grad_norm is not None, "--clip-grad-norm is applied outside the compiled graphs"),
    ]
    return [why for bad, why in reasons if bad]


def refusal(kind: str, blocked: list[str]) -> str:
    return f"--train-step {kind} cannot run here: {'; '.join(blocked)}; use --train-step eager"


def choose_step(
    setting: str,
    device: torch.device,
    precision: str,
    wrapping: str,
    nonfinite: str,
    accumulate: int = 1,
    clip_grad_norm: float | None = None,
    user_model: bool = False,
) -> StepChoice:
    """The step ``--train-step setting`` gives here; a setting that cannot run here is a ConfigError.
    ``auto``: ``captured`` for one CUDA process with a model of trainscale's (measured to pay on an H100: the
    speedrun94 recipe's 8 epochs in 1.57 s of steps, against 1.66 s graphed); a model from outside trainscale
    stays eager (torch.compile may not trace it), as does every setting ``step_blockers`` names."""
    if setting == "auto":
        blocked = step_blockers("captured", wrapping, device.type, precision, nonfinite, accumulate, clip_grad_norm)
        if blocked:
            return StepChoice("eager", "auto: " + "; ".join(blocked))
        if user_model:
            return StepChoice("eager", "auto: a model from outside trainscale (ask for --train-step captured)")
        return StepChoice("captured", "auto: one CUDA process")
    if setting != "eager":
        blocked = step_blockers(setting, wrapping, device.type, precision, nonfinite, accumulate, clip_grad_norm)
        if blocked:
            raise ConfigError(refusal(setting, blocked))
    return StepChoice(setting, "asked for")


def float_lrs(optimizer: torch.optim.Optimizer) -> None:
    """Every group's lr back to a float: the eager step passes it as a kernel argument, where a tensor lr would
    be read from the device each step."""
    for g in optimizer.param_groups:
        if isinstance(g["lr"], torch.Tensor):
            g["lr"] = float(g["lr"])


def tensor_lrs(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Every group's lr as a 0-dim tensor on ``device`` (``set_lr`` then fills it in place): a compiled or
    captured step reads the tensor, where a float would be baked into the graph."""
    for g in optimizer.param_groups:
        if not isinstance(g["lr"], torch.Tensor):
            g["lr"] = torch.tensor(float(g["lr"]), dtype=torch.float32, device=device)


def create_state(optimizer: torch.optim.Optimizer) -> None:
    """Momentum buffers created before the first captured step, at zero (a first step from zero is the step from
    none when dampening is 0): a tensor created inside a CUDA graph is overwritten by the graph's next replay.
    For torch's SGD and trainscale's Muon+SGD, whose steps create ``momentum_buffer`` on first use; torch's other
    optimizers create their state outside the graph when compiled (dynamo runs their ``_init_group`` eagerly)."""
    if not isinstance(optimizer, (torch.optim.SGD, MuonWithSGD)):
        return
    for g in optimizer.param_groups:
        if g["momentum"] and not g.get("dampening"):
            for p in g["params"]:
                if "momentum_buffer" not in optimizer.state[p]:
                    optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)
    if isinstance(optimizer, MuonWithSGD):
        optimizer.prepare()


def static_addresses(optimizer: torch.optim.Optimizer) -> None:
    """Mark what the captured optimizer step updates in place (parameters, gradients, state, learning rates) as
    tensors whose address never changes: CUDA graphs replay an in-place update only of such inputs, and skip the
    capture of a graph that updates any other input (each step would then launch its kernels one by one)."""
    for g in optimizer.param_groups:
        tensors = [g["lr"]] if isinstance(g["lr"], torch.Tensor) else []
        for p in g["params"]:
            tensors += [p, *([p.grad] if p.grad is not None else [])]
            tensors += [v for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
        for t in tensors:
            torch._dynamo.mark_static_address(t)


def create_grads(model: nn.Module) -> None:
    """Every trainable parameter's gradient allocated once, at zero, before the first compiled step: backward then
    adds into the same tensors every step (the compiled update guards on them), and never adopts a tensor that a
    captured backward graph owns and overwrites at its next replay."""
    for p in model.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)


def torch_mode(compile_mode: str, graphed: bool) -> str | None:
    """``torch.compile``'s mode for ``--compile-mode`` (``config.COMPILE_MODES``): with CUDA graphs for a graphed
    step, without them for a compiled one and for ``--compile`` (whose eager loop keeps the outputs past the next
    call, which a replayed graph would overwrite)."""
    if compile_mode == "max-autotune":
        return "max-autotune" if graphed else "max-autotune-no-cudagraphs"
    return "reduce-overhead" if graphed else None


def compiled_eval(model: nn.Module, backend: str = "inductor") -> nn.Module:
    """``model``'s forward compiled for evaluation (its parameters and buffers shared, read at each call): one
    graph per batch shape the evaluation meets (``dynamic=False``; the warm-up meets them all), with BatchNorm's
    fixed statistics, its normalisation and the activation fused into few kernels, where an eager forward
    launches each on its own; no CUDA graphs, since the logits are kept past the next call. Always torch.compile's
    default mode, whatever ``--compile-mode`` says: max-autotune would time every convolution again for each of
    the evaluation's batch shapes (four for speedrun94), minutes of compilation for milliseconds of evaluation."""
    compiled = torch.compile(model, dynamic=False, backend=backend)
    return cast(nn.Module, compiled)


class CapturedForward(nn.Module):
    """The evaluation's forward (``compiled_eval``'s module) captured as a CUDA graph for each input shape and dtype
    it meets under ``torch.no_grad`` in eval mode (in the layout first met), and replayed with one launch where the
    compiled forward launches each of its kernels from Python: the launches, not the kernels, bound a small
    network's evaluation (speedrun94's final one took 39-84 ms on an H200, three times what its forwards' kernels
    take at the training step's rate). Beside the captured training step (``_eval_forward``), whose warm-up meets
    every shape an evaluation takes; a shape met later is captured then (an evaluation changes no state, so
    capturing on the run's data is only slower), and a call with gradients or in train mode runs the compiled
    forward as it is.

    The logits are copied out of the graph's output at each call, so that a caller may keep them past the next
    (``predict`` averages a view with its mirror, which has the same shape); that copy lets every graph share one
    memory pool. The graphs read the parameters and BatchNorm statistics where they are, so the weights must be
    updated in place (the optimizer, ``load_state_dict`` and the whitening fit do). ``capture``: as
    ``cuda_graph_capture`` (tests give one that runs on a CPU)."""

    def __init__(self, forward: nn.Module, capture: Capture | None = None) -> None:
        super().__init__()
        self.compiled, self.capture = forward, capture
        self.graphs: dict[tuple[object, ...], tuple[torch.Tensor, Callable[[], None], torch.Tensor]] = {}

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() or self.training:
            return cast(torch.Tensor, self.compiled(images))
        device = images.device.type
        autocast = (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        key = (images.shape, images.dtype, autocast)  # another layout is copied into the captured one
        entry = self.graphs.get(key)
        if entry is None:
            entry = self.graphs[key] = self._capture(images)
        static, replay, output = entry
        static.copy_(images)
        replay()
        return output.clone()

    def _capture(self, images: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None], torch.Tensor]:
        if self.capture is None:  # one pool for all: each graph's output is copied out before the next replays
            pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
            self.capture = partial(cuda_graph_capture, pool=pool, stream=stream)
        static = images.clone()
        replay, (output,) = self.capture(lambda: (self.compiled(static),))
        return static, replay, output


def correct_count(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """How many of ``logits``' top classes are the ``labels`` (a 0-dim device tensor, no sync)."""
    return (logits.argmax(dim=1) == labels).sum()


def compiled_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    precision: Precision,
    label_smoothing: float,
    graphed: bool,
    backend: str = "inductor",
    compile_mode: str = "default",
) -> StepFn:
    """A step function (images, labels) -> (correct predictions, loss) whose forward+backward (the loss and the
    count included) and optimizer step are compiled graphs (CUDA graphs with ``graphed``): outside them only a few
    launches a step. The outputs are 0-dim copies the caller may keep past the next step.
    ``backend``: torch.compile's (tests use ``aot_eager``: the same graphs, without generating kernels);
    ``compile_mode``: ``--compile-mode`` (``torch_mode``)."""
    mode = torch_mode(compile_mode, graphed)
    # The optimizer step compiles one graph per parameter group and state (momentum buffers absent on the first
    # step, present after; the parameters that stop training after the first epochs): more than dynamo's default
    # of 8 per function for a model with several groups. The warm-up meets them all before any timer.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)

    def forward_loss(images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with precision.autocast():
            logits = model(images)
        loss = F.cross_entropy(logits.float(), labels, label_smoothing=label_smoothing)
        return correct_count(logits.detach(), labels), loss

    forward = torch.compile(forward_loss, mode=mode, backend=backend)  # the loss and the count in the graphs
    tensor_lrs(optimizer, precision.device)
    create_grads(model)
    create_state(optimizer)
    if graphed:
        static_addresses(optimizer)

    @torch.compile(mode=mode, backend=backend)
    def update() -> None:
        optimizer.step()

    def step(images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if graphed:
            torch.compiler.cudagraph_mark_step_begin()
        correct, loss = forward(images, labels)
        optimizer.zero_grad(set_to_none=False)  # the same gradient tensors every step: the compiled update guards
        loss.backward()  # on them, and new ones each step made it recompile every step
        update()
        return correct.clone(), loss.detach().clone()

    return step


Outputs = tuple[torch.Tensor, torch.Tensor]
Written = TypeVar("Written", bound=tuple[torch.Tensor, ...])


class Capture(Protocol):
    """``cuda_graph_capture``'s signature (tests give one that runs on a CPU)."""

    def __call__(self, run: Callable[[], Written]) -> tuple[Callable[[], None], Written]: ...


def cuda_graph_capture(
    run: Callable[[], Written],
    pool: torch.cuda._POOL_HANDLE | None = None,
    stream: torch.cuda.Stream | None = None,
) -> tuple[Callable[[], None], Written]:
    """``run`` taken ``CAPTURE_WARM_STEPS`` times on a side stream (torch.compile compiles, cuDNN picks its kernels,
    the allocator settles: none of that may happen inside a capture), then captured as one CUDA graph. Returns
    the graph's replay and the tensors it writes its outputs into at every replay. The capture runs nothing.
    ``pool`` and ``stream``: a memory pool (``torch.cuda.graph_pool_handle``) and the side stream shared with
    other captures, for graphs none of which is replayed while another's outputs are still to be read."""
    side = torch.cuda.Stream() if stream is None else stream
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(CAPTURE_WARM_STEPS):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side, pool=pool):  # the stream warmed up: its cuBLAS workspace exists
        outputs = run()
    return graph.replay, outputs


@dataclass
class Captured:
    """One captured step: the tensors it reads its batch from and writes its outputs to, and its replay."""

    images: torch.Tensor
    labels: torch.Tensor
    replay: Callable[[], None]
    outputs: Outputs


class StepNotCaptured(TrainscaleError):
    """A captured step met a batch shape or a set of trained parameters that the warm-up did not capture."""


class CapturedStep:
    """The whole training step (forward with the loss and the count of correct predictions, backward, the
    optimizer step) captured as one CUDA graph and replayed with a single launch a step: the host's work per step
    is two copies into the graph's input tensors and one replay, where a ``graphed`` step replays three graphs
    behind torch.compile's guards and launches what lies between them. ``step``: a compiled step without CUDA
    graphs (``compiled_step(graphed=False)``), whose learning rates are device tensors the loop fills before each
    replay (a float would be baked into the graph).

    A graph is captured for each batch shape and set of trained parameters (the whitening bias stops training after
    the first epochs: another graph), when the warm-up first meets it; capturing runs the step a few times, so after
    the warm-up (``seal``) meeting a new one is an error rather than extra steps on the run's data. The outputs
    are the graph's own tensors, rewritten by the next replay: read them before it (the loop's sums do).
    ``capture``: ``cuda_graph_capture``; tests give one that runs on a CPU."""

    def __init__(
        self,
        step: StepFn,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        capture: Capture = cuda_graph_capture,
    ) -> None:
        self.step, self.optimizer, self.capture = step, optimizer, capture
        self.params = list(model.parameters())
        self.graphs: dict[tuple[object, ...], Captured] = {}
        self.sealed = False

    def seal(self) -> None:
        """The warm-up is over: every graph the run needs is captured."""
        self.sealed = True

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> Outputs:
        key = (tuple(images.shape), tuple(labels.shape), tuple(p.requires_grad for p in self.params))
        entry = self.graphs.get(key)
        if entry is None:
            entry = self.graphs[key] = self._capture(images, labels)
        entry.images.copy_(images)
        entry.labels.copy_(labels)
        entry.replay()
        return entry.outputs

    def _capture(self, images: torch.Tensor, labels: torch.Tensor) -> Captured:
        if self.sealed:
            raise StepNotCaptured(
                f"the captured step met a batch of {tuple(images.shape)} or a change in which parameters train "
                "that the warm-up did not capture; use --train-step graphed"
            )
        static_images, static_labels = images.clone(), labels.clone()
        try:
            replay, outputs = self.capture(lambda: self.step(static_images, static_labels))
        except RuntimeError as exc:  # torch.AcceleratorError too
            if "captur" not in str(exc):
                raise
            first = str(exc).strip().splitlines()[0]
            raise StepNotCaptured(
                "the step does what a CUDA graph cannot hold (a value read back to the host inside it, as "
                f"Adafactor's step does): {first}; use --train-step graphed"
            ) from None
        frozen = host_state(self.optimizer, images.device)
        if frozen:
            raise StepNotCaptured(
                f"the optimizer keeps its {', '.join(frozen)} off the device, where a captured step would freeze it "
                "at its first value; use --train-step graphed"
            )
        return Captured(static_images, static_labels, replay, outputs)


def host_state(optimizer: torch.optim.Optimizer, device: torch.device) -> list[str]:
    """The names of the optimizer's per-parameter state kept as host numbers or tensors off ``device`` (LAMB's
    step count, say): a CUDA graph replays the value it saw when captured, so bias corrections and schedules
    that read them would silently stop moving."""
    return sorted(
        {
            name
            for state in optimizer.state.values()
            for name, value in state.items()
            if not isinstance(value, torch.Tensor) or value.device != device
        }
    )


def make_step(
    kind: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    precision: Precision,
    label_smoothing: float,
    compile_mode: str = "default",
) -> StepFn:
    """The step function of a ``compiled``, ``graphed`` or ``captured`` step (``choose_step``'s kind)."""
    step = compiled_step(model, optimizer, precision, label_smoothing, kind == "graphed", compile_mode=compile_mode)
    return CapturedStep(step, model, optimizer) if kind == "captured" else step
