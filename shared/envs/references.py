"""Reference policies on the same held-out maps the model is validated on, so its success has a yardstick.

uniformly random valid actions; random Right/Down only (FrozenLake: the map-independent bias a policy
learns first); a greedy player that reads the room but does not plan (Sokoban); the optimal plan (BFS;
FrozenLake without slip, Sokoban). Pure: envs and numbers only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from rollstream.shared.envs.base import TextEnv
from rollstream.shared.envs.frozen_lake import FrozenLakeEnv, optimal_actions
from rollstream.shared.envs.sokoban import SokobanEnv, greedy_actions, solve
from rollstream.shared.envs.text import format_reply

REFERENCES = ("random", "right_down", "greedy", "optimal")


def reference_success(make: Callable[[], TextEnv], seeds: Sequence[int], reference: str,
                      rollouts: int = 16, seed: int = 0) -> float | None:
    """Mean success of `reference` over the maps of `seeds` (random policies: `rollouts` tries per map);
    None where the reference does not apply to this env."""
    env = make()
    rng = np.random.default_rng(seed)
    wins: list[bool] = []
    for map_seed in seeds:
        for _ in range(1 if reference == "optimal" else rollouts):
            env.reset(seed=map_seed)
            plan = _plan(env, reference, rng)
            if plan is None:
                return None
            wins.append(_play(env, plan))
    return float(np.mean(wins)) if wins else None


def _plan(env: TextEnv, reference: str, rng: np.random.Generator) -> list[str] | None:
    n = env.max_actions_per_traj
    if reference == "random":
        return [env.action_names[i] for i in rng.integers(len(env.action_names), size=n)]
    if reference == "right_down":
        if not isinstance(env, FrozenLakeEnv):
            return None
        return [("Right", "Down")[i] for i in rng.integers(2, size=n)]
    if reference == "greedy":
        return greedy_actions(env.room, n, rng) if isinstance(env, SokobanEnv) else None
    if reference == "optimal":
        if isinstance(env, FrozenLakeEnv) and not env.is_slippery:
            return optimal_actions(env.desc)
        if isinstance(env, SokobanEnv):
            return solve(env.room) or []
        return None
    raise ValueError(f"unknown reference {reference!r}; known: {', '.join(REFERENCES)}")


def _play(env: TextEnv, plan: list[str]) -> bool:
    for action in plan:
        _, _, terminated, truncated, info = env.step(format_reply(action))
        if terminated or truncated:
            return bool(info["success"])
    return env.is_success()
