"""Bad input exits with status 2 and one line naming the problem, before any training."""

import pytest

from tests.integration.cli import assert_one_line_error, run_cli

SYN = ("--dataset", "synthetic", "--epochs", "1", "--no-progress")


@pytest.mark.parametrize("args, fragment", [
    (("--model", "resnet23"), "unknown model 'resnet23' (did you mean 'resnet32'?)"),
    (("--epochs", "0"), "--epochs must be a positive integer"),
    (("--batch-size", "-4"), "--batch-size must be a positive integer"),
    (("--batch-size", "many"), "invalid int value"),
    (("--precision", "fp16", "--device", "cpu"), "--precision fp16 needs a CUDA device"),
    (("--device", "cuda:7"), "CUDA"),
    (("--target-acc", "94"), "fraction"),
    (("--train-subset", "60000"), "60000"),
    (("--schedule", "cosin"), "did you mean 'cosine'"),
])
def test_bad_train_flags(tmp_path, args, fragment):
    proc = run_cli("train", *SYN, "--model", "mlp", "--out", tmp_path / "run", *args)
    assert_one_line_error(proc, fragment)
    assert not (tmp_path / "run" / "checkpoint.pt").exists()


def test_unknown_config_key(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('model = "mlp"\nlearning_rate = 0.1\n')
    assert_one_line_error(run_cli("train", "--config", cfg), "c.toml:2: unknown key 'learning_rate'")


def test_resume_without_checkpoint(tmp_path):
    proc = run_cli("train", *SYN, "--model", "mlp", "--out", tmp_path, "--resume")
    assert_one_line_error(proc, "no checkpoint")


def test_unknown_flag_is_one_line():
    assert_one_line_error(run_cli("train", "--modle", "mlp"), "unrecognized arguments: --modle")


def test_models_lists_every_registered_model_with_counts():
    from trainscale.models import list_models

    proc = run_cli("models")
    assert proc.returncode == 0, proc.stderr
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines()[2:]}
    assert sorted(rows) == sorted(list_models())
    assert rows["resnet32"][1:3] == ["464,154", "32x32"]
    assert rows["resnet9"][1] == "6,573,120"
