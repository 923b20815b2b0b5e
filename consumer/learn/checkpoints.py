"""Where checkpoints live and which one a resume uses: <output_dir>/checkpoints/step_<n>."""

from __future__ import annotations

import re
from pathlib import Path

from rollstream.shared.config import ConfigError, RollstreamConfig

_NAME = re.compile(r"step_(\d+)")


def checkpoint_dir(cfg: RollstreamConfig, step: int) -> Path:
    """The checkpoint taken after `step` train steps (the model of policy version `step`)."""
    return Path(cfg.output_dir) / "checkpoints" / f"step_{step}"


def checkpoint_step(path: Path) -> int:
    match = _NAME.fullmatch(path.name)
    if not match:
        raise ConfigError(f"resume_from_checkpoint={str(path)!r}: not a checkpoint dir (expected .../step_<n>)")
    return int(match.group(1))


def resume_path(cfg: RollstreamConfig) -> Path | None:
    """resume_from_checkpoint: false (start fresh), true (the latest under output_dir) or a checkpoint dir."""
    value = cfg.resume_from_checkpoint
    if value is False or value is None:
        return None
    if value is True or value == "latest":
        root = Path(cfg.output_dir) / "checkpoints"
        found = sorted((p for p in root.glob("step_*") if _NAME.fullmatch(p.name)), key=checkpoint_step)
        return found[-1] if found else None
    path = Path(str(value))
    if not path.is_dir():
        raise ConfigError(f"resume_from_checkpoint={str(value)!r}: no such checkpoint dir; use true for the "
                          f"latest under {Path(cfg.output_dir) / 'checkpoints'}, or false")
    checkpoint_step(path)
    return path
