"""Group filters (train_env_manager.group_filter_cls): the built-in no_advantage filter, user classes by import
path, and the config's checks. The trainer side (dropping, slots, the limit) is in test_batcher.py."""

from collections.abc import Sequence
from dataclasses import replace

import pytest

from rollstream.consumer.data.group_filters import BUILT_IN, NoAdvantageFilter, make_group_filter
from rollstream.shared.config import GROUP_FILTERS, ConfigError
from rollstream.shared.schema import Trajectory, Turn
from tests.conftest import scripted_config
from tests.factories import make_traj


class DropEverySecondGroup:
    """A user filter, as a config names it: tests.test_group_filters:DropEverySecondGroup."""

    def __init__(self, cfg) -> None:
        self.group_size = cfg.train_env_manager.group_size

    def filter(self, group_id: str, trajectories: Sequence[Trajectory]) -> bool:
        return trajectories[0].group_index % 2 == 1


class NoFilterMethod:
    def __init__(self, cfg) -> None:
        pass


def _group(scores: Sequence[float]) -> list[Trajectory]:
    return [make_traj(0, 0, m, score=s) for m, s in enumerate(scores)]


def _filter(tmp_path, *extra: str) -> NoAdvantageFilter:
    built = make_group_filter(scripted_config(tmp_path, "train_env_manager.group_filter_cls=no_advantage", *extra))
    assert isinstance(built, NoAdvantageFilter)
    return built


def test_every_built_in_name_the_config_accepts_has_a_class() -> None:
    assert set(BUILT_IN) == set(GROUP_FILTERS)


@pytest.mark.parametrize("estimator", ["grpo", "gigpo"])
def test_no_advantage_drops_a_group_whose_members_all_scored_alike(tmp_path, estimator: str) -> None:
    no_advantage = _filter(tmp_path, f"adv_estimator={estimator}")
    assert no_advantage.filter("g", _group([1.0, 1.0, 1.0, 1.0]))
    assert no_advantage.filter("g", _group([0.1, 0.1, 0.1]))  # its mean is not 0.1 in floating point
    assert not no_advantage.filter("g", _group([1.0, 1.0, 1.0, 0.0]))
    assert not no_advantage.filter("g", _group([0.0, 0.0, -0.1]))  # a format penalty is a difference too


def test_no_advantage_keeps_a_failed_group_that_failed_group_advantage_pushes(tmp_path) -> None:
    pushed = _filter(tmp_path, "adv_estimator=gigpo", "failed_group_advantage=-0.25")
    assert not pushed.filter("g", _group([0.0, 0.0, 0.0, 0.0]))  # trained: pushed by the batch's success
    assert pushed.filter("g", _group([1.0, 1.0, 1.0, 1.0]))  # solved by all: still nothing to learn
    assert _filter(tmp_path, "adv_estimator=gigpo").filter("g", _group([0.0, 0.0, 0.0, 0.0]))


def test_no_advantage_under_gigpo_keeps_equal_scores_with_a_step_level_difference(tmp_path) -> None:
    """Both members reach the goal (score 1), one in two turns and one in three: from the state they share, the
    shorter route's discounted return is higher, which is gigpo's step-level advantage."""
    no_advantage = _filter(tmp_path, "adv_estimator=gigpo", "gamma=0.9")
    short = make_traj(0, 0, 0, score=1.0)
    detour = Turn(0, "_P\n__", "<answer>Left</answer>", "Left", True, 0.0, (4, 6))
    long = replace(make_traj(0, 0, 1, score=1.0), turns=[short.turns[0], detour, short.turns[1]])
    assert not no_advantage.filter("g", [short, long])
    assert _filter(tmp_path, "adv_estimator=grpo", "gamma=0.9").filter("g", [short, long])


def test_a_user_filter_is_built_from_its_import_path_with_the_config(tmp_path) -> None:
    cfg = scripted_config(tmp_path, "train_env_manager.group_filter_cls=tests.test_group_filters:DropEverySecondGroup")
    built = make_group_filter(cfg)
    assert isinstance(built, DropEverySecondGroup) and built.group_size == cfg.train_env_manager.group_size
    assert built.filter("g", [make_traj(1)]) and not built.filter("g", [make_traj(2)])
    assert make_group_filter(scripted_config(tmp_path)) is None


@pytest.mark.parametrize(("overrides", "message"), [
    (["train_env_manager.group_filter_cls=no_advantage", "adv_estimator=reinforce"],
     r"group_filter_cls=no_advantage: adv_estimator=reinforce .* use grpo or gigpo"),
    (["train_env_manager.group_filter_cls=fancy"], r"group_filter_cls='fancy': use a built-in filter \(no_advantage\)"),
    (["train_env_manager.group_filter_cls=tests.nowhere:Filter"], r"cannot import module 'tests.nowhere'"),
    (["train_env_manager.group_filter_cls=tests.test_group_filters:Missing"], r"has no attribute 'Missing'"),
    (["train_env_manager.group_filter_cls=tests.test_group_filters:NoFilterMethod"], r"has no method filter"),
    (["val_env_manager.group_filter_cls=no_advantage"], r"val_env_manager.group_filter_cls=.*set it on "
                                                        "train_env_manager"),
    (["train_env_manager.group_filter_max_batches=0"], r"group_filter_max_batches"),
])
def test_a_bad_group_filter_is_refused_at_load_saying_what_to_do(tmp_path, overrides: list[str],
                                                                  message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        scripted_config(tmp_path, *overrides)
