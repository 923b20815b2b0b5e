"""Group filters: which complete groups the trainer drops instead of training (`train_env_manager.group_filter_cls`).

A dropped group returns its slot, so the env-workers play another in its place and the batch fills with groups
that pass: dynamic sampling (DAPO), in the shape of ROLL's GroupFilter (`filter` returns true to drop). Pure: a
filter sees one group's trajectories and the config, nothing else.
"""

from __future__ import annotations

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
    with `fatal_move_unlikelihood_coef` a group in which some member lost its episode by its last move."""

    def __init__(self, cfg: RollstreamConfig) -> None:
        self.settings = AdvantageSettings.from_config(cfg)
        self.blames_fatal_moves = cfg.fatal_move_unlikelihood_coef > 0

    def filter(self, group_id: str, trajectories: Sequence[Trajectory]) -> bool:
        if self.settings.failed_group_advantage and failed_everywhere(trajectories):
            return False  # its push comes from the batch's success (failed_group_advantage), unknown here
        if self.blames_fatal_moves and any_fatal_move(trajectories):
            return False  # the fatal-move term trains it whatever its advantages
        advantages = compute_advantages([trajectories], self.settings)
        return not any(np.any(np.asarray(a) != 0) for a in advantages)


BUILT_IN: dict[str, Callable[[RollstreamConfig], GroupFilter]] = {"no_advantage": NoAdvantageFilter}
"""Names of `shared.config.GROUP_FILTERS` to their classes."""


def make_group_filter(cfg: RollstreamConfig) -> GroupFilter | None:
    """The configured filter, built with the config; None when every group is kept."""
    spec = cfg.train_env_manager.group_filter_cls
    if spec is None:
        return None
    build = BUILT_IN.get(spec) or import_object(spec, "train_env_manager.group_filter_cls")
    return cast(GroupFilter, build(cfg))
