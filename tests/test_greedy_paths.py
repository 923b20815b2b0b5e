"""The greedy-paths diagnostic: loops told from progress, validation's own maps from a wider set."""

import pytest

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
