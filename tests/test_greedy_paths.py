"""The greedy-paths diagnostic tells a walk into a wall and a loop back from progress."""

from dataclasses import replace

from rollstream.shared.schema import Trajectory, Turn
from tests.benchmark_modules import load_benchmark
from tests.factories import make_traj

greedy_paths = load_benchmark("greedy_paths")


def played(*states: str, valid: bool = True) -> Trajectory:
    """An episode whose policy saw `states` in turn, one valid (or invalid) reply each."""
    turns = [Turn(0, state, "<answer>Up</answer>", "Up" if valid else None, valid, -0.1) for state in states]
    return replace(make_traj(), turns=turns)


def test_still_counts_valid_moves_that_change_nothing() -> None:
    assert greedy_paths.still_share([played("A", "B", "C")]) == 0.0
    assert greedy_paths.still_share([played("A", "A", "B", "B")]) == 2 / 3
    assert greedy_paths.still_share([played("A", "A", "A", valid=False)]) == 0.0  # an invalid reply is not a move


def test_loop_counts_episodes_that_return_to_a_state_they_left() -> None:
    assert greedy_paths.loop_share([played("A", "B", "C"), played("A", "A", "A", "B")]) == 0.0
    assert greedy_paths.loop_share([played("A", "B", "A"), played("A", "B", "B", "C")]) == 0.5
    assert greedy_paths.loop_share([played("A", "B", "C", "B")]) == 1.0
