"""``trainscale profile`` and ``trainscale plan``: flags, checks, and what they print."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from trainscale.console import format_table
from trainscale.errors import ConfigError
from trainscale.io import check_output, check_replaceable, dumps, save_figure
from trainscale.plan.describe import MAX_COUNT, ClusterSpec, Device, load_device
from trainscale.plan.methods import parse_spec
from trainscale.plan.plan import (
    PlanConfig,
    check_profile_model,
    plan_profile,
    setting_from,
    swept_rate,
    unused_bandwidth,
    with_bandwidth,
)
from trainscale.plan.predict import MODES, Prediction, PSLayout, Setting, crossover, crossover_text, predict
from trainscale.plan.profile import Profile, ProfileConfig, profile_command
from trainscale.runtime.cluster import format_rate

MIB = 2**20


def run_profile(cfg: ProfileConfig) -> int:
    p = profile_command(cfg)
    print(
        f"{p.model} at batch {p.batch_size} ({p.precision}) on {p.device}, {p.threads} thread(s)"
        + (f" under {p.cpus:g} CPUs" if p.cpus else "")
    )
    print(
        f"  data {1e3 * p.data.median:.1f} ms, forward {1e3 * p.forward.median:.1f} ms, "
        f"backward {1e3 * p.backward.median:.1f} ms, optimizer "
        f"{1e3 * p.optimizer.median:.1f} ms (medians of {p.forward.repeats}; step {1e3 * p.compute_seconds:.1f} ms)"
    )
    print(
        f"  {len(p.buckets)} DDP bucket(s), {p.gradient_bytes / MIB:.2f} MiB of fp32 gradients; peak memory "
        f"{p.peak_memory_mb:.0f} MB"
    )
    if p.overlap_seconds:
        print(f"  {overlap_text(p)}")
    elif p.overlap_unmeasured:
        print(
            f"  overlap and DDP's per-step and per-bucket costs not measured: {p.overlap_unmeasured} (the plan says "
            "what it takes instead)"
        )
    if p.input_images_per_sec is not None:
        print(
            f"  input pipeline ({cfg.input_data}): {p.input_images_per_sec:,.0f} images/s with "
            f"{p.input_workers} loader worker(s) on {p.input_cores:g} core(s)"
        )
    for c in p.compressors.values():
        sent = sum(n for _, n in c.collectives)
        print(
            f"  {c.spec}: encode {1e3 * c.encode.median:.1f} ms, decode {1e3 * c.decode.median:.1f} ms, "
            f"{sent / MIB:.3f} MiB handed to {len(c.collectives)} collective(s)"
        )
    print(f"profile in {cfg.out}")
    return 0


def overlap_text(p: Profile) -> str:
    """What the overlap measurement found, in words."""
    m = p.overlap_seconds
    share = "nothing can hide" if p.overlap is None else f"overlap {p.overlap:.2f}"
    cost = "" if p.step_overhead is None else f"; DDP's cost per step {_ms(p.step_overhead)} ms"
    cost += "" if p.bucket_overhead is None else f", per bucket {1e6 * p.bucket_overhead:.0f} us"
    rate = p.pair_bytes_per_sec
    if rate is not None:
        cost += (
            f"; the two ranks all-reduced at {rate / 1e9:.3g}GB/s (a plan's --intra-bandwidth for workers of one host)"
        )
    return (
        f"{share}: the buckets' all-reduces take {_ms(m['comm'])} ms alone ({_pair(p)}), backward "
        f"{_ms(m['backward'])} ms; launched from backward they lengthen it by {_ms(m['exposed'])} ms (perfect "
        f"overlap: {_ms(m['schedule_bound'])} ms, none: {_ms(m['comm'])} ms){_clipped(p)}{cost}"
    )


def _pair(p: Profile) -> str:
    return "gloo, two ranks here" if p.on_cpu else "NCCL, with a second GPU of this machine"


def _clipped(p: Profile) -> str:
    """Where the measured lengthening fell outside [perfect overlap, none], the overlap is a bound, not a
    measurement: said beside it."""
    m = p.overlap_seconds
    if p.overlap is None:
        return ""
    if m["exposed"] < m["schedule_bound"]:
        return " [below what perfect overlap still exposes: within the noise, so 1.00 is a bound; take more --repeats]"
    if m["exposed"] > m["comm"]:
        return (
            " [longer than the all-reduces alone: they and backward compete for this machine's cores; 0.00 is a bound]"
        )
    return ""


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:.1f}"


def readable_rate(bits: float) -> str:
    """bit/s as a person reads them: exact where the rate is a round number of a unit (``100mbit``), else three
    significant digits (``34.8gbit``, as an efficiency below 1 leaves it)."""
    exact = format_rate(int(bits))
    if exact[-4] in "gmk":  # 100mbit, not 100000000bit
        return exact
    for unit, size in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bits >= size:
            return f"{bits / size:.3g}{unit}"
    return f"{bits:.3g}bit"


def describe_servers(s: Setting) -> str:
    """Where a parameter-server plan puts its servers and the model's tensors, as the plan charges them."""
    ps = s.ps
    tensors = {
        "shard": "the model sharded evenly",
        "round_robin": "whole tensors round robin",
        "by_size": "whole tensors by size",
    }[ps.assignment]
    rate = f", at {ps.efficiency:.0%} of line rate" if ps.efficiency < 1 else ""
    if ps.placement == "separate":
        return f"{s.servers} server host(s) of their own, {tensors}{rate}"
    if s.hosts == 1:
        return f"{s.servers} server(s) on the host, {tensors}{rate}"
    if ps.total is not None:
        return f"servers beside the workers on {min(ps.total, s.hosts)} of the hosts, {tensors}{rate}"
    if ps == PSLayout():
        ignored = f" (--servers {s.servers} per host: the same traffic between hosts)" if s.servers > 1 else ""
        return f"servers beside the workers on every host, {tensors}{ignored}"
    return f"{s.servers} server(s) beside the workers on every host, {tensors}{rate}"


def describe_setting(s: Setting) -> str:
    link = s.link
    where = f"{s.hosts} host(s) x {s.per_host} worker(s)"
    rate = "no link" if s.workers == 1 else f"{readable_rate(link.bandwidth * 8)} links"
    if s.hosts > 1 and s.nics > 1:
        rate += f" ({s.nics} NICs per host)"
    if s.per_host > 1 and s.intra_efficiency < 1:
        rate += f" (devices' link at {s.intra_efficiency:.1%} of its rate)"
    if s.workers > 1 and s.mode == "sync" and s.algorithm != "ring":
        rate += f", all-reduce {s.algorithm}"
    return (
        f"{where}, {rate}; mode {s.mode}, compress {s.spec.text}"
        + (f"; {describe_servers(s)}" if s.mode in ("ps-sync", "async") and s.workers > 1 else "")
        + (f", sync every {s.sync_every}" if s.mode in ("localsgd", "diloco") else "")
        + (", 16-bit gradients" if s.grad_scale < 1 and s.spec.dense else "")
        + (f", {s.accumulate} micro-steps per optimizer step" if s.accumulate > 1 else "")
    )


def print_plan(profile: Profile, setting: Setting, p: Prediction, origin: str) -> None:
    print(
        f"plan: {profile.model} at batch {setting.batch_size or profile.batch_size} per worker "
        f"({profile.precision}) on {describe_setting(setting)}"
    )
    print(f"  compute from {origin}")
    parts = f"compute {_ms(p.compute_seconds)} + communication {_ms(p.comm_seconds)}"
    if setting.host_images_per_sec and p.step_seconds > p.compute_seconds + p.comm_seconds:
        step = (
            f"step {_ms(p.step_seconds)} ms, bound by the host's input pipeline ({setting.host_images_per_sec:,.0f} "
            f"images/s for its {setting.per_host} worker(s)); without it {parts}"
        )
    else:
        step = f"step {_ms(p.step_seconds)} ms = {parts}"
    print(
        f"  {step} (encode {_ms(p.encode_seconds)}, decode {_ms(p.decode_seconds)}); collectives in "
        f"flight {_ms(p.wire_seconds)} ms, {_ms(p.hidden_seconds)} ms of it hidden under backward"
    )
    print(
        f"  {p.images_per_sec:,.0f} images/s, scaling efficiency {p.scaling_efficiency:.2f} at {p.workers} "
        f"worker(s); {p.bytes_per_step_per_link / MIB:.2f} MiB per step over each link"
    )


_EXAMPLE = {"workers": "1,2,4,8", "bandwidth": "100mbit,1gbit"}


def sweep_axes(items: list[str], setting: Setting) -> tuple[list[int], list[str]]:
    """The worker counts and bandwidths of ``--sweep``, checked before any plan: each key once, worker counts
    that fill whole hosts of the plan's shape (a sweep cell never plans another count than its row says)."""
    axes: dict[str, list[str]] = {}
    for item in items:
        key, eq, values = item.partition("=")
        if not eq or key not in ("workers", "bandwidth"):
            raise ConfigError(f"--sweep {item!r}: expected workers=1,2,4 or bandwidth=100mbit,1gbit")
        if key in axes:
            raise ConfigError(f"--sweep {key}= given twice; give one list, e.g. {key}=" + _EXAMPLE[key])
        axes[key] = [v.strip() for v in values.split(",") if v.strip()]
        if not axes[key]:
            raise ConfigError(f"--sweep {item!r}: give at least one value, e.g. {key}=" + _EXAMPLE[key])
    try:
        workers = [int(w) for w in axes.get("workers", [str(setting.workers)])]
    except ValueError:
        raise ConfigError(f"--sweep workers={','.join(axes['workers'])}: whole numbers, e.g. 1,2,4,8") from None
    if any(not 1 <= w <= MAX_COUNT for w in workers):
        raise ConfigError(f"--sweep workers: every count must be 1 to {MAX_COUNT}")
    uneven = [w for w in workers if w > setting.per_host and w % setting.per_host]
    if uneven:
        raise ConfigError(
            f"--sweep workers={uneven[0]}: hosts of {setting.per_host} workers hold 1 to {setting.per_host} workers "
            f"or a multiple of {setting.per_host}; sweep e.g. workers={_host_multiples(setting.per_host)}"
        )
    bandwidths = axes.get("bandwidth", [])
    for text in bandwidths:
        with_bandwidth(setting, text)  # a bad rate fails here, before any table
    return workers, bandwidths


def _host_multiples(per_host: int) -> str:
    return ",".join(str(n) for n in sorted({1, per_host, 2 * per_host, 4 * per_host}))


def run_sweep(profile: Profile, setting: Setting, workers: list[int], bandwidths: list[str]) -> dict[str, Any]:
    """Every workers x bandwidth cell (:func:`sweep_axes`); without a bandwidth list, the plan's own links
    (labelled by their line rate) in every row."""
    cells: list[tuple[str, Setting]] = [(bw, with_bandwidth(setting, bw)) for bw in bandwidths]
    rows = [
        {"bandwidth": label, **predict(profile, at.with_workers(w)).to_dict()}
        for label, at in cells or [(swept_rate(setting), setting)]
        for w in workers
    ]
    crossovers = crossover_table(profile, setting.with_workers(max(workers)))
    return {
        "rows": rows,
        "crossover": crossovers,
        "workers": workers,
        "bandwidths": bandwidths or [swept_rate(setting)],
    }


def crossover_table(profile: Profile, setting: Setting) -> list[dict[str, Any]]:
    """For every profiled compressor (and dense fp32): the bandwidth below which it beats bf16 all-reduce."""
    base = replace(setting, spec=parse_spec("bf16")) if "bf16" in profile.compressors else None
    out = []
    for text in ["none", *profile.compressors]:
        spec = parse_spec(text)
        if base is None or spec.text == "bf16":
            continue
        found = crossover(profile, replace(setting, spec=spec), base)
        out.append({"method": spec.text, "workers": setting.workers, "below": crossover_text(found)})
    return out


def print_sweep(result: dict[str, Any], setting: Setting) -> None:
    print(
        format_table(
            result["rows"],
            [
                ("bandwidth", "bandwidth", str),
                ("workers", "workers", str),
                ("step_seconds", "step ms", _ms),
                ("compute_seconds", "compute ms", _ms),
                ("comm_seconds", "comm ms", _ms),
                ("images_per_sec", "img/s", lambda v: f"{v:,.0f}"),
                ("scaling_efficiency", "efficiency", lambda v: f"{v:.2f}"),
            ],
        )
    )
    between = setting.hosts > 1 or setting.inter is not None  # what with_bandwidth sweeps
    if setting.efficiency < 1 and between:
        print(
            f"bandwidth: the line rate between hosts; the plan charges {setting.efficiency:.1%} of it (the "
            "transport's efficiency), in the crossovers too"
        )
    if setting.intra_efficiency < 1 and not between:
        print(
            f"bandwidth: the devices' link; the plan charges {setting.intra_efficiency:.1%} of it (the framework's "
            "efficiency inside a host)"
        )
    if result["crossover"]:
        print(f"\nbeats bf16 all-reduce below ({setting.mode}, {max(result['workers'])} workers):")
        print(format_table(result["crossover"], [("method", "method", str), ("below", "bandwidth", str)]))


def check_plot(path: Path) -> None:
    """``--plot``: a file trainscale may write, in a format matplotlib draws (its suffix; none: PNG)."""
    from matplotlib.backend_bases import FigureCanvasBase

    kinds = FigureCanvasBase.get_supported_filetypes()
    kind = path.suffix.lstrip(".").lower()
    if kind and kind not in kinds:
        raise ConfigError(f"--plot {path}: cannot draw .{kind} files; use one of .{', .'.join(sorted(kinds))}")
    check_output(path, "--plot", probe=True)
    check_replaceable(path, "--plot", "a figure", is_figure)


FIGURE_STARTS = (b"\x89PNG", b"%PDF", b"%!PS", b"<?xml", b"<svg", b"\xff\xd8", b"II*\x00", b"MM\x00*", b"RIFF")


def is_figure(path: Path) -> bool:
    """Whether ``path`` holds an image (PNG, PDF, PostScript, SVG, JPEG, TIFF, WebP): what ``--plot`` may replace."""
    with path.open("rb") as f:
        return f.read(8).startswith(FIGURE_STARTS)


def plot_sweep(result: dict[str, Any], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for bw in result["bandwidths"]:
        rows = [r for r in result["rows"] if r["bandwidth"] == bw]
        ax.plot([r["workers"] for r in rows], [r["scaling_efficiency"] for r in rows], marker="o", label=bw)
    ax.set(xlabel="workers", ylabel="scaling efficiency (predicted)", ylim=(0, 1.05), title=title)
    ax.set_xscale("log", base=2)
    ax.legend(title="link")
    fig.tight_layout()
    try:
        save_figure(fig, path, dpi=120)
    finally:
        plt.close(fig)


def projection(profile: Profile, setting: Setting, cluster: ClusterSpec, given: bool) -> list[dict[str, Any]]:
    """The cluster page's published scaling figures for the profiled model, each beside the planner's. The
    device's step comes from where the plan's comes from: the step time the user gave (``given``), scaled to each
    row's batch, else the cluster's device file."""
    rows = []
    device = load_device(cluster.device) if cluster.device and not given else None
    for row in cluster.published:
        if row.get("model") != profile.model or (device is None and not given) or row.get("mode") not in MODES:
            continue
        s = published_setting(profile, setting, row, device)
        predicted = predict(profile, s)
        rows.append(
            {
                "devices": int(row["devices"]),
                "hosts": s.hosts,
                "batch": int(row["batch_size"]),
                "mode": s.mode,
                "published": float(row["images_per_sec"]),
                "predicted": predicted.images_per_sec,
                "ratio": predicted.images_per_sec / float(row["images_per_sec"]),
                "source": str(row.get("source", "")),
            }
        )
    return rows


def published_setting(profile: Profile, setting: Setting, row: dict[str, Any], device: Device | None) -> Setting:
    """The Setting of one published row: its hosts and devices, its per-device batch on the cluster's device
    (None: the plan's own step, in proportion to the batch). A row's ``workers_per_host`` (ps-lite: one process
    per machine driving its GPUs) makes each worker's batch the sum of its devices' and its step the device's
    step at the per-device batch."""
    batch, devices, hosts = int(row["batch_size"]), int(row["devices"]), int(row.get("hosts", 1))
    per_host = int(row.get("workers_per_host", max(1, devices // hosts)))
    if device is None:
        scale = setting.compute_scale * batch / (setting.batch_size or profile.batch_size)
    else:
        scale = device.step_seconds(profile.model, batch, profile.precision)[0] / profile.compute_seconds
    return replace(
        setting,
        hosts=hosts,
        per_host=per_host,
        mode=str(row["mode"]),
        compute_scale=scale,
        batch_size=batch * devices // hosts // per_host,
    )


def print_projection(rows: list[dict[str, Any]], cluster: ClusterSpec, given: bool) -> None:
    compute = "the step time given, in proportion to each row's batch" if given else f"{cluster.device}'s figures"
    print(f"\n{cluster.name}: published against planned ({cluster.source}); planned with {compute}")
    print(
        format_table(
            rows,
            [
                ("devices", "devices", str),
                ("hosts", "hosts", str),
                ("batch", "batch", str),
                ("mode", "mode", str),
                ("published", "published img/s", lambda v: f"{v:,.0f}"),
                ("predicted", "planned img/s", lambda v: f"{v:,.0f}"),
                ("ratio", "planned/published", lambda v: f"{v:.2f}"),
            ],
        )
    )


def given_compute(cfg: PlanConfig) -> bool:
    """The device's step is the user's (a step time, a device step, a parameter count's plan), not a file's."""
    return cfg.params is not None or cfg.step_time is not None or cfg.device_step_ms is not None


def run_plan(cfg: PlanConfig) -> int:
    cfg.validate()
    if cfg.sweep:
        check_plot(Path(cfg.plot))
    profile = plan_profile(cfg)
    if cfg.params is None:
        check_profile_model(cfg, profile)
    setting, cluster, origin = setting_from(cfg, profile)
    axes = sweep_axes(cfg.sweep, setting) if cfg.sweep else None
    origin += unused_bandwidth(cfg, setting, axes[0] if axes else [setting.workers])
    if setting.spec.text != "none":
        profile.compressor(setting.spec)  # a compressor the profile did not time fails here
    prediction = predict(profile, setting)
    result: dict[str, Any] = {
        **prediction.to_dict(),
        "setting": describe_setting(setting),
        "compute_from": origin,
        "framework": {
            **setting.framework_costs(),
            "one_host_images_per_sec": cfg.one_host_images_per_sec,
            "two_host_images_per_sec": cfg.two_host_images_per_sec,
            "two_device_images_per_sec": cfg.two_device_images_per_sec,
        },
    }
    if axes:
        result["sweep"] = run_sweep(profile, setting, *axes)
    if cluster is not None and cluster.published:
        result["published"] = projection(profile, setting, cluster, given_compute(cfg))
    if cfg.json:
        print(dumps(result), end="")  # NaN/inf as null: the output stays JSON every reader parses
    else:
        print_plan(profile, setting, prediction, origin)
        if cfg.sweep:
            print()
            print_sweep(result["sweep"], setting)
        if cluster is not None and result.get("published"):
            print_projection(result["published"], cluster, given_compute(cfg))
    if cfg.sweep:
        plot_sweep(result["sweep"], Path(cfg.plot), f"{profile.model}, {setting.mode}, {setting.spec.text}")
        if not cfg.json:
            print(f"\nplot in {cfg.plot}")
    return 0
