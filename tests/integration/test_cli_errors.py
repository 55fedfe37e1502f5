"""Bad input exits with status 2 and one line naming the problem, before any training. In this process
(``main_cli``: the entry point's ``main``, without seconds of interpreter start-up per case); the unknown-flag
case runs the real entry point in a subprocess."""

from pathlib import Path

import pytest

from tests.integration.cli import assert_one_line_error, run_cli

SYN = ("--dataset", "synthetic", "--epochs", "1", "--no-progress")


@pytest.mark.parametrize(
    "args, fragment",
    [
        (("--model", "resnet23"), "unknown model 'resnet23' (did you mean 'resnet32'?)"),
        (("--epochs", "0"), "--epochs must be a positive number"),
        (("--eval-every", "-1"), "--eval-every must be 0 (the last epoch only) or a positive number of epochs"),
        (("--batch-size", "-4"), "--batch-size must be a positive integer"),
        (
            ("--batch-size", "many"),
            "--batch-size: expected a whole number (e.g. 512, 25000000, 25e6 or 25M), got 'many'",
        ),
        (("--batch-size", "2.5"), "expected a whole number"),
        (("--precision", "fp16", "--device", "cpu"), "--precision fp16 needs a CUDA device"),
        (("--device", "cuda:7"), "CUDA"),
        (("--target-acc", "94"), "fraction"),
        (("--train-subset", "60000"), "60000"),
        (("--schedule", "cosin"), "did you mean 'cosine'"),
        (("--lr", "nan"), "--lr must be a finite number, got nan"),
        (("--lr", "inf", "--dry-run"), "--lr must be a finite number, got inf"),
        (
            ("--workers", "2", "--fault-tolerance", "--inject-fault", "link:1@3", "--link-down", "nan", "--dry-run"),
            "--link-down must be a finite number",
        ),
        (
            ("--workers", "2", "--fault-tolerance", "--inject-fault", "link:1@3", "--link-down", "1e12"),
            "--link-down must be a positive number and <= 3600",
        ),
    ],
)
def test_bad_train_flags(main_cli, tmp_path, args, fragment):
    proc = main_cli("train", *SYN, "--model", "mlp", "--out", tmp_path / "run", *args)
    assert_one_line_error(proc, fragment)
    assert not (tmp_path / "run" / "checkpoint.pt").exists()


def test_unknown_config_key(main_cli, tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('model = "mlp"\nlearning_rate = 0.1\n')
    assert_one_line_error(main_cli("train", "--config", cfg), "c.toml:2: unknown key 'learning_rate'")


def test_resume_without_checkpoint(main_cli, tmp_path):
    proc = main_cli("train", *SYN, "--model", "mlp", "--out", tmp_path, "--resume")
    assert_one_line_error(proc, "no checkpoint")


def test_unknown_flag_is_one_line():
    line = "trainscale train: error: unknown flag --modle; did you mean --model?"
    assert_one_line_error(run_cli("train", "--modle", "mlp"), line)


def test_models_lists_every_registered_model_with_counts(main_cli):
    from trainscale.models import list_models

    proc = main_cli("models")
    assert proc.returncode == 0, proc.stderr
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines()[2:-1]}  # the last: a hint
    assert sorted(rows) == sorted(list_models())
    assert rows["resnet32"][1:3] == ["464,154", "32x32"]
    assert rows["resnet9"][1] == "6,573,120"


TINY = (*SYN, "--model", "mlp", "--train-subset", "64", "--test-subset", "64", "--batch-size", "32")
NO_NETWORK = {"http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9"}  # a download fails at once
SYSFS = Path("/sys/kernel").is_dir()  # Linux sysfs: nobody, root included, can make files in /sys


@pytest.mark.parametrize(
    "where, workers, fragment",
    [
        ("file.txt/run", (), "--out file.txt/run: cannot write there (file.txt is a file)"),
        ("file.txt/run", ("--workers", "2"), "--out file.txt/run: cannot write there (file.txt is a file)"),
        ("file.txt", ("--workers", "2"), "--out file.txt is a file, not a folder"),
        ("/sys/trainscale-run", ("--workers", "2"), "--out /sys/trainscale-run: cannot write there ("),
    ],
    ids=["under-a-file", "under-a-file-sync", "a-file-sync", "unwritable-even-as-root-sync"],
)
def test_an_out_that_cannot_be_written_is_one_line_and_starts_no_worker(main_cli, tmp_path, where, workers, fragment):
    if where.startswith("/sys") and not SYSFS:
        pytest.skip("needs Linux sysfs")
    (tmp_path / "file.txt").write_text("keep")
    proc = main_cli("train", *TINY, *workers, "--out", where, cwd=tmp_path)
    assert_one_line_error(proc, fragment)
    assert "starting" not in proc.stderr  # the launcher's pre-flight refused it: no worker ran
    assert [p.name for p in tmp_path.iterdir()] == ["file.txt"] and (tmp_path / "file.txt").read_text() == "keep"


def test_bench_and_report_refuse_an_out_that_is_a_file(main_cli, tmp_path):
    from tests.unit.test_report_tables import make_run

    (tmp_path / "grid.toml").write_text('name = "g"\n[base]\nmodel = "mlp"\ndataset = "synthetic"\nepochs = 1\n')
    (tmp_path / "file.txt").write_text("keep")
    make_run(tmp_path / "runs" / "a")
    assert_one_line_error(
        main_cli("bench", "grid.toml", "--out", "file.txt", cwd=tmp_path), "--out file.txt is a file, not a folder"
    )
    assert_one_line_error(
        main_cli("bench", "grid.toml", "--out", "file.txt/results", "--dry-run", cwd=tmp_path),
        "--out file.txt/results: cannot write there (file.txt is a file)",
    )
    assert_one_line_error(
        main_cli("report", "runs", "--out", "file.txt", cwd=tmp_path), "--out file.txt is a file, not a folder"
    )
    assert_one_line_error(
        main_cli("report", "runs", "--out", "file.txt/report", cwd=tmp_path),
        "--out file.txt/report: cannot write there (file.txt is a file)",
    )
    assert (tmp_path / "file.txt").read_text() == "keep"


@pytest.mark.parametrize("workers", [(), ("--workers", "2")], ids=["local", "sync"])
def test_an_image_size_the_model_cannot_take_is_one_line_before_anything_starts(main_cli, tmp_path, workers):
    proc = main_cli("train", *TINY, *workers, "--image-size", "16", "--out", tmp_path / "run")
    assert_one_line_error(proc, "--image-size 16: model mlp cannot take 16x16 images")
    assert "starting" not in proc.stderr and not (tmp_path / "run").exists()


@pytest.mark.parametrize("workers", [(), ("--workers", "2")], ids=["local", "sync"])
def test_a_mistyped_data_dir_is_refused_not_created_and_nothing_downloaded(main_cli, tmp_path, workers):
    typo = tmp_path / "dtaa" / "cifar"
    proc = main_cli(
        "train", *TINY, *workers, "--dataset", "cifar10", "--data-dir", typo, "--out", tmp_path / "run", env=NO_NETWORK
    )
    assert_one_line_error(proc, f"--data-dir {typo} does not exist; fix the path, or create the folder")
    assert "downloading" not in proc.stderr and "starting" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_failed_check_leaves_no_empty_run_folder_behind(main_cli, tmp_path):
    proc = main_cli("train", *TINY, "--train-subset", "60000", "--out", tmp_path / "run")
    assert_one_line_error(proc, "60000")
    assert not (tmp_path / "run").exists()
    (tmp_path / "mine").mkdir()  # a folder the user made stays, empty as it was
    assert_one_line_error(main_cli("train", *TINY, "--train-subset", "60000", "--out", tmp_path / "mine"), "60000")
    assert (tmp_path / "mine").is_dir()


@pytest.mark.parametrize("flag", ["--out", "--data-dir"])
def test_a_path_the_file_system_refuses_outright_is_one_line(main_cli, tmp_path, flag):
    too_long = tmp_path / ("a" * 300)
    args = {
        "--out": ("--out", too_long),
        "--data-dir": ("--dataset", "cifar10", "--data-dir", too_long, "--out", tmp_path / "run"),
    }[flag]
    proc = main_cli("train", *TINY, *args, env=NO_NETWORK)
    assert_one_line_error(proc, "File name too long")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("value", ["nan", "-1", "inf"])
def test_bench_timeout_must_be_finite_and_positive(main_cli, tmp_path, value):
    grid = tmp_path / "g.toml"
    grid.write_text('name = "g"\n[base]\nmodel = "mlp"\n')
    assert_one_line_error(
        main_cli("bench", grid, "--out", tmp_path / "out", "--timeout", value, "--dry-run"),
        "argument --timeout: must be",
    )


@pytest.mark.parametrize("command", [("up", "--hosts", "2", "--bandwidth", "1gbit"), ("down",)])
@pytest.mark.parametrize("name", ["demo\n", "a/b", "x" * 17])
def test_a_cluster_name_outside_the_safe_alphabet_is_one_line(main_cli, tmp_path, command, name):
    """Refused before anything is made (the name is checked first, root or not)."""
    proc = main_cli("cluster", command[0], name, *command[1:], env={"TRAINSCALE_CLUSTER_STATE": str(tmp_path)})
    assert_one_line_error(proc, "cluster name must be")
    assert list(tmp_path.iterdir()) == []


def test_data_verify_hints_only_what_it_and_data_download_take(main_cli, tmp_path):
    folder = tmp_path / "cifar-10-batches-bin"
    folder.mkdir()
    (folder / "data_batch_1.bin").write_bytes(b"not cifar")
    proc = main_cli("data", "verify", "--data-dir", tmp_path)
    assert_one_line_error(proc, f"and run `trainscale data download --dataset cifar10 --data-dir {tmp_path}`")
    assert "--no-verify" not in proc.stderr


def test_a_reader_that_goes_away_ends_the_command_without_a_traceback():
    """`trainscale models | head -1`: the pipe closes before the table is written."""
    import os
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-m", "trainscale", "models"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and "Traceback" not in err and "Exception ignored" not in err, err


@pytest.mark.realdata
@pytest.mark.parametrize("workers", [1, 2])
def test_a_run_out_of_memory_is_one_line_from_one_process_or_a_worker(tmp_path, cifar10_dir, workers):
    """CIFAR upscaled to 100,000 pixels a side asks for 1.7 TiB in the first batch's resize: torch's traceback
    from deep inside the augmentation was the error, once per worker, before the launcher's line."""
    proc = run_cli(
        "train", "--model", "resnet9", "--data-dir", cifar10_dir, "--train-subset", "64", "--test-subset", "64",
        "--epochs", "1", "--batch-per-worker", "16", "--image-size", "100000", "--workers", str(workers),
        "--out", tmp_path / "run", timeout=300,
    )  # fmt: skip
    assert_one_line_error(proc, "out of memory: the run tried to allocate 1,788.1 GiB; a smaller --batch-size")
