"""Checkpoints: where they live (<output_dir>/checkpoints/step_<n>), which one a resume uses, and their files.

A checkpoint directory holds the strategy's part (`strategy/`: model, optimizer, schedule; a multi-rank strategy
has every rank write its own partition there) and the learner's state (`learner.safetensors`: steps done and every
RNG a training process draws from, stored by `state_file` without pickle).
"""

from __future__ import annotations

import os
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from rollstream.consumer.learn.state_file import load_state, save_state
from rollstream.shared import atomic
from rollstream.shared.config import ConfigError, RollstreamConfig

LEARNER_STATE_FILE = "learner.safetensors"
STRATEGY_DIR = "strategy"

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


@dataclass
class LearnerState:
    steps_done: int
    generator: torch.Generator
    """The learner's own RNG (mini-batch shuffling)."""
    entropy_control: dict[str, Any] | None = None
    """The adaptive entropy bonus's state (`EntropyControl.state`); None in checkpoints from before it."""


def strategy_dir(checkpoint: str | os.PathLike[str]) -> Path:
    """The strategy's part of a checkpoint directory."""
    return Path(checkpoint) / STRATEGY_DIR


def save_checkpoint(directory: str | os.PathLike[str], save_strategy: Callable[[Path], None],
                    state: LearnerState) -> None:
    """Write a checkpoint into `directory`, replacing an older one atomically."""
    with atomic.staged_dir(directory, replace=True) as tmp:
        (tmp / STRATEGY_DIR).mkdir()
        save_strategy(tmp / STRATEGY_DIR)
        save_state({"steps_done": state.steps_done, "rng": capture_rng(state.generator),
                    "entropy_control": state.entropy_control}, tmp / LEARNER_STATE_FILE)


def load_learner_state(directory: str | os.PathLike[str], generator: torch.Generator) -> LearnerState:
    """Restore every RNG from a checkpoint into the process and `generator`; returns the learner's state."""
    state = load_state(Path(directory) / LEARNER_STATE_FILE)
    restore_rng(state["rng"], generator)
    return LearnerState(int(state["steps_done"]), generator, state.get("entropy_control"))


def capture_rng(generator: torch.Generator) -> dict[str, Any]:
    """Every RNG a training process draws from, as tensors and plain values (what `state_file` stores)."""
    np_state = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state(legacy=True))
    py_version, py_state, py_gauss = random.getstate()
    return {
        "shuffle": generator.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": {"keys": torch.from_numpy(np.asarray(np_state[1], np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
        "python": {"version": py_version, "state": torch.tensor(py_state, dtype=torch.int64), "gauss": py_gauss},
    }


def restore_rng(state: dict[str, Any], generator: torch.Generator) -> None:
    generator.set_state(state["shuffle"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    np_state = state["numpy"]
    np.random.set_state(("MT19937", np_state["keys"].numpy().astype(np.uint32), np_state["pos"],
                         np_state["has_gauss"], np_state["cached_gaussian"]))
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
