"""Batch statistics: per-tag summaries and the staleness histogram."""

from __future__ import annotations

import pytest

from rollstream.consumer.data.batch_stats import no_effect_rate, rollout_stats
from tests.factories import make_traj, traj_through


def test_staleness_histogram_has_every_value_up_to_the_ratio() -> None:
    trajs = [make_traj(member=m, version=v) for m, v in enumerate([5, 5, 5, 4])]
    stats = rollout_stats(trajs, step=5, max_staleness=2)
    assert stats["staleness/0"] == pytest.approx(0.75)
    assert stats["staleness/1"] == pytest.approx(0.25)
    assert stats["staleness/2"] == 0.0  # present though empty: continuous curves
    assert stats["rollout/staleness_mean"] == pytest.approx(0.25)
    assert stats["rollout/staleness_max"] == 1.0


def test_per_tag_stats_split_only_with_several_tags() -> None:
    trajs = [make_traj(member=0, score=1.0), make_traj(member=1, score=0.0, tag="SimpleSokoban")]
    stats = rollout_stats(trajs, step=0)
    assert stats["rollout/success"] == 0.5
    assert stats["rollout/FrozenLake/success"] == 1.0
    assert stats["rollout/SimpleSokoban/success"] == 0.0
    assert "rollout/FrozenLake/success" not in rollout_stats(trajs[:1], step=0)


def test_think_rate_and_reply_tokens_count_turns() -> None:
    traj = make_traj()
    traj.turns[0].reply = " <think>Go Right.</think><answer>Right</answer>"
    traj.turns[1].response_span = (4, 9)
    stats = rollout_stats([traj, make_traj(member=1)], step=0)
    assert stats["rollout/think_rate"] == 0.25  # one reply of four opens a think
    assert stats["rollout/reply_tokens"] == pytest.approx((2 + 5 + 2 + 2) / 4)


def test_reply_tokens_absent_without_tokens() -> None:
    traj = make_traj()
    for turn in traj.turns:
        turn.response_span = (0, 0)  # a scripted policy's turns
    stats = rollout_stats([traj], step=0)
    assert "rollout/reply_tokens" not in stats
    assert stats["rollout/think_rate"] == 0.0


def test_failed_groups_is_the_share_of_groups_no_member_solved() -> None:
    solved = [make_traj(group_index=0, member=0, score=0.0), make_traj(group_index=0, member=1, score=1.0)]
    failed = [make_traj(group_index=g, member=m, score=0.0) for g in (1, 2) for m in (0, 1)]
    assert rollout_stats(solved + failed, step=0)["rollout/failed_groups"] == pytest.approx(2 / 3)
    assert rollout_stats([], step=0)["rollout/failed_groups"] == 0.0


def test_no_effect_rate_counts_valid_moves_that_change_nothing() -> None:
    assert no_effect_rate([traj_through("A", "B", "C")]) == 0.0
    assert no_effect_rate([traj_through("A", "A", "B", "B")]) == 2 / 3
    assert no_effect_rate([traj_through("A", "A", "A", valid=False)]) == 0.0  # an invalid reply is not a move
    stats = rollout_stats([traj_through("A", "A", "B"), traj_through("A", "B", "C")], step=0)
    assert stats["rollout/no_effect_rate"] == 0.25
