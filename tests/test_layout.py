import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollstream.shared.config import CustomEnvConfig, EnvManagerConfig
from rollstream.shared.layout import plan_layout

ENVS = {"A": CustomEnvConfig(), "B": CustomEnvConfig(), "C": CustomEnvConfig()}


def test_partition_assigns_tags_in_order_and_deals_groups_round_robin() -> None:
    em = EnvManagerConfig(max_env_num_per_worker=16, num_env_groups=8, group_size=8, tags=["A", "B"],
                          num_groups_partition=[6, 2])
    layout = plan_layout(em, ENVS, "train_env_manager")
    assert layout.num_workers == 4
    assert [g.tag for g in layout.groups] == ["A"] * 6 + ["B"] * 2
    assert [g.group_index for g in layout.groups_of(3)] == [3, 7]
    assert layout.groups_per_tag() == {"A": 6, "B": 2}


def test_unset_partition_splits_evenly() -> None:
    em = EnvManagerConfig(max_env_num_per_worker=4, num_env_groups=6, group_size=2, tags=["A", "B", "C"])
    assert plan_layout(em, ENVS, "x").groups_per_tag() == {"A": 2, "B": 2, "C": 2}


def test_out_of_range_rank_is_an_error() -> None:
    layout = plan_layout(EnvManagerConfig(num_env_groups=2, group_size=8, max_env_num_per_worker=16, tags=["A"]),
                         ENVS, "x")
    with pytest.raises(ValueError, match="ranks 0..0"):
        layout.groups_of(1)


@given(groups=st.integers(1, 200), group_size=st.integers(1, 16), per_worker_groups=st.integers(1, 20))
def test_workers_follow_the_formula_and_never_split_or_overfill(groups: int, group_size: int,
                                                                 per_worker_groups: int) -> None:
    max_envs = per_worker_groups * group_size
    em = EnvManagerConfig(max_env_num_per_worker=max_envs, num_env_groups=groups, group_size=group_size, tags=["A"])
    layout = plan_layout(em, ENVS, "x")
    assert layout.num_workers == math.ceil(groups * group_size / max_envs)
    assert sorted(g.group_index for g in layout.groups) == list(range(groups))
    for rank in range(layout.num_workers):
        mine = layout.groups_of(rank)
        assert 1 <= len(mine) and len(mine) * group_size <= max_envs
