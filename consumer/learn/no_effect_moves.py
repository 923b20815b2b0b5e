"""Unlikelihood on moves that change nothing (`no_effect_unlikelihood_coef`).

On machine 36 (docs/learning.md) greedy held-out success and the share of greedy moves that changed nothing (a walk
into a wall, after which the policy sees the same map again) moved against each other from round to round
(correlation -0.73 to -0.88 over three runs of `make run`): a run that fell from 0.62 to 0.38 one round after first
reaching 0.6 went from 0.31 of its moves into walls to 0.45, with every greedy reply valid and the sampled policy
still rising. Greedy decoding repeats its choice on a map it has seen, so a move into a wall it is sure of spends the
episode's remaining moves; sampled, the same move costs one step, and a step-level advantage that tells it apart
(the same state again, discounted) is small.

In a deterministic env no winning walk needs a move that changes nothing, so this term blames every such move alone:
-log(1 - p) of the token at which the reply chose its action, as `fatal_moves` does for the move into a hole, and
scaled by the batch's success the same way, so that it waits for the goal to be found (a warm start that wins no
map would otherwise be pushed off the walls and into the holes). Only the groups `no_advantage` keeps are trained.
"""

from __future__ import annotations

from rollstream.consumer.data.batch_stats import no_effect_moves
from rollstream.consumer.learn.format_unlikelihood import Piece, action_positions
from rollstream.shared.schema import Trajectory


def no_effect_move_positions(traj: Trajectory, piece: Piece) -> list[int]:
    """The index in `traj.input_ids` of the token at which each valid move that changed nothing chose its action
    (`batch_stats.no_effect_moves`: the env showed the same state after it; an episode's last move is left out)."""
    return action_positions(traj, no_effect_moves(traj), piece)
