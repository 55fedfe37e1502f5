"""The CUDA path: data resident on the GPU and augmented there, every model training in bf16 with
channels_last, fp16 with a grad scaler that skips overflowing steps, and every compressor encoding on
the GPU with the same wire size as on the CPU. Marked ``gpu``: skipped where torch sees no CUDA device.
"""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_compression_props import make
from trainscale.compression import UnitContext, list_compressors
from trainscale.data import AugmentConfig, DeviceBatches, synthetic_dataset
from trainscale.models import create_model, list_models, model_info
from trainscale.train.loop import evaluate, train_one_epoch
from trainscale.train.precision import Precision, peak_memory_mb, reset_peak_memory

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
# Methods whose encoding involves no random draw: the GPU must give the CPU's answer.
DETERMINISTIC = {"none", "fp16", "bf16", "topk", "threshold", "signsgd", "efsignsgd"}


def batches(device: torch.device, train: bool, n: int = 96) -> DeviceBatches:
    data = synthetic_dataset(n, 32, seed=3)
    return DeviceBatches(
        data,
        32,
        train=train,
        augment=AugmentConfig(crop_padding=4, cutout=8),
        device=device,
        seed=5,
        channels_last=True,
    )


def test_batches_live_on_the_gpu_and_evaluation_matches_the_cpu() -> None:
    gpu = list(batches(CUDA, train=False).epoch(0))
    cpu = list(batches(torch.device("cpu"), train=False).epoch(0))
    assert all(x.device.type == "cuda" and y.device.type == "cuda" for x, y in gpu)
    assert all(x.is_contiguous(memory_format=torch.channels_last) for x, _ in gpu)
    for (xg, yg), (xc, yc) in zip(gpu, cpu):
        torch.testing.assert_close(xg.cpu(), xc)
        assert torch.equal(yg.cpu(), yc)


def test_gpu_augmentation_is_repeatable_per_epoch_and_differs_across_epochs() -> None:
    b = batches(CUDA, train=True)
    first, again, other = (torch.cat([x for x, _ in b.epoch(e)]) for e in (0, 0, 1))
    assert first.shape == (96, 3, 32, 32) and first.device.type == "cuda"
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


@pytest.mark.parametrize("name", list_models())
def test_every_model_takes_a_bf16_channels_last_step_on_the_gpu(name: str) -> None:
    torch.manual_seed(0)
    model = create_model(name).to(CUDA).to(memory_format=torch.channels_last)
    size = model_info(name).input_size
    x = torch.randn(4, 3, size, size, device=CUDA).contiguous(memory_format=torch.channels_last)
    if hasattr(model, "data_init"):
        model.data_init(x)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(x).float().logsumexp(1).mean()
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert torch.isfinite(loss) and grads and all(g is not None and torch.isfinite(g).all() for g in grads)


def test_fp16_training_learns_and_reports_gpu_memory() -> None:
    torch.manual_seed(0)
    precision = Precision("fp16", CUDA)
    model = create_model("resnet20").to(CUDA).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = batches(CUDA, train=True)
    reset_peak_memory(CUDA)
    first = train_one_epoch(model, data, opt, precision.grad_scaler(), precision, lambda t: 0.05, 0, progress=False)
    for epoch in range(1, 6):
        last = train_one_epoch(
            model, data, opt, precision.grad_scaler(), precision, lambda t: 0.05, epoch, progress=False
        )
    assert last.loss < first.loss  # memorising 96 noise images: the loss must fall
    assert peak_memory_mb(CUDA) > 0
    assert 0.0 <= evaluate(model, batches(CUDA, train=False), precision, tta_flip=True).acc <= 1.0


def test_the_fp16_grad_scaler_skips_a_step_whose_gradients_overflow() -> None:
    scaler = Precision("fp16", CUDA).grad_scaler()
    weight = torch.nn.Parameter(torch.ones(4, device=CUDA))
    opt = torch.optim.SGD([weight], lr=1.0)
    scale = scaler.get_scale()
    scaler.scale((weight * float("inf")).sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert torch.equal(weight.detach(), torch.ones(4, device=CUDA))  # the step was skipped
    assert scaler.get_scale() < scale  # and the scale backed off


@pytest.mark.parametrize("name", list_compressors())
def test_every_compressor_encodes_on_the_gpu_with_the_cpu_wire_size(name: str) -> None:
    x = torch.randn(3000, generator=torch.Generator().manual_seed(1))
    ctx = UnitContext("w", 0, 0)
    on_gpu, on_cpu = make(name), make(name)  # the property tests' parameters for each method
    payload_gpu, payload_cpu = on_gpu.encode(x.to(CUDA), ctx), on_cpu.encode(x, ctx)
    assert all(t.device.type == "cuda" for t in payload_gpu.tensors.values())
    assert payload_gpu.nbytes == payload_cpu.nbytes
    decoded = on_gpu.decode(payload_gpu)
    assert decoded.device.type == "cuda" and decoded.shape == x.shape and torch.isfinite(decoded).all()
    if name in DETERMINISTIC:
        torch.testing.assert_close(decoded.cpu(), on_cpu.decode(payload_cpu))
