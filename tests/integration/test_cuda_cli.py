"""`trainscale train` on CUDA end to end: fp16 with channels_last, torch.compile, NCCL data-parallel with
SyncBatchNorm and compressed gradients through the launcher, parameter-server workers on the GPU, and a
real CIFAR-10 subset learning on the GPU. Marked ``gpu``: skipped where torch sees no CUDA device.
One GPU is enough: NCCL runs a world of one worker per visible GPU.
"""

import json

import pytest
import torch

from tests.integration.cli import run_cli, small_run

pytestmark = pytest.mark.gpu

SYN = small_run(train=1024, test=256, batch=128, model=None)


def summary_of(out) -> dict:
    return json.loads((out / "summary.json").read_text())


def test_fp16_channels_last_on_cuda(tmp_path):
    out = tmp_path / "run"
    proc = run_cli(
        "train",
        "--model",
        "resnet20",
        *SYN,
        "--epochs",
        "2",
        "--precision",
        "fp16",
        "--channels-last",
        "--device",
        "cuda",
        "--out",
        out,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = summary_of(out)
    assert summary["environment"]["device"] == "cuda:0"
    assert summary["environment"]["device_name"] == torch.cuda.get_device_name(0)
    assert summary["peak_memory_mb"] > 0 and summary["samples_per_sec"] > 0
    assert summary["mode"] == "local" and summary["epochs_completed"] == 2
    assert 0 < summary["gpu_util"] <= 1, "no GPU utilisation from NVML (nvidia-ml-py is a dependency)"
    assert summary["gpu_clock_mhz"] > 100, "every NVIDIA GPU since Kepler reports its SM clock"


def test_compiled_bf16_on_cuda_is_the_default_device(tmp_path):
    out = tmp_path / "run"
    proc = run_cli(
        "train",
        "--model",
        "resnet20",
        *SYN,
        "--epochs",
        "1",
        "--precision",
        "bf16",
        "--compile",
        "--out",
        out,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert summary_of(out)["environment"]["device"] == "cuda:0"  # auto picks CUDA when present


def test_the_record_recipe_trains_and_evaluates_in_captured_graphs(tmp_path):
    """``--train-step auto`` on one GPU: the captured step, and the evaluation's forwards captured beside it
    (selective test-time views included), both recorded in summary.json."""
    out = tmp_path / "run"
    proc = run_cli("train", "--recipe", "speedrun94", *SYN, "--epochs", "2", "--out", out, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = summary_of(out)
    assert (summary["train_step"], summary["eval_forward"]) == ("captured", "captured"), summary["train_step_reason"]
    assert summary["final_test_acc"] is not None and summary["warmup_seconds"] > 0


def test_nccl_sync_with_sync_bn_and_compressed_gradients(tmp_path):
    out = tmp_path / "run"
    proc = run_cli(
        "train",
        "--model",
        "resnet20",
        *SYN,
        "--epochs",
        "2",
        "--precision",
        "bf16",
        "--gpus",
        "0",
        "--mode",
        "sync",
        "--sync-bn",
        "--compress",
        "topk",
        "--ratio",
        "0.01",
        "--error-feedback",
        "--out",
        out,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = summary_of(out)
    assert (summary["mode"], summary["world_size"], summary["backend"]) == ("sync", 1, "nccl")
    assert summary["compress_method"] == "topk" and summary["compression_ratio"] > 30
    assert summary["bytes_sent_per_step"] < summary["dense_bytes_per_step"] / 30


def test_parameter_server_workers_train_on_cuda(tmp_path):
    out = tmp_path / "run"
    proc = run_cli(
        "train",
        "--model",
        "mlp",
        *SYN,
        "--epochs",
        "2",
        "--mode",
        "async",
        "--servers",
        "1",
        "--workers",
        "1",
        "--device",
        "cuda",
        "--out",
        out,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = summary_of(out)
    assert (summary["mode"], summary["servers"], summary["workers"]) == ("async", 1, 1)
    assert summary["environment"]["device"].startswith("cuda")


@pytest.mark.realdata
def test_real_cifar_subset_learns_on_cuda(tmp_path, cifar10_dir):
    out = tmp_path / "run"
    proc = run_cli(
        "train",
        "--model",
        "airbench",
        "--dataset",
        "cifar10",
        "--data-dir",
        cifar10_dir,
        "--train-subset",
        "10000",
        "--epochs",
        "8",
        "--batch-size",
        "500",
        "--lr",
        "0.4",
        "--nesterov",
        "--label-smoothing",
        "0.2",
        "--crop-padding",
        "2",
        "--precision",
        "bf16",
        "--channels-last",
        "--tta",
        "--out",
        out,
        "--no-progress",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = summary_of(out)
    assert summary["environment"]["device"] == "cuda:0"
    assert summary["best_test_acc"] > 0.7, summary  # 10,000 real training images, the full test set
