"""A user's own model and data by import path: resolution, ``--model-arg`` parsing, the checks of what a dataset
function returns and of the model against the data, the DataLoader path, and what launched processes are given."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from tests.userpkg import data as userdata
from trainscale.app.config import build_config, load_toml
from trainscale.app.worker_env import to_argv, user_code_env
from trainscale.bench.grid import type_problem
from trainscale.cli import add_train_flags, main
from trainscale.data.user import DatasetSplit, LoaderBatches, channel_stats, load_user_data
from trainscale.errors import ConfigError, DataError
from trainscale.models import MODELS, create_model, model_info
from trainscale.registry import format_args, parse_args
from trainscale.train.usermodel import check_model_on_data, input_side

TINY = "tests.userpkg.nets:tiny"
TENSORS = "tests.userpkg.data:tensors"
DATASETS = "tests.userpkg.data:datasets"
HERE = "tests.unit.test_user_code"


# ----------------------------------------------------------------------------------------------- resolution


def test_an_import_path_resolves_like_a_name_and_a_registered_factory_keeps_its_metadata() -> None:
    entry = MODELS.get(TINY)
    assert entry.factory.__name__ == "tiny" and MODELS.get(TINY) is entry  # imported once per process
    info = model_info(TINY)
    assert (info.input_size, info.recipe, info.data_init_images) == (None, "defaults", 0)
    mlp = model_info("trainscale.models.mlp:mlp")  # the user's path to a registered factory: its own metadata
    assert (mlp.input_size, mlp.recipe) == (32, "mxnet-mnist")


@pytest.mark.parametrize(
    ("path", "fragment"),
    [
        ("no_such_pkg.nets:build", "cannot import module 'no_such_pkg.nets' (ModuleNotFoundError: No module named"),
        ("tests.userpkg.nets:missing", "module 'tests.userpkg.nets' has no attribute 'missing'"),
        ("tests.userpkg.data:CLASSES", "is a int, not a function or class to call"),
        ("resnet99", "unknown model 'resnet99'"),
    ],
)
def test_a_model_that_cannot_be_found_is_one_line_naming_it(path: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        build_config({"model": path})
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_the_factory_gets_num_classes_and_image_size_only_where_it_takes_them() -> None:
    assert create_model(TINY, num_classes=7)[-1].out_features == 7
    assert create_model("tests.userpkg.nets:ten_outputs", num_classes=4)[-1].out_features == 10
    vit = create_model("tests.userpkg.nets:vit", num_classes=3, image_size=16, dim=16, depth=1, heads=2)
    assert vit.pos.shape[1] == (16 // 4) ** 2 + 1 and vit.head.out_features == 3
    with pytest.raises(ConfigError, match="model tests.userpkg.nets:tiny takes no argument 'depth'.*width, bias"):
        create_model(TINY, depth=3)
    with pytest.raises(ConfigError, match="returned int, not a torch.nn.Module"):
        create_model("tests.userpkg.nets:not_a_module")
    with pytest.raises(ConfigError, match=r"vit \(patch=5\) failed: ValueError: image size 32 is not a multiple"):
        create_model("tests.userpkg.nets:vit", image_size=32, patch=5)
    with pytest.raises(ConfigError, match=r"exits called sys.exit\(3\) while building the network"):
        create_model("tests.userpkg.nets:exits")  # it ended the run with status 3 and no word


# -------------------------------------------------------------------------------------------- --model-arg


def test_model_args_parse_typed_and_a_table_round_trips() -> None:
    items = ["depth=4", "lr=1e-3", "act=gelu", "norm=false", 'tag="4"', "name=a=b"]
    assert parse_args(items) == {"depth": 4, "lr": 1e-3, "act": "gelu", "norm": False, "tag": "4", "name": "a=b"}
    table = {"depth": 4, "ratio": 0.5, "act": "gelu", "norm": True, "tag": "4", "flag": "true"}
    assert parse_args(format_args(table)) == table
    for bad, fragment in (("depth", "give KEY=VALUE"), ("2x=1", "give KEY=VALUE"), ("a=1 a=2", "a is given twice")):
        with pytest.raises(ConfigError, match=fragment):
            parse_args(bad.split())


def test_model_args_from_flags_toml_tables_lists_and_grids(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_train_flags(parser)
    args = vars(parser.parse_args(["--model", TINY, "--model-arg", "width=4", "bias=false", "--model-arg", "x=1"]))
    assert args["model_args"] == ["width=4", "bias=false", "x=1"]
    argv = to_argv({"model": TINY, "model_args": args["model_args"]})
    assert argv == ["--model", TINY, "--model-arg", "width=4", "bias=false", "x=1"]  # what workers are given
    assert vars(parser.parse_args(argv))["model_args"] == args["model_args"]
    (tmp_path / "table.toml").write_text(f'model = "{TINY}"\n[data]\nmodel_args = {{ width = 4, bias = false }}\n')
    (tmp_path / "list.toml").write_text(f'model = "{TINY}"\nmodel_args = ["width=4", "bias=false"]\n')
    for name in ("table.toml", "list.toml"):
        assert build_config(load_toml(tmp_path / name)).data.model_args == ["width=4", "bias=false"]
    assert type_problem("model_args", {"width": 4}) is None and type_problem("model_args", ["width=4"]) is None
    with pytest.raises(ConfigError, match="--model-arg 'width': give KEY=VALUE"):
        build_config({"model": TINY, "model_args": ["width"]})


def test_a_user_model_without_a_recipe_gets_trainscale_defaults() -> None:
    cfg = build_config({"model": TINY, "dataset": TENSORS})
    assert cfg.optim.recipe == "defaults" and cfg.optim.lr == 0.4


# -------------------------------------------------------------------------------------------------- data


def test_tensor_data_becomes_image_tensors_with_its_own_statistics() -> None:
    train, test = load_user_data(TENSORS)
    assert train.num_classes == 4 and len(train) == 512 and len(test) == 128
    assert train.image_shape == (3, 16, 16) and train.images.dtype == torch.uint8
    images = userdata.tensors()["train"][0]
    expected = images.double() / 255
    assert train.mean == pytest.approx(expected.mean(dim=(0, 2, 3)).tolist())
    assert train.std == pytest.approx(expected.transpose(0, 1).reshape(3, -1).std(dim=1, unbiased=False).tolist())


def _pair(n: int = 8, **change: object) -> tuple[object, object]:
    images = change.get("images", torch.zeros(n, 3, 4, 4, dtype=torch.uint8))
    labels = change.get("labels", torch.arange(n) % 2)
    return images, labels


def good_numpy() -> dict:
    images = np.random.default_rng(0).random((8, 1, 4, 4), dtype=np.float32)
    return {"train": (images, np.arange(8) % 3), "test": (images, np.arange(8) % 3), "num_classes": 5}


def three_d() -> dict:
    return {"train": _pair(images=torch.zeros(8, 4, 4)), "test": _pair()}


def float_labels() -> dict:
    return {"train": _pair(labels=torch.zeros(8)), "test": _pair()}


def negative_label() -> dict:
    return {"train": _pair(labels=torch.full((8,), -1)), "test": _pair()}


def label_over_classes() -> dict:
    return {"train": _pair(labels=torch.arange(8)), "test": _pair(), "num_classes": 4}


def count_mismatch() -> dict:
    return {"train": _pair(labels=torch.zeros(7, dtype=torch.long)), "test": _pair()}


def int_images() -> dict:
    return {"train": _pair(images=torch.zeros(8, 3, 4, 4, dtype=torch.int32)), "test": _pair()}


def nan_images() -> dict:
    return {"train": _pair(images=torch.full((8, 3, 4, 4), float("nan"))), "test": _pair()}


def channels_last() -> dict:
    return {"train": _pair(images=torch.zeros(8, 8, 8, 3, dtype=torch.uint8)), "test": _pair()}


def float_0_255() -> dict:
    return {"train": _pair(images=torch.full((8, 3, 4, 4), 255.0)), "test": _pair()}


def shapes_differ() -> dict:
    return {"train": _pair(), "test": _pair(images=torch.zeros(8, 3, 5, 5, dtype=torch.uint8))}


def a_list() -> list:
    return [1, 2]


def unknown_key() -> dict:
    return {"train": _pair(), "test": _pair(), "classes": 2}


def mixed_kinds() -> dict:
    return {"train": _pair(), "test": TensorDataset(torch.zeros(2, 3, 4, 4), torch.zeros(2, dtype=torch.long))}


def pil_items() -> dict:
    from PIL import Image

    class Pics(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 4

        def __getitem__(self, i: int) -> tuple[object, int]:
            return Image.new("RGB", (4, 4)), 0

    return {"train": Pics(), "test": Pics(), "num_classes": 2}


def no_class_count() -> dict:
    ds = TensorDataset(torch.zeros(4, 3, 4, 4), torch.zeros(4, dtype=torch.long))
    return {"train": ds, "test": ds}


def named(classes: list[str]) -> TensorDataset:
    dataset = TensorDataset(torch.zeros(4, 3, 4, 4), torch.zeros(4, dtype=torch.long))
    dataset.classes = classes  # type: ignore[attr-defined]  # as torchvision's ImageFolder names its folders
    return dataset


def val_folder_lacks_a_class() -> dict:
    return {"train": named(["ant", "bee", "cat"]), "test": named(["ant", "cat"])}


def classes_reordered() -> dict:
    return {"train": named(["ant", "bee"]), "test": named(["bee", "ant"])}


def raises() -> dict:
    raise FileNotFoundError("/data/mine/train.npy")


def only_mean() -> dict:
    return {"train": _pair(), "test": _pair(), "mean": (0.5, 0.5, 0.5)}


@pytest.mark.parametrize(
    ("function", "fragment"),
    [
        ("three_d", "train images must be N x C x H x W, got shape 8 x 4 x 4 (add the channel axis"),
        ("float_labels", "train labels must be one integer class index per image (shape N), got torch.float32"),
        ("negative_label", "train labels must be >= 0 (class indices), found -1"),
        ("label_over_classes", "a label is 7 but num_classes is 4; labels are 0..3"),
        ("count_mismatch", "train has 8 images but 7 labels"),
        ("int_images", "train images must be uint8 (0..255) or float (0..1), got torch.int32"),
        ("nan_images", "train images hold NaN or infinite values"),
        ("channels_last", "train images of shape 8 x 8 x 8 x 3 look channels-last (N x H x W x C)"),
        ("shapes_differ", "train images are 3 x 4 x 4 but test images 3 x 5 x 5"),
        ("a_list", "returned list; return a dict with 'train' and 'test'"),
        ("unknown_key", "returned a dict with unknown key(s) 'classes'"),
        ("mixed_kinds", "train and test must be of one kind"),
        ("pil_items", "train[0] image is a Image; return a C x H x W tensor"),
        ("no_class_count", "return num_classes with Datasets"),
        ("val_folder_lacks_a_class", "the train and test splits name different classes (train only: bee)"),
        ("classes_reordered", "name different classes (the same names in another order)"),
        ("raises", "failed: FileNotFoundError: /data/mine/train.npy"),
        ("only_mean", "give both mean and std, or neither"),
    ],
)
def test_a_bad_dataset_is_one_line_naming_the_problem(function: str, fragment: str) -> None:
    with pytest.raises(DataError) as info:
        load_user_data(f"{HERE}:{function}")
    message = str(info.value)
    assert fragment in message and f"dataset {HERE}:{function}" in message and "\n" not in message


def test_numpy_arrays_float_images_and_a_given_class_count() -> None:
    train, _ = load_user_data(f"{HERE}:good_numpy")
    assert train.num_classes == 5 and train.images.dtype == torch.float32 and train.image_shape == (1, 4, 4)


def test_channel_stats_of_a_constant_channel_do_not_divide_by_zero() -> None:
    images = torch.zeros(2, 2, 3, 3, dtype=torch.uint8)
    images[:, 1] = 255
    assert channel_stats(images) == ((0.0, 1.0), (1.0, 1.0))


# ------------------------------------------------------------------------------- model against the data


def frozen(num_classes: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(768, num_classes)).requires_grad_(False)


def test_a_model_with_nothing_to_train_is_refused_before_training() -> None:
    train, _ = load_user_data(TENSORS)
    with pytest.raises(ConfigError, match=f"^model {HERE}:frozen has no trainable parameters"):
        check_model_on_data(build_config({"model": f"{HERE}:frozen", "dataset": TENSORS}), train)


def test_the_model_is_checked_against_the_data_before_training() -> None:
    train, _ = load_user_data(TENSORS)
    check_model_on_data(build_config({"model": TINY, "dataset": TENSORS}), train)
    few = build_config({"model": TINY, "dataset": TENSORS, "model_args": ["num_classes=2"]})
    with pytest.raises(ConfigError, match="returns 2 class scores but tests.userpkg.data:tensors has 4 classes"):
        check_model_on_data(few, train)
    gray, _ = load_user_data(f"{HERE}:good_numpy")
    with pytest.raises(ConfigError, match="cannot take the 1x4x4 images of tests.unit.test_user_code:good_numpy"):
        check_model_on_data(build_config({"model": TINY, "dataset": f"{HERE}:good_numpy"}), gray)
    assert input_side(build_config({"model": TINY, "dataset": TENSORS}), train) == 16  # the data's size
    cifar, _ = load_user_data(TENSORS)
    builtin = build_config({"model": "mlp", "dataset": "synthetic", "model_args": ["hiden=3"]})
    with pytest.raises(ConfigError, match="^--model-arg hiden: model mlp takes no argument 'hiden'"):
        check_model_on_data(builtin, cifar)
    typo = build_config({"model": TINY, "dataset": TENSORS, "model_args": ["depth=3"]})
    with pytest.raises(ConfigError, match="^--model-arg depth: model tests.userpkg.nets:tiny takes no argument"):
        check_model_on_data(typo, train)
    splits, _ = load_user_data(DATASETS)
    ps = build_config({"model": TINY, "dataset": DATASETS, "mode": "async", "servers": 1, "workers": 2})
    with pytest.raises(ConfigError, match="--mode async needs in-memory data"):
        check_model_on_data(ps, splits, uses_servers=True)


def test_a_model_that_does_not_import_is_one_line_before_anything_runs(capsys: pytest.CaptureFixture) -> None:
    assert main(["train", "--model", "no_such_pkg.nets:build", "--dataset", "synthetic", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot import module 'no_such_pkg.nets'" in err[0]


# ------------------------------------------------------------------------------------------- DataLoader


def test_dataset_batches_shard_disjointly_and_evaluate_every_item_once() -> None:
    train, test = load_user_data(DATASETS)
    assert isinstance(train, DatasetSplit) and train.num_classes == 4 and train.mean == (0.35, 0.35, 0.35)
    ranks = [LoaderBatches(train, 32, train=True, device="cpu", rank=r, world_size=2, seed=3) for r in (0, 1)]
    seen = [set(b.indices(1)) for b in ranks]
    assert not seen[0] & seen[1] and len(seen[0]) == len(seen[1]) == 256
    assert seen != [set(b.indices(2)) for b in ranks]  # a new order every epoch
    x, y = next(iter(ranks[0].epoch(0)))
    assert x.shape == (32, 3, 16, 16) and x.dtype == torch.float32
    assert float(x.min()) == pytest.approx(-0.35 / 0.2) and float(x.max()) <= (1 - 0.35) / 0.2 + 1e-6
    lazy = [f() for f in ranks[0].lazy_epoch(0)]
    assert len(lazy) == len(ranks[0]) == 8 and torch.equal(lazy[0][1], y)
    evals = [LoaderBatches(test, 50, train=False, device="cpu", rank=r, world_size=2) for r in (0, 1)]
    assert sum(len(yy) for b in evals for _, yy in b.epoch(0)) == 128


def test_a_label_out_of_range_in_a_dataset_is_one_line() -> None:
    ds = TensorDataset(torch.zeros(8, 3, 4, 4), torch.tensor([0, 1, 2, 9, 0, 1, 2, 0]))
    split = DatasetSplit(ds, 3, (3, 4, 4), None, None, name="mine (train)")
    with pytest.raises(DataError, match=r"mine \(train\): label 9 is outside 0..2"):
        list(LoaderBatches(split, 8, train=False, device="cpu").epoch(0))


# ------------------------------------------------------------------------------------ launched processes


def test_launched_processes_get_the_folder_the_user_module_came_from(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = build_config({"model": TINY, "dataset": TENSORS})
    root = str(Path(__file__).resolve().parents[2])  # where the `tests` package lives
    env = user_code_env(cfg, {"PYTHONPATH": "/opt/elsewhere"})
    assert env["PYTHONPATH"].split(os.pathsep) == list(dict.fromkeys([os.getcwd(), root, "/opt/elsewhere"]))
    assert user_code_env(cfg, env) == {}  # already there
    assert user_code_env(build_config({"model": "resnet20"}), {}) == {}


def test_launched_processes_get_the_folder_an_optimizer_by_import_path_came_from() -> None:
    cfg = build_config({"model": "resnet20", "optimizer": "tests.userpkg.opt:Plain"})
    import tests.userpkg.opt  # noqa: F401  (the launcher has imported it by now: its checks build it)

    root = str(Path(__file__).resolve().parents[2])
    assert user_code_env(cfg, {})["PYTHONPATH"].split(os.pathsep) == list(dict.fromkeys([os.getcwd(), root]))


def test_fit_gives_the_processes_it_starts_the_folders_of_the_users_code(monkeypatch: pytest.MonkeyPatch) -> None:
    """As `trainscale train` does: a notebook's own ``sys.path`` entry reaches workers that are new interpreters."""
    import trainscale
    from trainscale.app import launch

    seen: list[str] = []

    def fake_launch(cfg: object, flags: object, job: object) -> int:
        seen.append(os.environ.get("PYTHONPATH", ""))
        raise KeyboardInterrupt  # stop here: nothing is trained

    monkeypatch.setattr(launch, "launch", fake_launch)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    with pytest.raises(KeyboardInterrupt):
        trainscale.fit(TINY, dataset=TENSORS, optimizer="tests.userpkg.opt:Plain", workers=2, progress=False)
    assert str(Path(__file__).resolve().parents[2]) in seen[0].split(os.pathsep)
    assert "PYTHONPATH" not in os.environ  # the caller's environment as it was


def test_a_grid_varies_model_args_given_as_tables(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    grid = tmp_path / "grid.toml"
    grid.write_text(
        'name = "mine"\ndescription = "widths"\nsource = "test"\n[base]\n'
        f'model = "{TINY}"\ndataset = "{TENSORS}"\nepochs = 1\nbatch_size = 64\n'
        "[axes]\nmodel_args = [{ width = 4 }, { width = 8, bias = false }]\n"
    )
    assert main(["bench", str(grid), "--out", str(tmp_path / "out"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "['width=4']" in out and "['width=8', 'bias=false']" in out


def test_run_toml_records_the_model_args_and_recreates_the_config(tmp_path: Path) -> None:
    from trainscale.app.config import train_settings
    from trainscale.record import RUN_TOML
    from trainscale.results import RunWriter

    cfg = build_config(
        {"model": TINY, "model_args": ["width=4", 'tag="4"', "x=a,b"], "dataset": DATASETS, "loader_workers": 0}
    )
    RunWriter(tmp_path).write_run_toml(cfg)
    again = train_settings({}, tmp_path / RUN_TOML)
    assert again == cfg and parse_args(again.data.model_args) == {"width": 4, "tag": "4", "x": "a,b"}


def by_class() -> dict:
    labels = torch.arange(4).repeat_interleave(50)  # 200 images ordered by class, as concatenated class folders are
    images = torch.zeros(200, 3, 4, 4, dtype=torch.uint8)
    return {"train": (images, labels), "test": (images, labels)}


def test_float_images_outside_0_1_train_unless_an_augmentation_would_clip_them() -> None:
    """0..255 float tensors are normalised by their own statistics and train; with --brightness or --contrast, which
    clip to 0..1, they would be erased: one line, before anything runs."""
    from trainscale.train.setup import load_data

    settings = {"model": "mlp", "dataset": f"{HERE}:float_0_255"}
    train, _ = load_data(build_config(settings))
    assert train.images.is_floating_point() and float(train.images.max()) == 255.0
    for flag in ("brightness", "contrast"):
        with pytest.raises(ConfigError, match=r"^--brightness and --contrast clip images to 0..1, but the float "):
            load_data(build_config({**settings, flag: 0.2}))
    load_data(build_config({**settings, "dataset": "tests.userpkg.data:tensors", "brightness": 0.2}))  # uint8


def test_a_subset_of_data_ordered_by_class_is_named_not_trained_silently() -> None:
    """`--train-subset 60` of class-ordered tensors holds 2 of 4 classes: said once, by the run's main process
    (before: a run that only ever saw two classes, with no sign); shuffled data, or a subset too small to tell (fewer
    than three items a class, or 20), says nothing."""
    from trainscale.train.setup import load_data, subset_class_warnings

    def said(dataset: str, train: int, test: int | None = None) -> list[str]:
        cfg = build_config({"model": "mlp", "dataset": dataset, "train_subset": train, "test_subset": test})
        return subset_class_warnings(cfg, *load_data(cfg))

    assert said(f"{HERE}:by_class", 60, 200) == [
        f"--train-subset 60: the first 60 items of {HERE}:by_class (train) hold 2 of its 4 classes (is the data "
        "ordered by class?); a subset is the first N items, so shuffle the data first"
    ]
    assert "hold 1 of its 4 classes" in said(f"{HERE}:by_class", 20)[0]
    assert said(f"{HERE}:by_class", 19) == [] and said(f"{HERE}:by_class", 200) == []  # too few to tell; all
    assert said("tests.userpkg.data:tensors", 64, 64) == []
    assert said(f"{HERE}:folders_by_class", 60) == [  # torchvision's ImageFolder: its samples are ordered by class
        f"--train-subset 60: the first 60 items of {HERE}:folders_by_class (train) hold 2 of its 4 classes (is the "
        "data ordered by class?); a subset is the first N items, so shuffle the data first"
    ]


def folders_by_class() -> dict:
    images, labels = by_class()["train"]
    dataset = TensorDataset(images, labels)
    dataset.targets = labels.tolist()  # type: ignore[attr-defined]
    return {"train": dataset, "test": dataset, "num_classes": 4}
