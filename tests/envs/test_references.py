from rollstream.shared.envs.frozen_lake import FrozenLakeEnv
from rollstream.shared.envs.references import reference_success
from rollstream.shared.envs.sokoban import SokobanEnv


def test_frozen_lake_references_order_as_measured() -> None:
    seeds = list(range(40))
    make = lambda: FrozenLakeEnv(max_actions_per_traj=10)  # noqa: E731
    random, right_down, optimal = (reference_success(make, seeds, r) for r in ("random", "right_down", "optimal"))
    assert optimal == 1.0
    assert random < 0.1 < right_down < optimal


def test_sokoban_has_no_right_down_reference_and_its_plan_solves() -> None:
    make = lambda: SokobanEnv(max_actions_per_traj=20)  # noqa: E731
    assert reference_success(make, [1, 2], "right_down") is None
    assert reference_success(make, [1, 2, 3], "optimal") == 1.0


def test_sokoban_greedy_reads_the_room_and_falls_short_of_planning() -> None:
    seeds = list(range(40))
    make = lambda: SokobanEnv(dim_room=(6, 6), num_boxes=1, max_actions_per_traj=10)  # noqa: E731
    random, greedy, optimal = (reference_success(make, seeds, r) for r in ("random", "greedy", "optimal"))
    assert random < greedy < optimal
    assert reference_success(lambda: FrozenLakeEnv(max_actions_per_traj=10), [1], "greedy") is None
