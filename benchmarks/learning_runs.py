"""The main job run N times with different seeds: what a user sees is the distribution, not one draw.

    .venv/bin/python benchmarks/learning_runs.py --runs 3 [--config configs/frozen_lake.yaml]
        [--stop-after-minutes M] [--checkpoint-maps N] [--first-maps N] [--minutes 5 10 15] [key=value ...]

Each run is `rollstream run CONFIG seed=S` in its own output dir, with its own embedded Redis; the seed also
builds its own tiny model (tokenizer, initial weights and format warm start), so runs differ the way two users'
runs differ. Runs go one after another: they would compete for the cores otherwise. `--report-only` runs nothing
and reports the runs already in the output dirs; `--stop-after-minutes M` ends each run (SIGTERM, the launcher's
graceful stop) M minutes after its trainer started, and then its "end" is that stop. From each run's
`metrics.jsonl` (wall-clock minutes since the trainer started beside every logged metric) it takes held-out
success, greedy (`val/success`) and sampled (`val_sampled/success`), as the last validation round logged by 5, 10
and 15 minutes and at the end, its peak (and when), the lowest value after the peak (a run that learned and
then collapsed shows there) and the lowest value after it first reached the goal's 0.6 (a dip between the first
good round and a later peak shows there), and writes:
- a table on stdout: min / median / max over runs at each of those times, of the peak and of the lows;
- `benchmarks/results/learning_runs-<exp>.csv`: one row per run (env, seed, build seconds, the figures above, and
  what tells a dip's kind apart: the lowest share of valid replies in a training batch and in greedy validation,
  and the largest approximate KL of a step);
- `benchmarks/results/learning_runs-<exp>.png`: every run's held-out curves on a wall-clock axis, with the
  reference policies on the first seed's held-out maps drawn as dashed lines (computed here, as validation does).

Validation plays the same few held-out maps every round (256 in the main job), an offset of their draw that no
number of rounds or runs of a seed averages out. `--checkpoint-maps N` plays each run's checkpoints greedily on N
held-out maps once every run has ended (`benchmarks/greedy_paths.py --maps N`, ~30 s a checkpoint at 1,024 maps on
2 cores; kept in the run's dir, so a second report reuses them) and adds, per mark, the figure of the last
checkpoint by then on those N maps to the table and the CSV. `--first-maps N` reports runs validated on more
maps as validation on their first N would have read them (greedy only), into `learning_runs-<exp>-firstN`: a
record kept on N maps goes on from such runs.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from rollstream.consumer.metrics import RECORD
from rollstream.consumer.validation import first_maps_key, reference_stats
from rollstream.shared.config import load_config

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
MINUTES = (5, 10, 15)
"""The default wall-clock marks of the table (`--minutes`: e.g. 10 20 30 for a 30-minute env)."""
CURVES = {"greedy": "val/success", "sampled": "val_sampled/success"}
BUILD_RECORD = "learning_runs.json"
"""Written into a run's output dir when it ends: its build seconds, which its metrics alone cannot give, so that
`--report-only` reports them too."""
REACHED = 0.6
"""The learning goal's bar (issue 16: every run >= 0.6 within 15 minutes, and never back below 0.5 after)."""
EXTREMES = {"valid_replies_min": ("rollout/valid_action_rate", min), "greedy_valid_min": ("val/valid_action_rate", min),
            "approx_kl_max": ("actor/approx_kl", max)}
"""Per run, what tells a dip's kind apart: the lowest share of valid replies in a training batch and in greedy
validation (a format wobble), and the largest step, as its approximate KL (a large update)."""


@dataclass
class Run:
    seed: int
    build_s: float | None
    """From launch to the trainer's start, the zero of its metrics' minutes: the model's build and the processes'
    start; the engine's start and any round before step 0 come after, on the run's clock (None for a run reported
    from its output dir before this was kept)."""
    records: list[dict[str, float]] = field(default_factory=list)
    max_steps: int | None = None
    """The config's; a run whose records end before a mark without reaching it was stopped early."""
    label: str = ""
    """The run's output dir name (`seed7`, or `seed42-2` for a seed's second run), for the plot's legend."""
    checkpoint_success: dict[int, float] = field(default_factory=dict)
    """Greedy success of each checkpoint (by step) on `--checkpoint-maps` held-out maps; empty when not asked."""

    def on_first_maps(self, maps: int) -> Run:
        """This run as validation on its first `maps` maps would have read it: the greedy curve from
        `first_maps_key(maps)` (logged by rounds over more maps), no sampled curve (rounds log it over all)."""
        first = first_maps_key(maps)
        records = []
        for record in self.records:
            kept = {k: v for k, v in record.items() if k not in CURVES.values()}
            if first in record:
                kept[CURVES["greedy"]] = record[first]
            records.append(kept)
        return replace(self, records=records, checkpoint_success={})

    def curve(self, key: str) -> list[tuple[float, float]]:
        return [(r["minutes"], r[key]) for r in self.records if key in r]

    def at(self, key: str, minutes: float | None) -> float | None:
        """The last value logged by `minutes` into the run (None: the end). A run that ended before `minutes` has
        its last value there only if it ran all its steps: one stopped early never saw that mark."""
        if minutes is not None and self.stopped_before(minutes):
            return None
        points = [v for m, v in self.curve(key) if minutes is None or m <= minutes]
        return points[-1] if points else None

    def at_checkpoint(self, minutes: float | None) -> float | None:
        """`checkpoint_success` of the last checkpoint by `minutes` into the run (None: the last of all)."""
        if not self.checkpoint_success or (minutes is not None and self.stopped_before(minutes)):
            return None
        when = {int(r["step"]): r["minutes"] for r in reversed(self.records)}  # each step's first record
        steps = [s for s in sorted(self.checkpoint_success) if minutes is None or when.get(s, float("inf")) <= minutes]
        return self.checkpoint_success[steps[-1]] if steps else None

    def stopped_before(self, minutes: float) -> bool:
        last = self.records[-1] if self.records else None
        return (last is not None and last["minutes"] < minutes
                and (self.max_steps is None or last["step"] < self.max_steps))

    def extreme(self, name: str) -> float | None:
        """One of EXTREMES over the whole run (None: the metric was never logged)."""
        key, pick = EXTREMES[name]
        values = [value for _, value in self.curve(key)]
        return pick(values) if values else None

    def peak(self, key: str) -> tuple[float, float] | None:
        """(best value, minutes when first reached) over the run."""
        points = self.curve(key)
        if not points:
            return None
        minutes, value = max(points, key=lambda p: (p[1], -p[0]))
        return value, minutes

    def low_after_peak(self, key: str) -> float | None:
        """The lowest value logged after the peak: how far a run fell back from its best."""
        peak = self.peak(key)
        return self.low_after_reaching(key, peak[0]) if peak else None  # the peak is the first round at its value

    def low_after_reaching(self, key: str, bar: float = REACHED) -> float | None:
        """The lowest value logged after the first round at or above `bar` (None: never reached, or nothing after)."""
        points = self.curve(key)
        first = next((i for i, (_, v) in enumerate(points) if v >= bar), None)
        after = [v for _, v in points[first + 1:]] if first is not None else []
        return min(after) if after else None


def run_dirs(out_root: Path, seeds: Sequence[int]) -> list[Path]:
    """One output dir per run: `seed<S>`, and `seed<S>-<k>` for the k-th run of a seed given again (`--seeds 42 42
    42`: `make run`'s seed three times, the same model built each time, runs apart only by timing)."""
    seen: Counter[int] = Counter()
    dirs = []
    for seed in seeds:
        seen[seed] += 1
        dirs.append(out_root / (f"seed{seed}" if seen[seed] == 1 else f"seed{seed}-{seen[seed]}"))
    return dirs


def run_once(config: Path, seed: int, out: Path, overrides: list[str], stop_minutes: float | None) -> Run:
    cmd = [sys.executable, "-m", "rollstream", "run", str(config), f"seed={seed}", f"output_dir={out}",
           "wandb_mode=disabled", *overrides]
    print(f"--- run seed={seed}: {' '.join(cmd[2:])}", flush=True)
    launched = time.time()
    env = {k: v for k, v in os.environ.items() if k != "ROLLSTREAM_REDIS_URL"}  # each run its own embedded Redis
    child = subprocess.Popen(cmd, env=env)
    stopped = False
    while child.poll() is None:
        time.sleep(5)
        if stop_minutes is not None and not stopped and trainer_minutes(out) >= stop_minutes:
            print(f"--- seed={seed}: {stop_minutes} min into the run, stopping it (SIGTERM)", flush=True)
            child.send_signal(signal.SIGTERM)  # the launcher's graceful stop: producers, trainer, Redis
            stopped = True
    if child.returncode != 0 and not stopped:
        raise SystemExit(f"run with seed {seed} exited with code {child.returncode}; its logs are under {out}/logs")
    run = load_run(out, seed)
    first = run.records[0]
    run.build_s = first["time"] - 60 * first["minutes"] - launched
    (out / BUILD_RECORD).write_text(json.dumps({"build_s": run.build_s}))
    return run


def trainer_minutes(out: Path) -> float:
    """Minutes since the trainer started, from the last record of the run's metrics (0 before the first)."""
    try:
        lines = (out / RECORD).read_text().splitlines()
    except FileNotFoundError:
        return 0.0
    last = next((line for line in reversed(lines) if line.strip()), None)
    try:
        return float(json.loads(last)["minutes"]) if last else 0.0
    except (ValueError, KeyError):  # a line being written as we read
        return 0.0


def load_run(out: Path, seed: int) -> Run:
    records = [json.loads(line) for line in (out / RECORD).read_text().splitlines() if line.strip()]
    build = out / BUILD_RECORD
    build_s = json.loads(build.read_text())["build_s"] if build.exists() else None  # None: run before it was kept
    return Run(seed, build_s, records, label=out.name)


def checkpoint_success(out: Path, maps: int) -> dict[int, float]:
    """Greedy success of each of the run's checkpoints on `maps` held-out maps, played once and kept in its dir."""
    steps = sorted(int(d.name.removeprefix("step_")) for d in (out / "checkpoints").glob("step_*"))
    if not steps:
        return {}
    kept = out / f"checkpoint_maps_{maps}.json"
    if not kept.exists() or set(json.loads(kept.read_text())["steps"]) != {str(s) for s in steps}:
        print(f"--- {out.name}: checkpoints {steps} on {maps} held-out maps", flush=True)
        subprocess.run([sys.executable, str(REPO / "benchmarks" / "greedy_paths.py"), str(out), "--steps",
                        *map(str, steps), "--maps", str(maps), "--sampled-rounds", "0", "--json", str(kept)],
                       check=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    return {int(step): f["on_all_maps"] for step, f in json.loads(kept.read_text())["steps"].items()}


def references(config: Path, seed: int, overrides: list[str]) -> dict[str, float]:
    """The reference policies' success on the held-out maps that `seed` validates on (each seed has its own)."""
    return reference_stats(load_config(config, [*overrides, f"seed={seed}"]))


def summary_rows(runs: list[Run], marks: Sequence[float] = MINUTES, checkpoint_maps: int | None = None
                 ) -> list[list[str]]:
    def spread(values: list[float | None]) -> str:
        present = [v for v in values if v is not None]
        if not present:
            return "-"
        return f"{min(present):.2f} / {statistics.median(present):.2f} / {max(present):.2f}"

    rows = []
    for minutes in (*marks, None):
        label = f"{minutes:g} min" if minutes else "end"
        rows.append([label, *(spread([r.at(key, minutes) for r in runs]) for key in CURVES.values())])
        if checkpoint_maps:
            rows.append([f"{label}, last checkpoint on {checkpoint_maps} maps",
                         spread([r.at_checkpoint(minutes) for r in runs]), "-"])
    rows.append(["peak", *(spread([p[0] if (p := r.peak(key)) else None for r in runs]) for key in CURVES.values())])
    rows.append(["lowest after the peak", *(spread([r.low_after_peak(key) for r in runs]) for key in CURVES.values())])
    rows.append([f"lowest after first >= {REACHED:g}",
                 *(spread([r.low_after_reaching(key) for r in runs]) for key in CURVES.values())])
    return rows


def write_csv(path: Path, env_name: str, runs: list[Run], marks: Sequence[float] = MINUTES,
              checkpoint_maps: int | None = None) -> None:
    columns = ["env", "seed", "build_s", "steps", "run_minutes"]
    columns += [f"{name}_success_{m:g}min" for m in marks for name in CURVES] + [f"{n}_success_end" for n in CURVES]
    columns += [f"{n}_{what}" for n in CURVES for what in ("success_peak", "peak_minutes", "success_after_peak_min",
                                                           f"success_after_{REACHED:g}_min")]
    columns += list(EXTREMES)
    if checkpoint_maps:
        columns += [f"greedy_success_{m:g}min_{checkpoint_maps}maps" for m in marks]
        columns += [f"greedy_success_end_{checkpoint_maps}maps"]
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(columns)
        for r in runs:
            figures = [r.at(key, m) for m in marks for key in CURVES.values()]
            figures += [r.at(key, None) for key in CURVES.values()]
            for key in CURVES.values():
                peak = r.peak(key)
                figures += [*(peak or (None, None)), r.low_after_peak(key), r.low_after_reaching(key)]
            figures += [r.extreme(name) for name in EXTREMES]
            if checkpoint_maps:
                figures += [r.at_checkpoint(m) for m in (*marks, None)]
            writer.writerow([env_name, r.seed, "" if r.build_s is None else round(r.build_s, 1),
                             int(r.records[-1]["step"]),
                             round(r.records[-1]["minutes"], 2),
                             *("" if v is None else round(v, 4) for v in figures)])


def plot(path: Path, runs: list[Run], refs: dict[str, float], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(CURVES), figsize=(11, 4), sharey=True, squeeze=False)
    for ax, (name, key) in zip(axes[0], CURVES.items()):
        for i, run in enumerate(runs):
            points = run.curve(key)
            if points:
                ax.plot(*zip(*points), color=f"C{i}", marker=".", label=run.label or f"seed {run.seed}")
        for j, (ref, value) in enumerate(sorted(refs.items())):
            ax.axhline(value, linestyle="--", linewidth=0.8, color="gray", alpha=0.4 + 0.2 * j, label=ref)
        ax.set_title(f"held-out success, {name}")
        ax.set_xlabel("minutes since the trainer started")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seeds", type=int, nargs="*",
                        help="default: 1..runs; a seed given again runs again (42 42 42: make run's seed, 3 runs)")
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "frozen_lake.yaml")
    parser.add_argument("--out", type=Path, default=REPO / "output" / "learning_runs")
    parser.add_argument("--report-only", action="store_true",
                        help="run nothing: report the runs already in the output dirs (e.g. after a cut-off sweep)")
    parser.add_argument("--stop-after-minutes", type=float, default=None, metavar="M",
                        help="stop each run M minutes after its trainer started (e.g. 16 for the 15-minute figure)")
    parser.add_argument("--minutes", type=float, nargs="+", default=list(MINUTES), metavar="M",
                        help="wall-clock marks of the table and the CSV (default: 5 10 15); "
                             "key=value overrides go before it (it takes every value that follows)")
    parser.add_argument("--checkpoint-maps", type=int, default=None, metavar="N",
                        help="also play each run's checkpoints greedily on N held-out maps (e.g. 1024)")
    parser.add_argument("--first-maps", type=int, default=None, metavar="N",
                        help="runs validated on more maps, reported greedy on their first N (val_first<N>/success) "
                             "into learning_runs-<exp>-first<N>.{csv,png}, the references on those N maps")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides for every run")
    args = parser.parse_args()
    seeds = args.seeds or list(range(1, args.runs + 1))
    cfg = load_config(args.config, args.overrides)
    env_name = "+".join(cfg.train_env_manager.tags)
    out_root = args.out / cfg.exp_name
    dirs = run_dirs(out_root, seeds)
    if args.report_only:
        runs = [load_run(out, seed) for seed, out in zip(seeds, dirs)]
    else:
        runs = [run_once(args.config, seed, out, args.overrides, args.stop_after_minutes)
                for seed, out in zip(seeds, dirs)]
    # Checkpoints are played on maps of their own, not the first ones a --first-maps view reads: not played for it.
    checkpoint_maps = None if args.first_maps else args.checkpoint_maps
    for run, out in zip(runs, dirs):
        run.max_steps = cfg.max_steps
        if checkpoint_maps:
            run.checkpoint_success = checkpoint_success(out, checkpoint_maps)

    exp, ref_overrides = cfg.exp_name, args.overrides
    if args.first_maps:
        runs = [run.on_first_maps(args.first_maps) for run in runs]
        exp += f"-first{args.first_maps}"
        ref_overrides = [*args.overrides, f"val_env_manager.num_env_groups={args.first_maps}"]

    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = RESULTS / f"learning_runs-{exp}"
    write_csv(stem.with_suffix(".csv"), env_name, runs, args.minutes, checkpoint_maps)
    refs = references(args.config, seeds[0], ref_overrides)
    plot(stem.with_suffix(".png"), runs, refs, f"{exp}: {len(runs)} runs (seeds {', '.join(map(str, seeds))})")
    print(f"\n{exp} ({env_name}), {len(runs)} runs, seeds {seeds}; held-out success, min / median / max")
    print("| minutes into the run | greedy | sampled |\n|---|---|---|")
    for row in summary_rows(runs, args.minutes, checkpoint_maps):
        print("| " + " | ".join(row) + " |")
    for name in EXTREMES:
        values = [r.extreme(name) for r in runs]
        print(f"{name} per run: {', '.join('-' if v is None else f'{v:.3f}' for v in values)}")
    builds = [r.build_s for r in runs if r.build_s is not None]
    if builds:
        print(f"launch to the trainer's start (model build, processes' start): {min(builds):.0f}-"
              f"{max(builds):.0f} s")
    for name, value in sorted(refs.items()):
        print(f"reference {name}: {value:.3f} (seed {seeds[0]}'s held-out maps)")
    print(f"wrote {stem}.csv and {stem}.png")


if __name__ == "__main__":
    main()
