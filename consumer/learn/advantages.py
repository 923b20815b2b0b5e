"""Advantages from rewards: GRPO, REINFORCE and GiGPO. Pure numpy, no I/O.

Every estimator returns one entry per trajectory, in batch order (groups in order, members in order):
a float for a trajectory-wise advantage (GRPO, REINFORCE), broadcast later over every response token, or an
array with one value per turn (GiGPO), painted later over that turn's response span.

Normalisation inside a group subtracts the group mean and, with `std_normalize="group"`, divides by the
group's standard deviation, floored at `std_floor`. The floor matters: in a group where everyone fails and one
member also pays a 0.01 format penalty, dividing by the tiny std turns that penalty into advantages of +-1,
which is noise at full strength (seen in a calibration run). `std_normalize="none"` keeps the mean-only
(Dr. GRPO) advantages. The std is the population std (ddof 0): a group of one gets advantage 0, not NaN.

A group in which no member succeeded has no advantage under any group-relative estimator, however its members
played. With `failed_group_advantage` (lambda <= 0) such a group is compared with the batch instead: lambda x the
batch's success rate is added to every member's advantage, so a map the policy gets wrong on every try still
pushes it off what it did (negative-sample reinforcement, as in Zhu et al. 2025) once it solves others. Scaled by
the batch's success, the push fades where every group fails: at the start, a constant -0.25 on every sampled
token of an all-fail batch broke the reply format within five steps (valid replies 0.95 to 0.003).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rollstream.shared.config import AdvEstimator, RollstreamConfig, StdNormalize, choices
from rollstream.shared.schema import Trajectory

ESTIMATORS = choices(AdvEstimator)
STD_NORMALIZE_MODES = choices(StdNormalize)

TrajectoryAdvantage = float | np.ndarray
"""A float for the whole trajectory, or an array with one value per turn."""


@dataclass(frozen=True)
class AdvantageSettings:
    estimator: AdvEstimator = "grpo"
    """grpo | reinforce | gigpo."""
    std_normalize: StdNormalize = "group"
    """group: (x - mean) / max(std, std_floor) within each group; none: x - mean only."""
    std_floor: float = 1e-6
    """Smallest std a group is divided by."""
    gamma: float = 1.0
    """GiGPO: discount of the step-level returns."""
    step_weight: float = 1.0
    """GiGPO: omega in A = A_episode + omega * A_step."""
    failed_group_advantage: float = 0.0
    """lambda <= 0: lambda x the batch's success rate is added to the advantage of every member of a group in which
    no member succeeded (0: nothing)."""

    @classmethod
    def from_config(cls, cfg: RollstreamConfig) -> AdvantageSettings:
        return cls(cfg.adv_estimator, cfg.adv_std_normalize, cfg.adv_std_floor, cfg.gamma, cfg.gigpo_step_weight,
                   cfg.failed_group_advantage)

    def __post_init__(self) -> None:
        if self.estimator not in ESTIMATORS:
            raise ValueError(f"estimator={self.estimator!r}: must be one of {', '.join(ESTIMATORS)}")
        if self.std_normalize not in STD_NORMALIZE_MODES:
            raise ValueError(f"std_normalize={self.std_normalize!r}: must be one of {', '.join(STD_NORMALIZE_MODES)}")
        if self.std_floor <= 0:
            raise ValueError(f"std_floor={self.std_floor}: must be > 0")
        if self.failed_group_advantage > 0:
            raise ValueError(f"failed_group_advantage={self.failed_group_advantage}: must be <= 0 (a push away "
                             "from what a group that never succeeded did)")


def normalize(values: np.ndarray, std_normalize: str, std_floor: float) -> np.ndarray:
    """Centre `values` on their mean and, in mode "group", scale by their std floored at `std_floor`."""
    values = np.asarray(values, np.float64)
    if values.size and (values == values[0]).all():
        # exactly zero, not the rounding of the mean (0.1 x 3 centres to ~1e-17, scaled to ~1e-11 by the floor):
        # the learner skips rows whose advantages are zero, and the no_advantage filter drops such groups
        return np.zeros_like(values)
    centred = values - values.mean()
    if std_normalize == "none":
        return centred
    return centred / max(float(values.std()), std_floor)


def grpo_advantages(groups: Sequence[Sequence[Trajectory]], std_normalize: str, std_floor: float) -> list[float]:
    """Each trajectory's score normalised within its GRPO group."""
    out: list[float] = []
    for group in groups:
        scores = np.array([t.score for t in group], np.float64)
        out.extend(float(a) for a in normalize(scores, std_normalize, std_floor))
    return out


def reinforce_advantages(groups: Sequence[Sequence[Trajectory]]) -> list[float]:
    """Score minus the batch mean score: REINFORCE with a constant baseline (scale it with whitening)."""
    scores = np.array([t.score for group in groups for t in group], np.float64)
    return [float(a) for a in scores - scores.mean()] if len(scores) else []


def discounted_returns(rewards: np.ndarray, gamma: float) -> np.ndarray:
    """R_t = sum_k gamma^k r_{t+k}: the return from each step to the end of the episode."""
    returns = np.zeros(len(rewards), np.float64)
    running = 0.0
    for t in reversed(range(len(rewards))):
        running = float(rewards[t]) + gamma * running
        returns[t] = running
    return returns


def step_advantages(group: Sequence[Trajectory], gamma: float, std_normalize: str,
                    std_floor: float) -> list[np.ndarray]:
    """GiGPO's step-level advantages for one GRPO group: one array per trajectory, one value per turn.

    Members of a group play the same episode (same env config, same seed), so two turns whose observation text
    is equal saw the same env state: an anchor state. All visits of an anchor state in the group, revisits
    within one trajectory included, form a step group; each visit's discounted return from that step is
    normalised within its step group. A state visited once has nothing to compare with: advantage 0.
    """
    returns = [discounted_returns(np.array([turn.reward for turn in t.turns]), gamma) for t in group]
    visits: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for i, traj in enumerate(group):
        for k, turn in enumerate(traj.turns):
            visits[turn.observation].append((i, k))
    out = [np.zeros(len(t.turns), np.float64) for t in group]
    for members in visits.values():
        values = np.array([returns[i][k] for i, k in members])
        for (i, k), advantage in zip(members, normalize(values, std_normalize, std_floor)):
            out[i][k] = advantage
    return out


def gigpo_advantages(groups: Sequence[Sequence[Trajectory]], settings: AdvantageSettings) -> list[np.ndarray]:
    """GiGPO (Feng et al. 2025): per turn, A = A_episode + omega * A_step.

    A_episode is GRPO's advantage of the trajectory's score; A_step compares the discounted returns of the
    visits of the same anchor state (see `step_advantages`).
    """
    episode = grpo_advantages(groups, settings.std_normalize, settings.std_floor)
    steps = [a for group in groups
             for a in step_advantages(group, settings.gamma, settings.std_normalize, settings.std_floor)]
    return [a_episode + settings.step_weight * a_step for a_episode, a_step in zip(episode, steps)]


def compute_advantages(groups: Sequence[Sequence[Trajectory]],
                       settings: AdvantageSettings) -> list[TrajectoryAdvantage]:
    """One advantage entry per trajectory of `groups`, in order (see the module docstring)."""
    advantages: list[TrajectoryAdvantage]
    if settings.estimator == "grpo":
        advantages = list(grpo_advantages(groups, settings.std_normalize, settings.std_floor))
    elif settings.estimator == "reinforce":
        advantages = list(reinforce_advantages(groups))
    else:
        advantages = list(gigpo_advantages(groups, settings))
    if settings.failed_group_advantage:
        advantages = push_failed_groups(groups, advantages, settings.failed_group_advantage)
    return advantages


def failed_everywhere(group: Sequence[Trajectory]) -> bool:
    """No member of the group succeeded: its group-relative advantage is zero however its members played."""
    return not any(t.success for t in group)


def push_failed_groups(groups: Sequence[Sequence[Trajectory]], advantages: list[TrajectoryAdvantage],
                       weight: float) -> list[TrajectoryAdvantage]:
    """`weight` x the batch's success rate added to the advantages of the groups no member of which succeeded."""
    members = [t for group in groups for t in group]
    push = weight * float(np.mean([t.success for t in members]))
    failed = np.repeat([failed_everywhere(group) for group in groups], [len(group) for group in groups])
    return [a + push if f else a for a, f in zip(advantages, failed)]


def whiten(values: np.ndarray, eps: float = 1e-8) -> np.ndarray:
    """Zero mean, unit variance (over the response tokens the caller passes)."""
    values = np.asarray(values, np.float64)
    if values.size == 0:
        return values
    return (values - values.mean()) / np.sqrt(values.var() + eps)


def finalize(values: np.ndarray, *, whiten_values: bool, clip: float | None) -> np.ndarray:
    """Optional whitening, then optional clipping to [-clip, clip]: the last touch before the loss."""
    if whiten_values:
        values = whiten(values)
    if clip is not None:
        values = np.clip(values, -clip, clip)
    return np.asarray(values, np.float64)
