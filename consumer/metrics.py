"""Where a run's metrics go: a short console line, every metric to `metrics.jsonl` and wandb (offline by
default), and learning-curve PNGs (train step below, minutes of wall clock above) at the end."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from rollstream.shared.config import RollstreamConfig, as_dict

log = logging.getLogger(__name__)

CURVES = ("rollout/success", "rollout/score", "rollout/valid_action_rate", "val/success",
          "time/wait_s", "time/train_s")
"""Metrics plotted in learning_curves.png, when the run logged them."""
BESIDE = {"val/success": ("val_sampled/success",)}
"""Curves drawn on another curve's panel: sampled held-out success beside the greedy one."""
WATCHED = {"rollout/success": "success", "rollout/valid_action_rate": "valid", "val/success": "held-out greedy",
           "val_sampled/success": "sampled", "loss/entropy": "entropy", "time/train_s": "train s",
           "time/wait_s": "wait s"}
"""The few figures the console line shows (as these names); everything else goes to metrics.jsonl and wandb."""
RECORD = "metrics.jsonl"
"""One JSON object per log call in the output dir: step, wall-clock minutes since the trainer started, metrics."""


class PhaseTimer:
    """Seconds between consecutive laps, named by the phase each lap ends."""

    def __init__(self) -> None:
        self._last = time.monotonic()
        self._seconds: dict[str, float] = {}

    def lap(self, phase: str) -> None:
        now = time.monotonic()
        self._seconds[phase] = now - self._last
        self._last = now

    def seconds(self) -> dict[str, float]:
        return {f"time/{phase}_s": s for phase, s in self._seconds.items()}


class MetricsLogger:
    def __init__(self, cfg: RollstreamConfig) -> None:
        self.cfg = cfg
        self.out_dir = Path(cfg.output_dir)
        self.history: dict[str, list[tuple[int, float]]] = defaultdict(list)
        self.minutes: dict[int, float] = {}
        """Wall-clock minutes since this trainer started at which each step was first logged."""
        self.started = time.monotonic()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.record = (self.out_dir / RECORD).open("a" if cfg.resume_from_checkpoint else "w")
        self.run: Any = None
        if cfg.wandb_mode != "disabled":
            self.run = _init_wandb(cfg)

    def log(self, step: int, metrics: dict[str, float], *, console: bool = True) -> None:
        minutes = (time.monotonic() - self.started) / 60
        self.minutes.setdefault(step, minutes)
        for key, value in metrics.items():
            self.history[key].append((step, value))
        self.record.write(json.dumps({"step": step, "minutes": round(minutes, 4), "time": round(time.time(), 3),
                                      **metrics}) + "\n")
        self.record.flush()
        if self.run is not None:
            self.run.log(metrics, step=step)
        if console:
            watched = "  ".join(f"{name} {metrics[k]:.3g}" for k, name in WATCHED.items() if k in metrics)
            # tqdm.write keeps a live progress bar intact below the line (and prints plainly without one)
            tqdm.write(f"{time.strftime('%H:%M:%S')} step {step}/{self.cfg.max_steps}  {watched}", file=sys.stderr)

    def latest(self, key: str) -> float | None:
        values = self.history.get(key)
        return values[-1][1] if values else None

    def close(self) -> Path | None:
        """Finish the wandb run and write the learning curves; returns the PNG's path."""
        self.record.close()
        if self.run is not None:
            self.run.finish()
            self.run = None
        return self.plot()

    def plot(self) -> Path | None:
        curves = [k for k in CURVES if self.history.get(k)]
        if not curves:
            return None
        import matplotlib

        matplotlib.use("Agg")  # no display on training hosts
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(len(curves), 1, figsize=(7, 2.2 * len(curves)), sharex=True, squeeze=False)
        for ax, key in zip(axes[:, 0], curves):
            marker = "." if len(self.history[key]) < 50 else None
            for curve in (key, *BESIDE.get(key, ())):
                if self.history.get(curve):
                    ax.plot(*zip(*self.history[curve]), marker=marker, label=curve)
            if key == "val/success":  # the yardsticks, on the same maps (colours after the curves')
                refs = sorted(k for k in self.history if k.startswith("val/") and "/ref_" in k)
                for i, ref in enumerate(refs):
                    ax.axhline(self.history[ref][-1][1], linestyle="--", linewidth=0.8, color=f"C{2 + i % 8}",
                               label=ref.removeprefix("val/"))
                ax.legend(fontsize=6, loc="upper left")
            ax.set_ylabel(key, fontsize=8)
            ax.grid(alpha=0.3)
        axes[-1, 0].set_xlabel("train step")
        self._minutes_axis(axes[0, 0])
        fig.suptitle(f"{self.cfg.exp_name}: learning curves")
        fig.tight_layout()
        path = self.out_dir / "plots" / "learning_curves.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path


    def _minutes_axis(self, ax: Any) -> None:
        """Minutes of wall clock on top of the step axis, read off when each step was logged."""
        if len(self.minutes) < 2:
            return
        steps, minutes = zip(*sorted(self.minutes.items()))
        ax.secondary_xaxis("top", functions=(lambda s: np.interp(s, steps, minutes),
                                             lambda m: np.interp(m, minutes, steps))).set_xlabel("minutes")


def _init_wandb(cfg: RollstreamConfig) -> Any:
    import wandb

    # wandb must never block a run: no login prompt, no network unless asked for.
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ.setdefault("WANDB_CONSOLE", "off")
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    return wandb.init(project=cfg.wandb_project, name=cfg.exp_name, mode=cfg.wandb_mode, dir=str(out),
                      config=as_dict(cfg), reinit="finish_previous")
