"""Small trajectories for tests that need data, not episodes."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from rollstream.shared.schema import Trajectory, Turn, make_group_id, make_traj_id


def make_traj(group_index: int = 0, episode: int = 0, member: int = 0, *, version: int = 0, tag: str = "FrozenLake",
              score: float = 1.0, tokens: int = 6, mode: str = "train") -> Trajectory:
    group_id = make_group_id(mode, tag, group_index, episode)
    turns = [Turn(version, "P_\n_G", "<answer>Right</answer>", "Right", True, 0.0, (2, 4)),
             Turn(version, "_P\n_G", "<answer>Down</answer>", "Down", True, score, (4, 6))]
    mask = np.zeros(tokens, np.uint8)
    mask[2:] = 1
    return Trajectory(
        traj_id=make_traj_id(group_id, member), group_id=group_id, mode=mode, tag=tag, group_index=group_index,
        episode=episode, member=member, seed=1234, turns=turns, score=score, success=score > 0,
        end_reason="terminated", input_ids=np.arange(tokens, dtype=np.int32), response_mask=mask,
        logprobs=np.linspace(-1, 0, tokens, dtype=np.float32) * mask, created_at=1.0,
    )


def traj_through(*states: str, valid: bool = True) -> Trajectory:
    """An episode whose policy saw `states` in turn and gave one valid (or invalid) reply to each."""
    turns = [Turn(0, state, "<answer>Up</answer>", "Up" if valid else None, valid, -0.1) for state in states]
    return replace(make_traj(), turns=turns)
