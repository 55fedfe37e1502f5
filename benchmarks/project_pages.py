"""The results pages, projected: every published scaling row of the shipped cluster files beside the planner's figure.

For each model a page published figures for, one CPU profile is taken through the CLI (``trainscale profile``; the
planner takes the model's gradient bytes and DDP bucket timing from it, and each device's step time from the
device file the cluster names); then ``trainscale plan --profile P --cluster C --json`` plans every row of every
cluster that has the model. Prints one table (planned img/s, published img/s, planned/published per row; the
single-device rows are the calibration, 1.00 by construction) and writes it as Markdown beside result.json (the
environment included). Profiles already in ``--out`` are reused, so a second run only re-plans.

    .venv/bin/python benchmarks/project_pages.py --out runs/projection
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from trainscale.bench.script import COUNT, run_script
from trainscale.bench.timing import save_result
from trainscale.errors import OneLineParser
from trainscale.io import atomic_write_text
from trainscale.plan.describe import load_cluster
from trainscale.train.environment import environment

CLUSTERS = Path(__file__).resolve().parents[1] / "configs" / "clusters"
PAGE_BATCH = {"resnet50": 32, "inception_v3": 32}  # the Keras page's per-GPU batch; 128 for the others


def clusters() -> list[str]:
    return sorted(p.stem for p in CLUSTERS.glob("*.toml"))


def published_models(names: list[str]) -> dict[str, list[str]]:
    """Each cluster file's models with published rows, in row order, each file read once."""
    return {name: list(dict.fromkeys(str(row["model"]) for row in load_cluster(name).published)) for name in names}


def models_of(published: dict[str, list[str]]) -> list[str]:
    """The models some cluster file has published rows for, in first-seen order."""
    return list(dict.fromkeys(m for models in published.values() for m in models))


def cli(*args: str, may_refuse: bool = False) -> tuple[str, str | None]:
    """One ``trainscale`` command's stdout, and its one-line refusal (exit 2) where ``may_refuse``; any other
    failure stops the benchmark with the command's own message."""
    proc = subprocess.run([sys.executable, "-m", "trainscale", *args], capture_output=True, text=True)
    if proc.returncode == 2 and may_refuse:
        return "", proc.stderr.strip().splitlines()[-1]
    if proc.returncode != 0:
        sys.exit(f"project_pages.py: trainscale {' '.join(args)} failed:\n{proc.stderr.strip()[-2000:]}")
    return proc.stdout, None


def profile(model: str, out: Path, repeats: int) -> Path:
    batch = PAGE_BATCH.get(model, 128)
    path = out / "profiles" / f"{model}-b{batch}.json"
    if not path.exists():
        print(f"profiling {model} at batch {batch} ...", flush=True)
        cli(
            "profile",
            "--model",
            model,
            "--batch-size",
            str(batch),
            "--repeats",
            str(repeats),
            "--no-overlap",
            "--out",
            str(path),
        )
    return path


def projected_rows(cluster: str, model: str, profile_path: Path) -> tuple[list[dict[str, Any]], str | None]:
    """The cluster's published rows of ``model``, each with the planner's images/s and the ratio; or none and the
    planner's reason (a page row whose model the cluster's device file has no throughput for)."""
    out, refused = cli("plan", "--profile", str(profile_path), "--cluster", cluster, "--json", may_refuse=True)
    if refused:
        return [], refused
    return [{"cluster": cluster, "model": model, **row} for row in json.loads(out).get("published", [])], None


def markdown(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table, in the README's form."""
    lines = [
        "| cluster | model | devices | hosts | batch per device | mode | published img/s | planned img/s "
        "| planned/published |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['cluster']} | {r['model']} | {r['devices']} | {r['hosts']} | {r['batch']} | {r['mode']} "
        f"| {r['published']:,.0f} | {r['predicted']:,.0f} | {r['ratio']:.2f} |"
        for r in rows
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/projection"))
    parser.add_argument("--repeats", type=COUNT, default=3, help="timed steps per profile (default 3)")
    args = parser.parse_args()
    published = published_models(clusters())
    rows, skipped = [], []
    for model in models_of(published):
        path = profile(model, args.out, args.repeats)
        for name, models in published.items():
            if model in models:
                planned, refused = projected_rows(name, model, path)
                rows += planned
                skipped += [{"cluster": name, "model": model, "reason": refused}] if refused else []
    table = markdown(rows)
    print("\n" + table)
    for s in skipped:
        print(f"not planned: {s['model']} on {s['cluster']}: {s['reason']}")
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out / "projection.md", table)
    save_result(
        args.out / "result.json",
        {
            "rows": rows,
            "skipped": skipped,
            "profile_batch": PAGE_BATCH,
            "default_batch": 128,
            "environment": environment(torch.device("cpu")),
        },
    )
    print(f"saved {args.out / 'projection.md'} and result.json (profiles in {args.out / 'profiles'})")
    return 0


if __name__ == "__main__":
    run_script(main)
