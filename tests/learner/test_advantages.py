"""Advantage maths against hand-computed cases."""

from __future__ import annotations

import numpy as np
import pytest

from rollstream.consumer.learn.advantages import (
    AdvantageSettings,
    compute_advantages,
    discounted_returns,
    finalize,
    normalize,
    step_advantages,
)
from rollstream.shared.schema import Trajectory, Turn


def traj(score: float = 0.0, steps: list[tuple[str, float]] | None = None) -> Trajectory:
    """A token-less trajectory: only the score and the (observation, reward) of each turn matter here."""
    steps = steps if steps is not None else [("s", score)]
    turns = [Turn(0, obs, "", None, True, reward) for obs, reward in steps]
    return Trajectory("t", "train/FrozenLake/g0/e0", "train", "FrozenLake", 0, 0, 0, 0, turns, score, score > 0,
                      "terminated")


def scores(*groups: list[float]) -> list[list[Trajectory]]:
    return [[traj(s) for s in group] for group in groups]


def test_grpo_divides_by_the_group_std() -> None:
    adv = compute_advantages(scores([1, 0, 0, 1], [3, 1]), AdvantageSettings("grpo"))
    np.testing.assert_allclose(adv, [1, -1, -1, 1, 1, -1])


def test_grpo_mean_only() -> None:
    adv = compute_advantages(scores([1, 0, 0, 1], [3, 1]), AdvantageSettings("grpo", std_normalize="none"))
    np.testing.assert_allclose(adv, [0.5, -0.5, -0.5, 0.5, 1, -1])


def test_std_floor_keeps_a_tiny_penalty_tiny() -> None:
    # Everyone failed; one member also paid a 0.01 format penalty. Dividing by its std of 0.0043 makes the
    # penalty a -1.73 advantage; a floor of 0.1 keeps it at -0.075.
    group = scores([0, 0, 0, -0.01])
    unfloored = compute_advantages(group, AdvantageSettings("grpo"))
    np.testing.assert_allclose(unfloored, np.array([1, 1, 1, -3]) / np.sqrt(3), rtol=1e-6)
    floored = compute_advantages(group, AdvantageSettings("grpo", std_floor=0.1))
    np.testing.assert_allclose(floored, [0.025, 0.025, 0.025, -0.075], rtol=1e-9)


def test_equal_scores_and_groups_of_one_give_zero() -> None:
    adv = compute_advantages(scores([1, 1, 1], [5]), AdvantageSettings("grpo"))
    np.testing.assert_array_equal(adv, [0, 0, 0, 0])


def test_reinforce_subtracts_the_batch_mean() -> None:
    adv = compute_advantages(scores([1, 0], [0, 0]), AdvantageSettings("reinforce"))
    np.testing.assert_allclose(adv, [0.75, -0.25, -0.25, -0.25])


def test_discounted_returns() -> None:
    np.testing.assert_allclose(discounted_returns(np.array([1.0, 2.0, 3.0]), 0.5), [2.75, 3.5, 3.0])
    np.testing.assert_allclose(discounted_returns(np.array([1.0, 2.0, 3.0]), 1.0), [6.0, 5.0, 3.0])


def gigpo_group() -> list[Trajectory]:
    # A visits s0, s1 and is rewarded 1 at the end; B visits s0, s2, s1 and gets 0.5 at the end.
    # gamma 0.5 -> returns A: [0.5, 1], B: [0.125, 0.25, 0.5].
    return [traj(1.0, [("s0", 0.0), ("s1", 1.0)]), traj(0.5, [("s0", 0.0), ("s2", 0.0), ("s1", 0.5)])]


def test_gigpo_groups_steps_by_observation_with_discounted_returns() -> None:
    settings = AdvantageSettings("gigpo", std_normalize="none", gamma=0.5, step_weight=1.0)
    a, b = compute_advantages([gigpo_group()], settings)
    # Episode: scores [1, 0.5] -> [0.25, -0.25]. Step groups: s0 {A: 0.5, B: 0.125} -> +-0.1875,
    # s1 {A: 1, B: 0.5} -> +-0.25, s2 {B: 0.25} alone -> 0.
    np.testing.assert_allclose(a, [0.25 + 0.1875, 0.25 + 0.25])
    np.testing.assert_allclose(b, [-0.25 - 0.1875, -0.25 + 0.0, -0.25 - 0.25])


def test_gigpo_with_std_normalisation_and_step_weight() -> None:
    settings = AdvantageSettings("gigpo", std_normalize="group", gamma=0.5, step_weight=0.5)
    a, b = compute_advantages([gigpo_group()], settings)
    # Every group of two unequal values normalises to +-1.
    np.testing.assert_allclose(a, [1 + 0.5, 1 + 0.5])
    np.testing.assert_allclose(b, [-1 - 0.5, -1 + 0.0, -1 - 0.5])


def test_gigpo_counts_revisits_of_a_state_within_one_trajectory() -> None:
    group = [traj(1.0, [("s0", 0.0), ("s0", 1.0)]), traj(0.0, [("s0", 0.0)])]
    steps = step_advantages(group, gamma=1.0, std_normalize="none", std_floor=1e-6)
    # s0 visits: returns 1, 1 (C) and 0 (D), mean 2/3.
    np.testing.assert_allclose(steps[0], [1 / 3, 1 / 3])
    np.testing.assert_allclose(steps[1], [-2 / 3])


def test_gigpo_keeps_groups_apart() -> None:
    # The same observation text in two different groups is not the same state: different episodes.
    settings = AdvantageSettings("gigpo", std_normalize="none", gamma=1.0)
    adv = compute_advantages([[traj(1.0, [("s", 1.0)])], [traj(0.0, [("s", 0.0)])]], settings)
    np.testing.assert_array_equal(np.concatenate(adv), [0.0, 0.0])


@pytest.mark.parametrize("estimator", ["grpo", "gigpo"])
def test_failed_group_advantage_pushes_groups_no_member_solved_by_the_batch_success(estimator: str) -> None:
    # Groups 1 and 2 failed on every try (one member also paid a format penalty): without the setting their only
    # signal is that penalty; with it every member gets -0.4 x the batch's success rate (1 of 6) more. Group 0 had
    # a success and is left as it was.
    groups = scores([1, 0], [0, -0.01], [0, 0])
    plain = AdvantageSettings(estimator, std_normalize="none")
    pushed = AdvantageSettings(estimator, std_normalize="none", failed_group_advantage=-0.4)
    before, after = (np.concatenate([np.atleast_1d(a) for a in compute_advantages(groups, settings)])
                     for settings in (plain, pushed))
    assert before[2] > 0 > before[3] and before[4] == before[5] == 0  # the penalty alone
    np.testing.assert_allclose(after, before + np.array([0, 0, 1, 1, 1, 1]) * -0.4 / 6)


def test_failed_group_advantage_fades_where_every_group_fails() -> None:
    pushed = AdvantageSettings("gigpo", std_normalize="none", failed_group_advantage=-0.4)
    np.testing.assert_array_equal(np.concatenate(compute_advantages(scores([0, 0], [0, 0]), pushed)), [0, 0, 0, 0])


def test_normalize_and_finalize() -> None:
    np.testing.assert_allclose(normalize(np.array([1.0, 3.0]), "group", 1e-6), [-1, 1])
    white = finalize(np.array([1.0, 2.0, 3.0, 10.0]), whiten_values=True, clip=None)
    assert abs(white.mean()) < 1e-9 and abs(white.std() - 1) < 1e-6
    np.testing.assert_allclose(finalize(np.array([-5.0, 0.5, 5.0]), whiten_values=False, clip=2.0), [-2, 0.5, 2])


def test_settings_reject_unknown_modes() -> None:
    with pytest.raises(ValueError, match="std_normalize='batch'"):
        AdvantageSettings("grpo", std_normalize="batch")
    with pytest.raises(ValueError, match="estimator='ppo'"):
        AdvantageSettings("ppo")
    with pytest.raises(ValueError, match="failed_group_advantage=0.1: must be <= 0"):
        AdvantageSettings("grpo", failed_group_advantage=0.1)
