"""The greedy-paths diagnostic tells a loop back to an earlier state from progress."""

from tests.benchmark_modules import load_benchmark
from tests.factories import traj_through

greedy_paths = load_benchmark("greedy_paths")


def test_loop_counts_episodes_that_return_to_a_state_they_left() -> None:
    assert greedy_paths.loop_share([traj_through("A", "B", "C"), traj_through("A", "A", "A", "B")]) == 0.0
    assert greedy_paths.loop_share([traj_through("A", "B", "A"), traj_through("A", "B", "B", "C")]) == 0.5
    assert greedy_paths.loop_share([traj_through("A", "B", "C", "B")]) == 1.0
