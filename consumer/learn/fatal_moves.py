"""Unlikelihood on the move that ended an episode in failure (`fatal_move_unlikelihood_coef`).

At the plateau near 0.7 greedy held-out success, a run's policy (machine 26, `make run`, step 200) lost 71 of 256
held-out maps, every one in a hole, and 51 of them by stepping into a hole next to it while the other move
towards the goal was safe and still on a path to it (`benchmarks/greedy_paths.py`). Sampled, it did the same: its
token entropy was 0.02. So all four members of such a map's group fall into the same hole, the group-relative
advantage is zero, the filter drops the group, and no gradient ever reaches the move that lost the map. A
policy-gradient penalty would barely reach it either: on a sampled token it is scaled by 1 - p.

This term blames the move after which the env ended the episode without success (FrozenLake: the step into a
hole), alone: -log(1 - p) of the token at which that reply chose its action, whatever its group scored. As with the
reply format's unlikelihood (`format_unlikelihood`), its gradient on that token's logit is p, and the mass it frees
goes to the other tokens in proportion to the policy's own probabilities there: mostly to the other moves, and with
`move_unlikelihood_among_moves` to them alone (`move_share`). An episode that ran out of moves blames no single move,
and gets none.

The coefficient is scaled by the batch's success rate (as `failed_group_advantage`'s push is). At full strength
from the first step (coefficient 1.0, machine 26) the warm-started policy, which succeeds on almost no map, learnt
within 15 steps to walk into the walls of its start corner instead (moves that change nothing: 0.96-0.99 of them),
where no hole can be met and no success either, and stayed there (greedy 0 to step 48). Scaled, the term is near
zero until the policy finds the goal, and grows as it does.
"""

from __future__ import annotations

from collections.abc import Sequence

from rollstream.consumer.learn.format_unlikelihood import Piece, action_positions
from rollstream.shared.schema import Trajectory


def ended_by_its_last_move(traj: Trajectory) -> bool:
    """The env ended the episode without success right after a valid move (FrozenLake: into a hole)."""
    return (not traj.success and traj.end_reason == "terminated" and bool(traj.turns)
            and traj.turns[-1].action_is_valid)


def any_fatal_move(group: Sequence[Trajectory]) -> bool:
    """Some member of the group lost its episode by its last move: the term trains the group whatever it scored."""
    return any(map(ended_by_its_last_move, group))


def success_scaled_coef(coef: float, trajs: Sequence[Trajectory]) -> float:
    """This step's coefficient of a term that blames moves (this module's and `no_effect_moves`'): `coef` x the
    success rate of the batch's episodes (0 for an empty batch)."""
    return coef * sum(t.success for t in trajs) / len(trajs) if trajs and coef > 0 else 0.0


def fatal_move_positions(traj: Trajectory, piece: Piece) -> list[int]:
    """The index in `traj.input_ids` of the token at which the episode's fatal move chose its action; [] when the
    episode did not end so, or that reply's tokens do not spell a well-formed reply."""
    return action_positions(traj, traj.turns[-1:], piece) if ended_by_its_last_move(traj) else []
