"""Group filters: which complete groups the trainer drops instead of training (`train_env_manager.group_filter_cls`).

A dropped group returns its slot, so the env-workers play another in its place and the batch fills with groups
that pass: dynamic sampling (DAPO), in the shape of ROLL's GroupFilter (`filter` returns true to drop). No I/O: a
filter sees the groups it is asked about, in order, and the config, nothing else.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol, cast

import numpy as np

from rollstream.consumer.learn.advantages import AdvantageSettings, compute_advantages, failed_everywhere
from rollstream.consumer.learn.fatal_moves import any_fatal_move
from rollstream.shared.config import RollstreamConfig
from rollstream.shared.imports import import_object
from rollstream.shared.schema import Trajectory


class GroupFilter(Protocol):
    def filter(self, group_id: str, trajectories: Sequence[Trajectory]) -> bool:
        """True drops the group (members in member order)."""
        ...


class NoAdvantageFilter:
    """Drops a group whose every advantage is zero: all members scored alike (gigpo: and every state visited by
    several members led to the same return). Such a group adds nothing to the policy gradient, only to the
    batch's count of trajectories. With `failed_group_advantage` a group no member of which succeeded is kept, and
    with `fatal_move_unlikelihood_coef` a group in which some member lost its episode by its last move (all of
    them, or under `fatal_move_groups: at_success_rate` that share of them given by the recent success)."""

    def __init__(self, cfg: RollstreamConfig) -> None:
        self.settings = AdvantageSettings.from_config(cfg)
        self.blames_fatal_moves = cfg.fatal_move_unlikelihood_coef > 0
        self.fatal_share = RecentSuccess() if cfg.fatal_move_groups == "at_success_rate" else None

    def filter(self, group_id: str, trajectories: Sequence[Trajectory]) -> bool:
        if self.fatal_share is not None:
            self.fatal_share.add(trajectories)
        if self.settings.failed_group_advantage and failed_everywhere(trajectories):
            return False  # its push comes from the batch's success (failed_group_advantage), unknown here
        advantages = compute_advantages([trajectories], self.settings)
        if any(np.any(np.asarray(a) != 0) for a in advantages):
            return False
        if self.blames_fatal_moves and any_fatal_move(trajectories):
            # kept for the fatal-move term: every one, or under at_success_rate that share of them
            return self.fatal_share is not None and not self.fatal_share.draw()
        return True


class RecentSuccess:
    """The success rate of the last `window` episodes seen, and a deterministic draw at that rate: `draw` is true
    for that share of its calls (an accumulator, so a rate of 0.25 keeps every fourth, with no random state)."""

    def __init__(self, window: int = 256) -> None:
        self.recent: deque[bool] = deque(maxlen=window)
        self.credit = 0.0

    def add(self, trajectories: Sequence[Trajectory]) -> None:
        self.recent.extend(t.success for t in trajectories)

    def rate(self) -> float:
        return sum(self.recent) / len(self.recent) if self.recent else 0.0

    def draw(self) -> bool:
        self.credit += self.rate()
        if self.credit >= 1.0:
            self.credit -= 1.0
            return True
        return False


BUILT_IN: dict[str, Callable[[RollstreamConfig], GroupFilter]] = {"no_advantage": NoAdvantageFilter}
"""Names of `shared.config.GROUP_FILTERS` to their classes."""


def make_group_filter(cfg: RollstreamConfig) -> GroupFilter | None:
    """The configured filter, built with the config; None when every group is kept."""
    spec = cfg.train_env_manager.group_filter_cls
    if spec is None:
        return None
    build = BUILT_IN.get(spec) or import_object(spec, "train_env_manager.group_filter_cls")
    return cast(GroupFilter, build(cfg))
