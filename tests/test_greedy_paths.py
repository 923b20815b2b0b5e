"""The greedy-paths diagnostic: loops told from progress, validation's own maps from a wider set, how lost maps
were lost."""

from dataclasses import replace

import pytest

from rollstream.shared.schema import Trajectory, Turn
from tests.benchmark_modules import load_benchmark
from tests.factories import make_traj, traj_through

greedy_paths = load_benchmark("greedy_paths")


def test_loop_counts_episodes_that_return_to_a_state_they_left() -> None:
    assert greedy_paths.loop_share([traj_through("A", "B", "C"), traj_through("A", "A", "A", "B")]) == 0.0
    assert greedy_paths.loop_share([traj_through("A", "B", "A"), traj_through("A", "B", "B", "C")]) == 0.5
    assert greedy_paths.loop_share([traj_through("A", "B", "C", "B")]) == 1.0


def test_success_spread_reads_validations_own_maps_first_whatever_the_order_played() -> None:
    # maps 0 and 1 are validation's own (solved, failed); 2 and 3 only the wider set's (both solved)
    played = [make_traj(3, score=1.0), make_traj(1, score=0.0), make_traj(2, score=1.0), make_traj(0, score=1.0)]
    assert greedy_paths.success_spread(played, val_maps=2) == "0.50 | 0.750 +- 0.217"


def test_base_model_is_the_runs_own_build_else_the_model_its_config_loaded(tmp_path) -> None:
    run, other = tmp_path / "run", tmp_path / "other_run" / "tiny_model"
    other.mkdir(parents=True)
    run.mkdir()
    assert greedy_paths.base_model(run, str(other)) == other  # a run on another run's build
    (run / "tiny_model").mkdir()
    assert greedy_paths.base_model(run, str(other)) == run / "tiny_model"


def test_base_model_gone_says_which_run_and_path(tmp_path) -> None:
    with pytest.raises(SystemExit, match="no tiny_model dir and its config's pretrain"):
        greedy_paths.base_model(tmp_path, str(tmp_path / "gone"))


def moved(*actions: str, end_reason: str = "terminated") -> Trajectory:
    """A lost episode that played `actions` from the top-left corner."""
    turns = [Turn(0, f"s{i}", f"<answer>{a}</answer>", a, True, 0.0) for i, a in enumerate(actions)]
    return replace(make_traj(score=0.0), turns=turns, end_reason=end_reason)


def test_a_lost_map_is_told_a_misread_of_the_next_cell_from_a_dead_end_entered_before() -> None:
    desc = ["SFF",
            "FHF",
            "HFG"]
    # Down into (1, 0), then Down into the hole at (2, 0): from (1, 0) no Right/Down path leads on (dead end);
    # Right to (0, 1), then Down into (1, 1): from (0, 1) Right still led on (a misread).
    assert greedy_paths.how_lost(moved("Down", "Down"), desc) == "a hole, from a forward dead end"
    assert greedy_paths.how_lost(moved("Right", "Down"), desc) == "a hole, beside a move still on a path"
    assert greedy_paths.how_lost(moved("Left", "Up", end_reason="truncated"), desc) == "out of moves"
    assert greedy_paths.lost_maps([moved("Down", "Down"), moved("Right", "Down")], [desc, desc]) == (
        "a hole, from a forward dead end 1, a hole, beside a move still on a path 1")


def test_the_next_cell_player_avoids_holes_it_can_see_and_no_more() -> None:
    corridor = ["SF", "HG"]  # Down is a hole, Right is safe: it always goes Right, then Down to the goal
    trap = ["SFH", "FHH", "FFG"]  # Right is safe but leads only to holes: half its first moves lose
    assert greedy_paths.next_cell_player([corridor], moves=10) == 1.0
    assert 0.3 < greedy_paths.next_cell_player([trap], moves=10) < 0.7
