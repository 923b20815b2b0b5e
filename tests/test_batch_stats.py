"""Batch statistics: per-tag summaries and the staleness histogram."""

from __future__ import annotations

import pytest

from rollstream.consumer.data.batch_stats import rollout_stats
from tests.factories import make_traj


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
