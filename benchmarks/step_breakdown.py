"""Where a trainer step's wall time goes in a real run: the share of waiting, training, publication and Redis.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/step_breakdown.py OUTPUT_DIR [OUTPUT_DIR ...] [--skip 5]

Reads the `metrics.jsonl` that every trainer writes into its output dir (`make run` writes `output/frozen_lake`)
and splits each step's period (the time between two consecutive step records) into the phases the trainer times:
- `wait`: until the batch's groups are complete (the XREADGROUP reads and the decoding of the entries included;
  with generation ahead of training, nearly all of it is the read);
- `train`: the learner's step;
- `val_wait`: on a step that starts a validation round (every `eval_steps`), the wait for the round after the
  update, which ran while the round was played (the next version is published only once the round is in);
- `publish`: weights written (and copied into Redis under `weights_transport: redis`);
- `commit`: the ledger's commit (one Lua script: versions, trained groups, acks, the announcement);
- `checkpoint`: every `save_steps`; `prune`: old weight versions removed;
- `other`: what is left of the period (metrics, the console).
The baseline is the period itself: every share is of the measured step time, in the same run. The first `--skip`
steps (warm-up, first compilation) are left out. Medians over steps, with the 10th and 90th percentiles.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np

PHASES = ("wait", "train", "val_wait", "publish", "commit", "checkpoint", "prune")


def step_records(path: Path) -> list[dict[str, float]]:
    """The records of train steps (a validation round is a record of its own, without time/train_s)."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if "time/train_s" in r]


def breakdown(records: list[dict[str, float]], skip: int) -> dict[str, np.ndarray]:
    """Per step: its period and the seconds of each phase, `other` being the rest of the period."""
    kept = records[skip:]
    if len(kept) < 2:
        raise SystemExit(f"need at least {skip + 2} step records, found {len(records)}: run longer or lower --skip")
    period = np.diff([r["time"] for r in kept])
    rows = kept[1:]
    phases = {p: np.array([r.get(f"time/{p}_s", 0.0) for r in rows]) for p in PHASES}
    phases["other"] = period - sum(phases.values())
    return {"period": period} | phases


def report(name: str, parts: dict[str, np.ndarray]) -> None:
    period = parts["period"]
    print(f"\n{name}: {len(period)} steps, period {np.median(period):.2f} s median "
          f"({np.percentile(period, 10):.2f}-{np.percentile(period, 90):.2f}); load average "
          + " ".join(f"{x:.1f}" for x in os.getloadavg()))
    print("| phase | seconds, median (p10-p90) | share of the step, median (p10-p90) |")
    print("|---|---|---|")
    for phase in (*PHASES, "other"):
        seconds, share = parts[phase], parts[phase] / period
        print(f"| {phase} | {np.median(seconds):.4f} ({np.percentile(seconds, 10):.4f}-"
              f"{np.percentile(seconds, 90):.4f}) | {100 * np.median(share):.2f}% "
              f"({100 * np.percentile(share, 10):.2f}-{100 * np.percentile(share, 90):.2f}%) |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="output dirs of trainer runs (holding metrics.jsonl)")
    parser.add_argument("--skip", type=int, default=5, help="warm-up steps left out")
    args = parser.parse_args()
    for run in args.runs:
        report(str(run), breakdown(step_records(run / "metrics.jsonl"), args.skip))


if __name__ == "__main__":
    main()
