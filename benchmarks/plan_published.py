"""The planner against published scaling measurements of real GPU clusters: error per source, per regime, overall.

Every row of ``configs/published/*.csv`` is one published throughput (images/s) of a model on some GPUs and
hosts. Each is planned with ``trainscale plan``'s model from figures that come from the publication, a public
spec or an assumption stated once per system in ``configs/published/systems.toml`` (never per row): the
model's parameters and tensors (the published architecture, built by trainscale's model code or listed here),
the device's step time (calibrated on the publication's own one-GPU figure for the same model, batch and data),
the links and how the system moves gradients (its mode). Rows on one GPU are the calibration and are not
scored. Goal: mean absolute error <= 10% overall and in every regime, no point off by more than 2x.

What a framework reaches of the hardware no spec gives, so each all-reduce row is also planned with its framework's
figures (its fraction of the links inside and between hosts, its cost per step, the share of its all-reduce that
hides under backward, and what a host's input pipeline feeds, as ``trainscale plan`` takes them:
``--intra-efficiency``, ``--efficiency``, ``--step-overhead``, ``--overlap``, ``--host-images-per-sec``), fitted
on the framework's other published tables and never on the row's own (leave one table out). That plan is scored
first; the same rows blind to the framework follow.

    python benchmarks/plan_published.py             # the table per source, regime and framework
    python benchmarks/plan_published.py --rows      # and every row
    python benchmarks/plan_published.py --frameworks  # and each framework's figures fitted on all of its tables
    python benchmarks/plan_published.py --held-out  # and the sources held out of the set, planned from specs alone

After the goal's verdict, the floor of any plan that is not told the framework: where tables of several frameworks
(or one framework's options) share everything a plan is given, the least error a plan whose efficiency only grows with
the one-GPU step can reach on them, and what that leaves as the least mean error of each regime.

Its last lines plan the multi-host all-reduce rows again as a user who measured one host would
(``trainscale plan --one-host-images-per-sec``): the framework's cost per step fitted to the same table's one-host
row, then carried to the hosts; and the rows on more than two hosts as one who also measured two hosts would
(``--two-host-images-per-sec``: the link's achieved fraction of its line rate fitted to the two-host row). They use
more published figures per table, so they are shown beside the goal, not in it.

It plans; it measures nothing, so it runs anywhere (about a minute on two cores, the fits included) and its figures
do not depend on the machine.
"""

from __future__ import annotations

import csv
import re
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path
from typing import Any

import tomllib

from trainscale.bench.script import run_script
from trainscale.errors import ConfigError, OneLineParser
from trainscale.plan.costs import Link
from trainscale.plan.describe import parse_link
from trainscale.plan.plan import GPU_OVERLAP, GPU_STEP_SHARE
from trainscale.plan.predict import (
    Prediction,
    PSLayout,
    Setting,
    fed_step,
    fit_intra_efficiency,
    fit_link_efficiency,
    fit_step_overhead,
    predict,
)
from trainscale.plan.profile import Profile
from trainscale.plan.synthetic import synthetic_profile

DATA = Path(__file__).resolve().parents[1] / "configs" / "published"
HELD_OUT = DATA / "held-out"  # sources never fitted on nor counted in the set: how the planner does on others
MEAN_GOAL, WORST_RATIO = 0.10, 2.0
# The rows the NCCL overlap is calibrated on (``--calibrate``); every other row is held out.
CALIBRATION = ("DLPerf (OneFlow's framework benchmark)", "NGC PyTorch (APEX DDP")


def _conv(c_in: int, c_out: int, k: int, bias: bool = True) -> list[int]:
    return [c_in * c_out * k * k] + ([c_out] if bias else [])


def _fc(n_in: int, n_out: int) -> list[int]:
    return [n_in * n_out, n_out]


def _vgg16() -> list[int]:
    """VGG-16 (Simonyan & Zisserman 2015, configuration D): 13 3x3 convs, FC 25088-4096-4096-1000 (138.4 M)."""
    sizes, c_in = [], 3
    for c_out in (64, 64, 128, 128, 256, 256, 256, 512, 512, 512, 512, 512, 512):
        sizes += _conv(c_in, c_out, 3)
        c_in = c_out
    return sizes + _fc(25088, 4096) + _fc(4096, 4096) + _fc(4096, 1000)


def _alexnet() -> list[int]:
    """AlexNet as in the one-weird-trick paper (Krizhevsky 2014) and torchvision: convs 64/192/384/256/256,
    FC 9216-4096-4096-1000 (61.1 M)."""
    sizes = _conv(3, 64, 11) + _conv(64, 192, 5) + _conv(192, 384, 3) + _conv(384, 256, 3) + _conv(256, 256, 3)
    return sizes + _fc(9216, 4096) + _fc(4096, 4096) + _fc(4096, 1000)


def _bert_base() -> list[int]:
    """BERT-Base (Devlin et al. 2019): vocabulary 30,522, 512 positions, 2 segments, 12 layers of hidden 768 with
    a 3,072 feed-forward, the pooler, the masked-LM transform (decoder tied to the embedding, its own bias) and
    the next-sentence head (110.1 M)."""
    h, ff, ln = 768, 3072, [768, 768]
    sizes = [30522 * h, 512 * h, 2 * h, *ln]
    for _ in range(12):
        sizes += _fc(h, h) * 3 + _fc(h, h) + ln + _fc(h, ff) + _fc(ff, h) + ln
    return sizes + _fc(h, h) + _fc(h, h) + ln + [30522] + _fc(h, 2)


def _torch_tensors(build: Any) -> list[int]:
    return [p.numel() for p in build().parameters()]


@cache
def tensors(model: str) -> tuple[int, ...]:
    """The model's parameter tensors (element counts), from trainscale's model code or the published layers."""
    from trainscale.models import create_model
    from trainscale.models.resnet50 import ResNet50, imagenet_stem

    builders: dict[str, Any] = {
        "inception_v3": lambda: create_model("inception_v3", num_classes=1000),
        "resnet50": lambda: create_model("resnet50_imagenet", num_classes=1000),
        "resnet152": lambda: ResNet50(imagenet_stem(), 1000, (3, 8, 36, 3)),
    }
    if model == "vgg16":
        return tuple(_vgg16())
    if model == "alexnet":
        return tuple(_alexnet())
    if model == "bert_base":
        return tuple(_bert_base())
    if model in builders:
        return tuple(_torch_tensors(builders[model]))
    return tuple(_torch_tensors(lambda: create_model(model)))


@dataclass(frozen=True)
class Row:
    source: str
    system: str
    model: str
    gpus: int
    hosts: int
    batch: int
    mode: str
    data: str
    images_per_sec: float
    where: str
    precision: str = "fp32"
    grad_bytes: int = 4  # bytes per gradient element on the wire
    series: str = ""  # rows of one published table (a table's one-GPU row calibrates the others)
    assumed: str = ""

    @property
    def group(self) -> tuple[str, str, str, int, str, str]:
        return self.source, self.system, self.model, self.batch, self.mode if self.gpus > 1 else "*", self.data

    @property
    def calibration_key(self) -> tuple[Any, ...]:
        """Which one-GPU row calibrates this one: the same table's where a file names its tables, else the
        same source, system, model, batch and data."""
        return (self.source, self.series) if self.series else self.group[:4] + (self.data,)

    @property
    def regime(self) -> str:
        kind = "ps" if self.mode.startswith(("ps", "distributed", "async")) else "all-reduce"
        return f"{'one host' if self.hosts == 1 else 'multi-host'}, {kind}"


def load_rows(folder: Path = DATA) -> list[Row]:
    """The rows of ``folder``'s CSV files: the validation set's (``configs/published``), or those held out of it
    (``HELD_OUT``)."""
    rows = []
    for path in sorted(folder.glob("*.csv")):
        with path.open(newline="") as f:
            for raw in csv.DictReader(f):
                rows.append(
                    Row(
                        raw["source"],
                        raw["system"],
                        raw["model"],
                        int(raw["gpus"]),
                        int(raw["hosts"]),
                        int(raw["batch"]),
                        raw["mode"],
                        raw["data"],
                        float(raw["images_per_sec"]),
                        raw["where"],
                        raw.get("precision") or "fp32",
                        int(raw.get("grad_bytes") or 4),
                        raw.get("series") or "",
                        raw.get("assumed") or "",
                    )
                )
    return rows


def systems() -> dict[str, dict[str, Any]]:
    """The systems, each NCCL system with the calibrated ``[nccl]`` figures unless it gives its own."""
    known = tomllib.loads((DATA / "systems.toml").read_text())
    nccl = known.pop("nccl", {})
    return {name: {**nccl, **system} if uses_nccl(system) else system for name, system in known.items()}


def uses_nccl(system: dict[str, Any]) -> bool:
    """An NVLink system, or one whose publication says its all-reduce is NCCL's over PCIe."""
    return "nvlink" in system or system.get("allreduce") == "nccl"


def calibrating(row: Row) -> bool:
    return row.source == CALIBRATION[0] and row.series.startswith(CALIBRATION[1])


def _link(system: dict[str, Any], rate: str, latency: str) -> Link:
    return parse_link(system[rate], system.get(latency, "0us"), f"{rate}")


def setting_for(row: Row, system: dict[str, Any]) -> tuple[Setting, int]:
    """The planner's setting of one row and the per-worker batch (a worker may drive several GPUs)."""
    per_host = row.gpus // row.hosts
    pcie = _link(system, "pcie_per_gpu", "pcie_latency") if "pcie_per_gpu" in system else None
    nic = _link(system, "nic", "nic_latency") if "nic" in system else None
    if row.mode == "allreduce":  # NCCL all-reduce: NVLink (else PCIe) inside a host, the hosts' NICs between them
        return Setting(
            row.hosts,
            per_host,
            nic,
            _link(system, "nvlink", "nvlink_latency") if "nvlink" in system else pcie,
            "sync",
            algorithm="auto",
            grad_scale=row.grad_bytes / 4,
            overlap=float(system.get("overlap", 1.0)),
            step_share=float(system.get("step_share", 0.0)),
        ), row.batch
    if row.mode == "replicated":  # every GPU keeps a copy and sums the others' gradients over PCIe
        return Setting(1, per_host, None, pcie, "sync"), row.batch
    if row.mode in ("ps-cpu", "ps-gpu"):  # variables in host memory (or spread over the GPUs), pushed and pulled
        return Setting(1, per_host, None, pcie, "ps-sync", servers=per_host), row.batch
    if row.mode == "distributed-replicated":  # one worker per host: GPUs reduce inside it, then push to the PS
        exceptions = system.get("ps_at_8_hosts", {})
        key = row.model if row.model in exceptions else f"{row.model}_b{row.batch}"
        servers = int(exceptions.get(key, row.hosts)) if row.hosts == 8 else row.hosts
        layout = PSLayout("colocated", "by_size", total=servers)
        return Setting(row.hosts, 1, nic, pcie, "ps-sync", ps=layout), row.batch * per_host
    raise SystemExit(f"{row.where}: unknown mode {row.mode!r}")


def profile_of(row: Row, calibration: Row) -> Profile:
    """The model of ``row`` as the planner sees it: its tensors, and one GPU's step from the calibration row."""
    step = calibration.batch / calibration.images_per_sec
    profile = synthetic_profile(sum(tensors(row.model)), step, row.batch, name=row.model)
    profile.tensor_bytes = [4 * n for n in tensors(row.model)]
    return profile


@dataclass(frozen=True)
class Figures:
    """What one framework reaches of the hardware, held for every row of that framework: its all-reduce's
    fraction of the devices' link inside a host and of the line rate between hosts, its cost per synchronised step,
    the share of its all-reduce that hides under backward (how it buckets gradients and when it reduces them), and
    for each input pipeline (a host's CPUs, the framework's loader and the images it decodes: the system, the
    loader and the model's data) the images/s a host feeds its GPUs."""

    intra_efficiency: float = 1.0
    efficiency: float = 1.0
    host_images_per_sec: tuple[tuple[tuple[str, str, str], float], ...] = ()
    step_overhead: float = 0.0
    overlap: float | None = None  # the share of its all-reduce that hides under backward (None: the system's)

    def ceiling(self, key: tuple[str, str, str] | None) -> float | None:
        """The images/s the pipeline ``key`` feeds a host (None: no pipeline, or none fitted)."""
        return next((rate for k, rate in self.host_images_per_sec if k == key), None)

    def with_ceiling(self, key: tuple[str, str, str], rate: float | None) -> Figures:
        others = tuple((k, v) for k, v in self.host_images_per_sec if k != key)
        return replace(self, host_images_per_sec=others + (((key, rate),) if rate is not None else ()))


BLIND = Figures()


@dataclass(eq=False)
class Case:
    """One published row as the planner sees it: the model's tensors and one GPU's step (``profile``), the links and
    mode (``setting``), the row's images/s over the plan's (``scale``: a worker may drive several GPUs), and, for
    TensorFlow's distributed_replicated, the host's own reduction before the push (``local``). ``pipeline``: the
    row's input pipeline, read from it once (the fits ask for it on every trial)."""

    row: Row
    profile: Profile
    setting: Setting
    scale: float = 1.0
    local: bool = False
    pipeline: tuple[str, str, str] | None = field(init=False)
    unfed: dict[tuple[Any, ...], Prediction] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.pipeline = pipeline(self.row)

    def plan(self, figures: Figures = BLIND) -> float:
        if figures == BLIND or self.local:
            return self._plan(self.setting)
        key = (figures.intra_efficiency, figures.efficiency, figures.step_overhead, self._overlap(figures))
        if key not in self.unfed:  # the plan before the host's input pipeline, which the fits try many of
            self.unfed[key] = predict(self.profile, self._with(figures))
        p = self.unfed[key]
        batch = p.images_per_sec * p.step_seconds / p.workers
        step = fed_step(p.step_seconds, self.setting.per_host, batch, figures.ceiling(self.pipeline))
        return p.workers * batch / step * self.scale

    def _with(self, figures: Figures) -> Setting:
        """The row's setting as the framework's figures (all but its input pipeline's) change it."""
        setting = self.setting
        return replace(
            setting,
            intra_efficiency=setting.intra_efficiency * figures.intra_efficiency,
            efficiency=setting.efficiency * figures.efficiency,
            host_images_per_sec=None,
            step_overhead=setting.step_overhead + figures.step_overhead,
            overlap=self._overlap(figures),
        )

    def _overlap(self, figures: Figures) -> float:
        return self.setting.overlap if figures.overlap is None else figures.overlap

    def _plan(self, setting: Setting) -> float:
        p = predict(self.profile, setting)
        if self.local:  # the host's GPUs first reduce their gradients into one (and copy it back): a ring on PCIe
            per_host = self.row.gpus // self.row.hosts
            local = predict(self.profile, Setting(1, per_host, None, setting.intra, "sync")).comm_seconds
            return self.row.gpus * self.row.batch / (p.step_seconds + local)
        return p.images_per_sec * self.scale


def case_of(row: Row, calibration: Row, system: dict[str, Any]) -> Case:
    setting, batch = setting_for(row, system)
    local = row.mode == "distributed-replicated" and row.gpus // row.hosts > 1
    return Case(row, profile_of(row, calibration), setting, batch / row.batch, local)


def cluster_results(
    gpu_overlap: float = GPU_OVERLAP, say_skipped: bool = True, gpu_share: float = GPU_STEP_SHARE
) -> list[tuple[Row, float, float]]:
    """(row, planned images/s, relative error) of every row of the cluster files (:func:`cluster_cases`)."""
    return [_scored(c, c.plan()) for c in cluster_cases(gpu_overlap, say_skipped, gpu_share)]


def cluster_cases(
    gpu_overlap: float = GPU_OVERLAP, say_skipped: bool = True, gpu_share: float = GPU_STEP_SHARE
) -> list[Case]:
    """The published rows of the cluster files (``configs/clusters``: MXNet, ps-lite, Keras-MXNet and Multiverso
    pages), each calibrated on its device file's one-GPU figure from the same page and planned on the file's
    links, in the file's mode (one host: gradients reduced over the devices' link, as a ring: assumed), with the
    overlap a GPU plan takes when the file gives none. ``say_skipped``: print the rows it cannot plan."""
    from trainscale.plan.describe import CHECKOUT_CONFIGS, load_cluster, load_device

    cases = []
    for path in sorted((CHECKOUT_CONFIGS / "clusters").glob("*.toml")):
        cluster = load_cluster(str(path))
        if not cluster.device:
            continue
        device = load_device(cluster.device)
        source = cluster.source.split(",")[0]
        for raw in cluster.published:
            devices, hosts = int(raw["devices"]), int(raw.get("hosts", 1))
            if devices == 1:
                continue
            batch = int(raw["batch_size"])
            per_host = int(raw.get("workers_per_host", devices // hosts))
            try:
                step, _ = device.step_seconds(raw["model"], batch, str(raw.get("precision", "fp32")))
            except ConfigError:  # the page gives no one-GPU figure for this model: nothing to calibrate on
                if say_skipped:
                    print(f"skipped (no one-GPU figure): {path.name}: {raw['model']} on {devices} GPUs")
                continue
            sizes = tensors(raw["model"])
            profile = synthetic_profile(sum(sizes), step, batch, name=raw["model"])
            profile.tensor_bytes = [4 * n for n in sizes]
            overlap = gpu_overlap if "overlap" in cluster.system.assumed else cluster.system.overlap
            share = gpu_share if "step_overhead" in cluster.system.assumed else 0.0
            setting = Setting(
                hosts,
                per_host,
                cluster.inter,
                cluster.intra,
                str(raw["mode"]),
                overlap=overlap,
                step_overhead=cluster.system.step_overhead,
                step_share=share,
            )
            row = Row(
                source,
                cluster.name,
                raw["model"],
                devices,
                hosts,
                batch,
                str(raw["mode"]),
                "real",
                float(raw["images_per_sec"]),
                f"{path.name}: {raw.get('source', '')}",
            )
            cases.append(Case(row, profile, setting, (batch * devices // (hosts * per_host)) / batch))
    return cases


ALL_REDUCE = ("allreduce", "sync", "replicated")  # the modes a framework's figures apply to
INTRA_GRID = (1.0, 0.7, 0.5, 0.35, 0.25, 0.18, 0.12, 0.08, 0.05, 0.035, 0.025, 0.018, 0.012, 0.008)
INTER_GRID = (1.0, 0.8, 0.6, 0.5, 0.4, 0.35, 0.3, 0.25, 0.2, 0.15, 0.1, 0.07, 0.05)
CEILING_GRID = (None, *(round(100 * 1.5**k) for k in range(16)))  # images/s per host: none, 100 to 43,789
STEP_GRID = (0.0, *(1e-3 * 1.5**k for k in range(14)))  # seconds per synchronised step: none, 1 ms to 194 ms
OVERLAP_GRID = (None, 0.0, 0.25, 0.5, 0.75, 1.0)  # the share of the all-reduce hidden under backward
PASSES = 10  # coordinate descent stops where a pass changes nothing (within this many)


def framework_of(row: Row) -> str:
    """The framework a row ran: its table's (DLPerf and NVIDIA name one per table), else its publisher's (one
    framework a page)."""
    return row.series.split(" | ")[0] if row.series else row.source


def loader(row: Row) -> str:
    """The input pipeline, as the table's title says: DALI where it names DALI, or where the framework runs DALI and
    the title does not set real data without it apart; else the framework's own loader."""
    title = row.series.split(" | ")[-1].lower()
    dali = "dali" in title or ("dali" in framework_of(row).lower() and "real data" not in title)
    return "DALI" if dali else "own"


def pipeline(row: Row) -> tuple[str, str, str] | None:
    """Which host input pipeline feeds a row: (system, loader, model) for real images in an all-reduce; None where
    the host decodes nothing (synthetic data) or the data are text (BERT's sequences)."""
    if row.data != "real" or row.model == "bert_base" or row.mode not in ALL_REDUCE:
        return None
    return row.system, loader(row), row.model


def fit_figures(cases: list[Case], errors: dict[tuple[Any, ...], float] | None = None) -> Figures:
    """The figures that plan ``cases`` (rows of one framework) with the least mean absolute error: for each overlap
    of its grid, coordinate descent over the other figures' grids until a pass changes nothing (the fraction of the
    devices' link with each pipeline's best ceiling at it, then the cost per step, then the fraction of the line rate
    between hosts), and the overlap whose descent ends lowest. The overlap is held through each descent, not made
    one more coordinate: it and the link fractions both set what the wire costs a step, so a descent that moved it
    stopped where one compensated for the other (rows made from known figures were not planned back). Each grid
    starts at the blind value, which wins ties. Only all-reduce rows take them. ``errors``: a cache of each row's
    error by the figures it reads."""
    cases = [c for c in cases if c.row.mode in ALL_REDUCE]
    errors = {} if errors is None else errors

    def error(figures: Figures) -> float:
        total = 0.0
        for c in cases:
            key = (
                id(c),
                figures.intra_efficiency,
                figures.efficiency,
                figures.step_overhead,
                figures.overlap,
                figures.ceiling(c.pipeline),
            )
            if key not in errors:
                errors[key] = abs(c.plan(figures) / c.row.images_per_sec - 1.0)
            total += errors[key]
        return total

    keys = sorted({c.pipeline for c in cases if c.pipeline is not None})
    several_hosts = any(c.row.hosts > 1 for c in cases)

    def descend(figures: Figures) -> Figures:
        def with_intra(value: float) -> Figures:  # and each pipeline's best ceiling at it (they are independent)
            chosen = replace(figures, intra_efficiency=value)
            for key in keys:
                chosen = min((chosen.with_ceiling(key, v) for v in CEILING_GRID), key=error)
            return chosen

        for _ in range(PASSES):
            start = figures
            figures = min((with_intra(v) for v in INTRA_GRID), key=error)
            figures = min((replace(figures, step_overhead=v) for v in STEP_GRID), key=error)
            if several_hosts:
                figures = min((replace(figures, efficiency=v) for v in INTER_GRID), key=error)
            if figures == start:
                break
        return figures

    return min((descend(replace(BLIND, overlap=v)) for v in OVERLAP_GRID), key=error)


def by_framework(cases: list[Case]) -> dict[str, list[Case]]:
    by: dict[str, list[Case]] = defaultdict(list)
    for c in cases:
        by[framework_of(c.row)].append(c)
    return by


def table_of(row: Row) -> tuple[Any, ...]:
    """The published table a row belongs to: its calibration key, and for a cluster file's row the table its
    source names (the Keras-MXNet page repeats its runs in a second table)."""
    named = None if row.series else re.search(r"table '([^']+)'", row.where)
    return row.calibration_key + ((named.group(1),) if named else ())


def cross_validated(cases: list[Case]) -> list[tuple[Row, float, float]]:
    """Every row planned with its framework's figures fitted on the framework's other tables, never its own
    (leave one table out): what a user who measured the framework on other models, batches or precisions would
    plan. A framework with one table, and the parameter-server rows, are planned blind."""
    results: list[tuple[Row, float, float]] = []
    errors: dict[tuple[Any, ...], float] = {}
    for members in by_framework(cases).values():
        for table in sorted({table_of(c.row) for c in members}, key=repr):
            others = [c for c in members if table_of(c.row) != table]
            figures = fit_figures(others, errors) if others else BLIND
            for c in members:
                if table_of(c.row) == table:
                    results.append(_scored(c, c.plan(figures if c.row.mode in ALL_REDUCE else BLIND)))
    return results


def _scored(case: Case, planned: float) -> tuple[Row, float, float]:
    return case.row, planned, planned / case.row.images_per_sec - 1.0


def main() -> None:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", action="store_true", help="print every row")
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="fit the NCCL overlap on the calibration tables (DLPerf's NGC PyTorch rows) and show it",
    )
    parser.add_argument(
        "--frameworks", action="store_true", help="print each framework's figures fitted on all of its tables"
    )
    parser.add_argument(
        "--held-out",
        action="store_true",
        help="then plan the sources held out of the set (configs/published/held-out), blind, from specs alone",
    )
    args = parser.parse_args()
    rows, known = load_rows(), systems()
    if args.calibrate:
        calibrate(rows, known)
    cases = row_cases(rows, known) + cluster_cases()
    blind = [_scored(c, c.plan()) for c in cases]
    results = cross_validated(cases)
    measured_host, measured_two = from_measured_hosts(rows, known), from_measured_hosts(rows, known, 2)
    if args.rows:
        alone = {id(r): planned for r, planned, _ in blind}
        for r, planned, err in results:
            print(
                f"{r.source[:14]:14} {r.system:28} {r.model:12} {r.gpus:3} GPUs {r.hosts:2} hosts b{r.batch:<4} "
                f"{r.mode:22} {r.data:9} published {r.images_per_sec:8.1f} planned {planned:8.1f} {err:+.1%} "
                f"(blind {alone[id(r)]:8.1f})"
            )
    print(
        "each row from its table's one-GPU figure and its framework's figures fitted on the framework's other tables:"
    )
    report(results)
    print("the same rows blind to the framework (from the one-GPU figure alone):")
    report(blind)
    blind_floor(rows, Counter(r.regime for r, _, _ in results))
    one_gpu = {r: e for r, _, e in blind}
    for label, measured in (("one host", measured_host), ("one and two hosts", measured_two)):
        errs = [e for _, _, e in measured]
        print(
            f"{f'multi-host all-reduce, {label} measured (not the goal)':64} {len(errs):6d} {_mae(errs):7.1%} "
            f"{statistics.mean(errs):+7.1%} {max(errs, key=abs):+7.1%}   (from one GPU: "
            f"{_mae([one_gpu[r] for r, _, _ in measured]):.1%})"
        )
    if args.frameworks:
        print_frameworks(cases)
    if args.held_out:
        held_out(load_rows(HELD_OUT), known)


def held_out(rows: list[Row], known: dict[str, dict[str, Any]]) -> None:
    """Sources kept out of the set, planned as a user who knows neither the framework nor the machine beyond its
    specs would plan them: from each table's one-GPU figure, the system's links and the NCCL figures of the set
    (``[nccl]``), nothing fitted on them. The error per system (with whether its GPUs have peer access), per peer
    access and overall, and whether adding GPUs pays."""
    singles = one_gpu_rows(rows)
    scored = [r for r in rows if r.gpus > 1]
    cases = [case_of(r, singles[r.calibration_key], known[r.system]) for r in scored if r.calibration_key in singles]
    if len(cases) < len(scored):
        print(f"skipped (no one-GPU figure at the same batch): {len(scored) - len(cases)} of {len(scored)} rows")
    results = [_scored(c, c.plan()) for c in cases]
    print("held out of the set, planned blind from each table's one-GPU figure and the system's specs:")
    groups: dict[str, list[float]] = defaultdict(list)
    for r, _, err in results:
        access = known[r.system].get("peer_access", "all")
        groups[f"source: {r.source}"].append(err)
        groups[f"system: {r.system} (peer access: {access})"].append(err)
        groups[f"peer access between the GPUs: {access}"].append(err)
        groups[f"precision: {r.precision}"].append(err)
    print(f"{'':56} {'points':>6} {'MAE':>7} {'bias':>7} {'worst':>7}")
    for name, errs in sorted(groups.items(), key=lambda kv: (kv[0].split(":")[0] != "source", kv[0])):
        print(_error_line(name, errs))
    direction(results)
    errs = [e for _, _, e in results]
    print(f"{_error_head('overall', errs)}   worst ratio {_worst_ratio(errs):.2f}x")
    from_two_devices(cases, known)


def from_two_devices(cases: list[Case], known: dict[str, dict[str, Any]]) -> None:
    """The rows of more than two GPUs planned as a user who measured two of them would
    (``trainscale plan --two-device-images-per-sec``): the link's achieved fraction inside the host fitted to the
    same table's two-GPU row, then held for four and eight; beside the blind plan of the same rows."""
    two = {series_key(c.row): c for c in cases if c.row.gpus == 2}
    groups: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for c in cases:
        pair = two.get(series_key(c.row))
        if c.row.gpus <= 2 or pair is None:
            continue
        fraction = fit_intra_efficiency(pair.profile, pair.setting, pair.row.images_per_sec / pair.scale)
        planned = predict(c.profile, replace(c.setting, intra_efficiency=fraction)).images_per_sec * c.scale
        errs = (planned / c.row.images_per_sec - 1, c.plan() / c.row.images_per_sec - 1)
        groups[f"peer access between the GPUs: {known[c.row.system].get('peer_access', 'all')}"].append(errs)
        groups[f"system: {c.row.system}"].append(errs)
    print("the rows of more than two GPUs, from their table's two-GPU row (--two-device-images-per-sec, not blind):")
    for name, pairs in sorted(groups.items()):
        print(f"{_error_line(name, [f for f, _ in pairs])}   (blind: {_mae([b for _, b in pairs]):.1%})")


def print_frameworks(cases: list[Case]) -> None:
    """Each framework's figures fitted on all of its tables, as the ``trainscale plan`` flags that charge them."""
    print("each framework's figures on all of its tables, as trainscale plan flags:")
    for name, members in sorted(by_framework([c for c in cases if c.row.mode in ALL_REDUCE]).items()):
        f = fit_figures(members)
        flags = f"--intra-efficiency {f.intra_efficiency:.3g} --efficiency {f.efficiency:.3g}"
        flags += f" --step-overhead {1e3 * f.step_overhead:.1f}ms"
        flags += f" --overlap {f.overlap:.2g}" if f.overlap is not None else ""
        ceilings = "; ".join(
            f"{model} on {system} ({feed}): --host-images-per-sec {v:,.0f}"
            for (system, feed, model), v in f.host_images_per_sec
        )
        print(f"  {name}: {flags}" + (f"; {ceilings}" if ceilings else ""))


def one_gpu_rows(rows: list[Row]) -> dict[tuple[Any, ...], Row]:
    """Each table's one-GPU row, by the calibration key of the rows it calibrates."""
    return {r.calibration_key: r for r in rows if r.gpus == 1}


def planned_rows(rows: list[Row], known: dict[str, dict[str, Any]]) -> list[tuple[Row, float, float]]:
    """(row, planned images/s, relative error) of every multi-GPU row, calibrated on its one-GPU row."""
    return [_scored(c, c.plan()) for c in row_cases(rows, known)]


def row_cases(rows: list[Row], known: dict[str, dict[str, Any]]) -> list[Case]:
    """Every multi-GPU row as the planner sees it, calibrated on its table's one-GPU row."""
    singles = one_gpu_rows(rows)
    cases = []
    for r in rows:
        if r.gpus == 1:
            continue
        calibration = singles.get(r.calibration_key)
        if calibration is None:
            raise SystemExit(f"{r.where}: no one-GPU row to calibrate {r.model} at batch {r.batch} on")
        cases.append(case_of(r, calibration, known[r.system]))
    return cases


def from_measured_hosts(
    rows: list[Row], known: dict[str, dict[str, Any]], measured: int = 1
) -> list[tuple[Row, float, float]]:
    """(row, planned images/s, relative error) of every all-reduce row on more than ``measured`` hosts planned as a
    user who measured one host (``trainscale plan --one-host-images-per-sec``), or one and two hosts
    (``--two-host-images-per-sec`` as well), would: the framework's cost per step fitted to the same table's
    one-host row of as many GPUs as each host has, and with two, the link's efficiency to its two-host row."""
    singles = one_gpu_rows(rows)
    table = {(r.calibration_key, r.hosts, r.gpus): r for r in rows}
    results = []
    for r in rows:
        per_host = r.gpus // r.hosts
        hosts = [table.get((r.calibration_key, n, n * per_host)) for n in range(1, measured + 1)]
        if r.hosts <= measured or r.mode != "allreduce" or None in hosts:
            continue
        setting, _ = setting_for(r, known[r.system])
        profile = profile_of(r, singles[r.calibration_key])
        fitted = fit_step_overhead(profile, setting, hosts[0].images_per_sec)
        setting = replace(setting, step_overhead=fitted, step_share=0.0)  # the measured cost replaces the assumed
        if measured == 2:
            setting = replace(setting, efficiency=fit_link_efficiency(profile, setting, hosts[1].images_per_sec))
        planned = predict(profile, setting).images_per_sec
        results.append((r, planned, planned / r.images_per_sec - 1.0))
    return results


def efficiency(row: Row, calibration: Row) -> float:
    """The published scaling efficiency of ``row``: its images/s over its GPUs times one GPU's (its table's one-GPU
    row, at the row's batch)."""
    return row.images_per_sec / (row.gpus * calibration.images_per_sec * row.batch / calibration.batch)


def monotone_floor(members: list[tuple[float, float]]) -> list[float]:
    """The errors, row by row, of the best plan of rows of (one-GPU step, published efficiency) that share
    everything else a plan is given, when a plan's efficiency may only grow with the step (the same traffic hides
    behind more compute): the non-decreasing guess of least mean absolute relative error (L1 isotonic regression).
    A best guess takes published values only, so a table over them, rows sorted by step, finds it exactly."""
    order = sorted(range(len(members)), key=lambda i: members[i][0])
    values = sorted({e for _, e in members})

    def cost(i: int, v: int) -> float:
        return abs(values[v] / members[i][1] - 1.0)

    total = [cost(order[0], v) for v in range(len(values))]
    back: list[list[int]] = []
    for i in order[1:]:
        low, at, picks = float("inf"), 0, []
        for v in range(len(values)):  # the best guess of the rows before, at most values[v]
            if total[v] < low:
                low, at = total[v], v
            picks.append(at)
        back.append(picks)
        total = [total[picks[v]] + cost(i, v) for v in range(len(values))]
    v = min(range(len(values)), key=total.__getitem__)
    errors = [0.0] * len(members)
    for step in range(len(order) - 1, -1, -1):
        errors[order[step]] = cost(order[step], v)
        if step:
            v = back[step - 1][v]
    return errors


def blind_groups(rows: list[Row]) -> dict[tuple[Any, ...], list[tuple[Row, float, float]]]:
    """The multi-GPU rows that agree on everything a plan is given but the framework and its options (system,
    model, precision, gradient bytes, batch, GPUs, hosts, mode, data), each with its published scaling efficiency
    and its table's one-GPU step (seconds): groups of at least two tables."""
    singles = one_gpu_rows(rows)
    groups: dict[tuple[Any, ...], list[tuple[Row, float, float]]] = defaultdict(list)
    for r in rows:
        if r.gpus > 1:
            one = singles[r.calibration_key]
            key = (r.system, r.model, r.precision, r.grad_bytes, r.batch, r.gpus, r.hosts, r.mode, r.data)
            groups[key].append((r, efficiency(r, one), one.batch / one.images_per_sec))
    return {k: v for k, v in groups.items() if len({r.calibration_key for r, _, _ in v}) > 1}


def blind_floor(rows: list[Row], regimes: Counter[str]) -> None:
    """The least error a plan that is not told the framework can reach, per regime (``regimes``: its scored rows):
    where tables of several frameworks (or one framework's options) share everything a plan is given, one plan
    serves them all, and a plan's efficiency may only grow with the one-GPU step by which they still differ (the
    same traffic hides behind more compute). The best such plan (``monotone_floor``, an oracle that knows the
    answers) errs this much on those rows, so the regime's mean error cannot fall below their sum over all its
    rows, whatever the plan models."""
    by: dict[str, list[float]] = defaultdict(list)
    spread, against, pairs = 1.0, 0, 0
    for members in blind_groups(rows).values():
        for (r, _, _), err in zip(members, monotone_floor([(step, e) for _, e, step in members])):
            by[r.regime].append(err)
        spread = max(spread, max(e for _, e, _ in members) / min(e for _, e, _ in members))
        for i, (_, eff_a, step_a) in enumerate(members):
            for _, eff_b, step_b in members[i + 1 :]:
                pairs += 1
                against += step_a != step_b and (step_a < step_b) == (eff_a > eff_b)
    for regime, errs in sorted(by.items()):
        print(
            f"{'floor of a plan blind to the framework: ' + regime:56} {len(errs):6d} {_mae(errs):7.1%}   "
            f"(so at least {sum(errs) / regimes[regime]:.1%} over the regime's {regimes[regime]})"
        )
    print(
        f"{'':56} (one group's published efficiencies differ up to {spread:.1f}x; in {against} of {pairs} pairs the "
        "table with the shorter one-GPU step scales better)"
    )


def calibrate(rows: list[Row], known: dict[str, dict[str, Any]]) -> None:
    """The overlap (0, 0.05, ..., 1), then at the overlap found the framework's cost per step as a share of the
    device's step (0, 0.01, ..., 0.1), that plan the calibration tables best, and what each gives on the rest; and,
    as a cross-check, the all-reduce rows of every other publisher (an independent fit, not used)."""
    fit = [r for r in rows if calibrating(r) or (r.gpus == 1 and r.series.startswith(CALIBRATION[1]))]
    print(f"calibrating the NCCL overlap on {sum(r.gpus > 1 for r in fit)} rows ({' / '.join(CALIBRATION)}):")
    best = _scan(rows, known, fit, "overlap", [i / 20 for i in range(21)], {"step_share": 0.0})
    print(f"then the cost per step, as a share of the device's step, at overlap {best:.2f}:")
    _scan(rows, known, fit, "step_share", [i / 100 for i in range(11)], {"overlap": best})


def _scan(
    rows: list[Row],
    known: dict[str, dict[str, Any]],
    fit: list[Row],
    name: str,
    values: list[float],
    held: dict[str, float],
) -> float:
    """One NCCL figure (``name``) tried at each of ``values`` with the others ``held``: the error on the
    calibration tables (``fit``), on every other row and on the other publishers' all-reduce rows; returns the
    value that fits the calibration tables best."""
    print(f"  {'':16} {'calibration':>12} {'held out':>9} {'other publishers all-reduce':>28}")
    scores = []
    for value in values:
        figures = {**held, name: value}
        trial = {k: {**v, **figures} if "nvlink" in v else v for k, v in known.items()}
        clusters = cluster_results(figures["overlap"], say_skipped=False, gpu_share=figures["step_share"])
        results = planned_rows(rows, trial) + clusters
        rest = [e for r, _, e in results if not calibrating(r)]
        others = [e for r, _, e in results if r.source != CALIBRATION[0] and r.mode in ("allreduce", "sync")]
        fitted = _mae([e for _, _, e in planned_rows(fit, trial)])
        scores.append((fitted, value))
        print(f"  {name} {value:4.2f} {fitted:12.1%} {_mae(rest):9.1%} {_mae(others):20.1%} ({len(others)} rows)")
    return min(scores)[1]


def report(results: list[tuple[Row, float, float]]) -> None:
    """The error per source, regime and framework, the answers to users' questions, and the goal's verdict."""
    by: dict[str, dict[str, list[float]]] = {
        "source": defaultdict(list),
        "regime": defaultdict(list),
        "framework": defaultdict(list),
    }
    for r, _, err in results:
        by["source"][r.source].append(err)
        by["regime"][r.regime].append(err)
        if r.series:
            by["framework"][r.series.split(" | ")[0]].append(err)
    print(f"{'':56} {'points':>6} {'MAE':>7} {'bias':>7} {'worst':>7}")
    for kind, groups in by.items():
        for name, errs in sorted(groups.items()):
            print(_error_line(f"{kind}: {name}", errs))
    direction(results)
    host_limits(results)
    ordering(results)
    held = [e for r, _, e in results if not calibrating(r)]
    print(f"{'held out (all but the calibration tables)':56} {len(held):6d} {_mae(held):7.1%}")
    errs = [e for _, _, e in results]
    worst = _worst_ratio(errs)
    over = sum(e > 0 for e in errs) / len(errs)
    print(f"{_error_head('overall', errs)}   worst ratio {worst:.2f}x, over-predicted {over:.0%}")
    misses = [f"{name} {_mae(e):.2%}" for name, e in sorted(by["regime"].items()) if _mae(e) > MEAN_GOAL]
    misses += [f"overall {_mae(errs):.2%}"] if _mae(errs) > MEAN_GOAL else []
    misses += [f"a point off by {worst:.2f}x"] if worst > WORST_RATIO else []
    print(
        f"goal (MAE <= {MEAN_GOAL:.0%} overall and per regime, no point off by more than {WORST_RATIO:g}x): "
        + (f"NOT met ({', '.join(misses)})" if misses else "met")
    )


def series_key(r: Row) -> tuple[Any, ...]:
    """The rows of one scaling series: same source, system, model, batch, mode, data and table, growing GPUs."""
    return r.source, r.system, r.model, r.batch, r.mode, r.data, r.series


def series_name(r: Row) -> str:
    """A series as the disagreement lines name it."""
    return f"{r.source}, {framework_of(r) if r.series else r.system}, {r.model} {r.precision} batch {r.batch}"


def direction(results: list[tuple[Row, float, float]]) -> None:
    """Whether the plan answers "does adding GPUs pay?" as the publication does: along each series (same source,
    system, model, batch, mode and data, growing GPUs), the sign of each step's change in throughput, counting a
    published change under 3% as "no gain" (within a page's run-to-run noise)."""
    series: dict[tuple[Any, ...], list[tuple[int, float, float, Row]]] = defaultdict(list)
    for r, planned, _ in results:
        series[series_key(r)].append((r.gpus, r.images_per_sec, planned, r))
    total, disagree = 0, []
    for points in series.values():
        points = sorted({p[0]: p for p in points}.values(), key=lambda p: p[0])
        for (gpus0, pub0, plan0, _), (gpus1, pub1, plan1, r) in zip(points, points[1:]):
            total += 1
            if (pub1 > 1.03 * pub0) != (plan1 > 1.03 * plan0):
                disagree.append(
                    f"  disagrees: {series_name(r)}: "
                    f"{gpus0} -> {gpus1} GPUs published {pub1 / pub0 - 1:+.1%}, planned {plan1 / plan0 - 1:+.1%}"
                )
    print(f"{'adding GPUs pays (direction agrees)':56} {total:6d} {1 - len(disagree) / max(total, 1):7.0%}")
    for line in disagree:
        print(line)


def host_limits(results: list[tuple[Row, float, float]]) -> None:
    """Whether the plan answers "where does adding hosts stop paying?" as the publication does: along each series
    that spans hosts (``series_key``'s, each host count at its most GPUs), the first host count
    that gains under 3% over the one before, or none within the published range."""
    series: dict[tuple[Any, ...], dict[int, tuple[int, float, float, Row]]] = defaultdict(dict)
    for r, planned, _ in results:
        by_hosts = series[series_key(r)]
        if r.hosts not in by_hosts or r.gpus > by_hosts[r.hosts][0]:
            by_hosts[r.hosts] = (r.gpus, r.images_per_sec, planned, r)
    total, disagree = 0, []
    for by_hosts in series.values():
        if max(by_hosts) < 2:
            continue
        points = [by_hosts[h] for h in sorted(by_hosts)]
        total += 1
        published, planned = _stop(points, 1), _stop(points, 2)
        if published != planned:
            r = points[-1][3]
            disagree.append(
                f"  disagrees: {series_name(r)}: "
                f"published {_hosts(published, r.hosts)}, planned {_hosts(planned, r.hosts)}"
            )
    print(f"{'where adding hosts stops paying (agrees)':56} {total:6d} {1 - len(disagree) / max(total, 1):7.0%}")
    for line in disagree:
        print(line)


def _stop(points: list[tuple[int, float, float, Row]], which: int) -> int | None:
    """The host count of the first of ``points`` (by hosts) that gains under 3% over the one before (``which``:
    1 published, 2 planned throughput), or None."""
    for before, after in zip(points, points[1:]):
        if after[which] <= 1.03 * before[which]:
            return after[3].hosts
    return None


def _hosts(stop: int | None, last: int) -> str:
    return f"pays up to {last} hosts" if stop is None else f"stops paying at {stop} hosts"


def ordering(results: list[tuple[Row, float, float]]) -> None:
    """Whether the plan answers "which of two configurations is faster?" as the publication does: every pair of
    rows of one source on the same system, model, GPUs, hosts and data that differ in how they train (mode,
    framework, precision or batch), compared by images/s. Pairs the publication puts within 3% of each other are
    a tie there and are not counted."""
    same: dict[tuple[Any, ...], list[tuple[Row, float]]] = defaultdict(list)
    for r, planned, _ in results:
        same[(r.source, r.system, r.model, r.gpus, r.hosts, r.data)].append((r, planned))
    agree = total = 0
    for rows in same.values():
        for i, (a, plan_a) in enumerate(rows):
            for b, plan_b in rows[i + 1 :]:
                if max(a.images_per_sec, b.images_per_sec) < 1.03 * min(a.images_per_sec, b.images_per_sec):
                    continue
                total += 1
                agree += (a.images_per_sec > b.images_per_sec) == (plan_a > plan_b)
    print(f"{'which of two configurations is faster (agrees)':56} {total:6d} {agree / max(total, 1):7.0%}")


def _mae(errs: list[float]) -> float:
    return statistics.mean(abs(e) for e in errs)


def _error_head(name: str, errs: list[float]) -> str:
    """The start of a line of the error tables: the points, the mean absolute error and the bias."""
    return f"{name:56} {len(errs):6d} {_mae(errs):7.1%} {statistics.mean(errs):+7.1%}"


def _error_line(name: str, errs: list[float]) -> str:
    """One line of the error tables: ``_error_head``'s and the worst error."""
    return f"{_error_head(name, errs)} {max(errs, key=abs):+7.1%}"


def _worst_ratio(errs: list[float]) -> float:
    """How many times off the worst point is, either way."""
    return max(max(1 + e, 1 / (1 + e)) for e in errs)


if __name__ == "__main__":
    run_script(main)
