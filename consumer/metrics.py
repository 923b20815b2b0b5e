"""Where a run's metrics go: the console, wandb (offline by default) and learning-curve PNGs at the end."""

from __future__ import annotations

import logging
import os
from collections import defaultdict
from pathlib import Path
from typing import Any, Literal, cast

from rollstream.shared.config import RollstreamConfig, as_dict

log = logging.getLogger(__name__)

CURVES = ("rollout/success", "rollout/score", "rollout/valid_action_rate", "val/success",
          "time/wait_s", "time/train_s")
"""Metrics plotted in learning_curves.png, when the run logged them."""
BESIDE = {"val/success": ("val_sampled/success",)}
"""Curves drawn on another curve's panel: sampled held-out success beside the greedy one."""


class MetricsLogger:
    def __init__(self, cfg: RollstreamConfig) -> None:
        self.cfg = cfg
        self.out_dir = Path(cfg.output_dir)
        self.history: dict[str, list[tuple[int, float]]] = defaultdict(list)
        self.run: Any = None
        if cfg.wandb_mode != "disabled":
            self.run = _init_wandb(cfg)

    def log(self, step: int, metrics: dict[str, float], *, console: bool = True) -> None:
        for key, value in metrics.items():
            self.history[key].append((step, value))
        if self.run is not None:
            self.run.log(metrics, step=step)
        if console:
            shown = {k: v for k, v in metrics.items() if k.count("/") == 1}
            log.info("step %d  %s", step, "  ".join(f"{k}={v:.4g}" for k, v in sorted(shown.items())))

    def close(self) -> Path | None:
        """Finish the wandb run and write the learning curves; returns the PNG's path."""
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
        fig.suptitle(f"{self.cfg.exp_name}: learning curves")
        fig.tight_layout()
        path = self.out_dir / "plots" / "learning_curves.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path


def _init_wandb(cfg: RollstreamConfig) -> Any:
    import wandb

    # wandb must never block a run: no login prompt, no network unless asked for.
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ.setdefault("WANDB_CONSOLE", "off")
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    mode = cast(Literal["online", "offline", "disabled"], cfg.wandb_mode)  # checked by the config
    return wandb.init(project=cfg.wandb_project, name=cfg.exp_name, mode=mode, dir=str(out),
                      config=as_dict(cfg), reinit="finish_previous")
