"""Training options around the optimizer step: gradient accumulation, gradient-norm clipping, the weight average
(--ema, evaluated and checkpointed), and recipes' schedules fitted to the epochs asked for; each refusal one line."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from tests.unit.small import SMALL_RUN
from trainscale.app.config import build_config
from trainscale.app.run import run_training
from trainscale.errors import ConfigError
from trainscale.train.ema import WeightAverage
from trainscale.train.loop import apply_gradients, compute_gradients
from trainscale.train.precision import Precision
from trainscale.train.schedules import create_schedule, warmup_epochs

CPU = Precision("fp32", torch.device("cpu"))
SMALL = {**SMALL_RUN, "epochs": 1}


def bn_free() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 32), nn.ReLU(), nn.Linear(32, 10))


def grads_after(accumulate: int) -> list[torch.Tensor]:
    model = bn_free()
    gen = torch.Generator().manual_seed(1)
    images, labels = torch.randn(32, 3, 8, 8, generator=gen), torch.randint(0, 10, (32,), generator=gen)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _, loss = compute_gradients(model, images, labels, opt, CPU.grad_scaler(), CPU, 0.1, accumulate)
    return [p.grad.clone() for p in model.parameters()] + [loss.detach()]


def test_micro_batches_sum_to_the_whole_batch_gradient_and_loss():
    for micro, whole in zip(grads_after(4), grads_after(1)):
        torch.testing.assert_close(micro, whole, rtol=0, atol=1e-6)


def test_accumulate_must_divide_the_batch_per_worker():
    with pytest.raises(ConfigError, match="--accumulate 3 splits each worker's batch of 64"):
        run_training(build_config(SMALL, {"accumulate": 3, "dry_run": True}))


def test_clipping_bounds_the_global_gradient_norm():
    model = bn_free()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.full_like(p, 10.0)
    apply_gradients(opt, CPU.grad_scaler(), clip_grad_norm=0.5)
    step = torch.cat([(b - p.detach()).reshape(-1) for b, p in zip(before, model.parameters())])
    assert float(step.norm()) == pytest.approx(0.5, rel=1e-5)


def test_weight_average_is_the_ema_of_the_weights():
    model = nn.Linear(2, 1, bias=False)
    ema = WeightAverage(model, decay=0.75)
    with torch.no_grad():
        model.weight.fill_(4.0)
        ema.update()  # the first update copies
        model.weight.fill_(8.0)
        ema.update()  # 0.75 * 4 + 0.25 * 8
    assert ema.module.weight.tolist() == [[5.0, 5.0]]
    again = WeightAverage(nn.Linear(2, 1, bias=False), decay=0.75)
    again.load_state_dict(ema.state_dict())
    assert again.count == 2 and again.module.weight.tolist() == [[5.0, 5.0]]


def test_ema_is_evaluated_checkpointed_and_resumed(tmp_path):
    out = tmp_path / "run"
    summary, rows = run_training(build_config(SMALL, {"ema": 0.9, "out": str(out)}))
    assert rows[0]["ema_test_acc"] is not None and summary["ema_final_test_acc"] == rows[0]["ema_test_acc"]
    saved = torch.load(out / "checkpoint.pt", weights_only=True)["ema"]
    assert int(saved["n_averaged"]) == 4  # 256 images in batches of 64
    summary, rows = run_training(build_config(SMALL, {"ema": 0.9, "out": str(out), "resume": True, "epochs": 2}))
    assert int(torch.load(out / "checkpoint.pt", weights_only=True)["ema"]["n_averaged"]) == 8
    assert [r["epoch"] for r in rows] == [1, 2] and summary["ema_best_test_acc"] is not None


def test_ema_is_refused_where_workers_hold_different_weights():
    with pytest.raises(ConfigError, match="--ema is for --mode local and sync, not --mode localsgd"):
        build_config({"model": "mlp", "mode": "localsgd", "workers": 2, "ema": 0.99})


def test_a_shortened_recipe_decays_inside_the_run():
    cfg = build_config({"model": "resnet20", "epochs": 2})  # He et al.: /10 at 83 and 124 of 164 epochs
    assert cfg.optim.milestones == [2.0, 2.5] and all(m - 1 < cfg.optim.epochs for m in cfg.optim.milestones)
    schedule = create_schedule(cfg)
    assert schedule(0.5) == 1.0 and schedule(1.2) == pytest.approx(0.1) and schedule(1.9) == pytest.approx(0.01)
    goyal = build_config({"model": "resnet20", "recipe": "goyal2017", "epochs": 9})  # 5 warm-up of 90
    assert goyal.optim.milestones == [4.0, 7.0, 9.0] and warmup_epochs(goyal) == 0.5
    same = build_config({"model": "resnet20"})
    assert same.optim.milestones == [83, 124] and same.optim.epochs == 164


def test_milestones_after_the_run_are_refused():
    with pytest.raises(ConfigError, match=r"--milestones 5: after the run's last epoch \(--epochs 2\)"):
        build_config({"model": "resnet20", "epochs": 2, "milestones": [1.5, 5]})


def test_dry_run_prints_milestones_inside_the_run(main_cli):
    proc = main_cli("train", "--model", "resnet20", "--dataset", "synthetic", "--epochs", "2", "--dry-run")
    assert proc.returncode == 0, proc.stderr[-2000:]
    printed = json.loads(proc.stdout[proc.stdout.index("{") :])
    assert printed["epochs"] == 2 and all(m - 1 < 2 for m in printed["milestones"])


@pytest.mark.parametrize("native", [True, False])
def test_auto_precision_is_bf16_only_where_the_cpu_computes_it(native, monkeypatch, tmp_path):
    """Below AVX-512 oneDNN emulates bf16 (an airbench step: 13 s against 1 s in fp32 on an AVX2 CPU): ``auto``
    takes fp32 there, and the run folder records what ran; an explicit bf16 there trains, with a note first."""
    from trainscale.train import precision

    monkeypatch.setattr(precision, "native_bf16", lambda device: native)
    cpu = torch.device("cpu")
    assert Precision("auto", cpu).name == ("bf16" if native else "fp32")
    assert bool(precision.slow_bf16_note("bf16", cpu)) is not native
    assert precision.slow_bf16_note("fp32", cpu) == "" and precision.slow_bf16_note("auto", cpu) == ""
    summary, _ = run_training(build_config(SMALL, {"precision": "auto", "out": str(tmp_path / "run")}))
    assert summary["precision"] == ("bf16" if native else "fp32")
    assert 'precision = "' + summary["precision"] + '"' in (tmp_path / "run" / "run.toml").read_text()


def test_native_bf16_reads_the_cpus_kernels():
    from trainscale.train.precision import native_bf16

    assert native_bf16(torch.device("cpu")) is bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
