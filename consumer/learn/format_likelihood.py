"""Likelihood on the format of the replies that parsed (`format_likelihood_coef`).

The main job's format wobbles, taken apart on machine 42 (docs/learning.md, `benchmarks/replay_update.py`), built
over a few updates: at one state's format position a breaking token went from p ~0.001 to ~0.04, then Adam's
momentum carried it to ~0.9 in one update. The format term (`format_unlikelihood`) pushes a breaking token down
only where a sampled reply broke, one reply in twenty-five at that state while the leak is 0.04, and the policy
gradient pushes it in both directions by the replies' advantages. This term acts on every reply that parsed: -log p
of each of its format tokens, whose gradient on the logit of any other token at that position is that token's p:
the expected push of unlikelihood on the sampled breaks, there on every reply before a break is sampled at all, and
all but nothing where the format is whole (p of every other token ~0).

At the token where a reply chose its action the format says "a move", not which: the term there is -log p(any
move), so it pushes down the tokens that would break the reply at that position and leaves the moves' shares among
themselves to the policy gradient (all but: it raises each move's logit by its share times the leak, 1 - p(any
move), which sharpens the shares by that factor: nothing where the format is whole). p(any move) is the mass of the
tokens at which the step's batch's valid replies chose their action (`spelled_moves`, `format_likelihood_moves:
spelled`, the default), or of every token that begins a move (`move_share.MoveTokens`, `begun`).

Why `spelled`: over every token that begins a move the leak went to tokens that begin a move and that the policy
does not finish (`U`, ` Up`, as valid replies spell `Up` whole): p(any move) counted them as moves, and no valid
reply trains the position after them. The measurements of both are in the keys' docstrings
(`shared/config.py`) and docs/learning.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rollstream.shared.schema import Trajectory


def format_positions(traj: Trajectory, actions: Sequence[int]) -> list[int]:
    """The index in `traj.input_ids` of every generated token of each reply that parsed but its action token
    (`actions`: `move_share.move_positions`, which read the replies already)."""
    chose = set(actions)
    return [k for turn in traj.turns if turn.action_is_valid for k in range(*turn.response_span)
            if traj.response_mask[k] > 0 and k not in chose]


def spelled_moves(input_ids: torch.Tensor, move_mask: torch.Tensor) -> torch.Tensor:
    """(K,) the distinct tokens at which a batch's valid replies chose their action (`format_likelihood_moves:
    spelled`; `input_ids` (B, T), `move_mask` (B, T - 1) on targets)."""
    return torch.unique(input_ids[:, 1:][move_mask > 0])


def format_nll(logits: torch.Tensor, logprobs: torch.Tensor, response_mask: torch.Tensor,
               format_mask: torch.Tensor, move_mask: torch.Tensor, move_ids: torch.Tensor) -> torch.Tensor:
    """Summed -log p over the format tokens (`format_mask` > 0; `logprobs` (B, T - 1) are their log p) and -log
    p(any move) over the action tokens (`move_mask` > 0), p(any move) the mass of the tokens `move_ids` (every token
    that begins a move, `MoveTokens.ids`, or `spelled_moves`), from the response positions' `logits` (N, V)."""
    fixed = -(logprobs.float() * format_mask).sum()
    at = logits[move_mask[response_mask > 0] > 0].float()
    log_any_move = torch.logsumexp(at[:, move_ids.to(at.device)], dim=-1) - torch.logsumexp(at, dim=-1)
    return fixed - log_any_move.sum()
