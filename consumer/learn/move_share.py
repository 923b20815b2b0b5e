"""Unlikelihood on a blamed move, and the entropy bonus, over the moves alone (`move_unlikelihood_among_moves`,
`entropy_among_moves`).

The terms that blame a move (`fatal_moves`, `no_effect_moves`) take -log(1 - p) of the token at which the reply
chose its action, over the whole vocabulary: the mass it frees goes to every other token there in proportion, so
the tokens that break the reply format gain with the moves. With the no-effect term on, three runs of the main job
on machine 38 saw their sampled batches soften from step 140 on (0.89-0.92 valid replies against 0.99-1.00 at
steps 60-100, token entropy up with no entropy bonus; docs/learning.md), while the format term barely acted.

Among moves, the blamed quantity is the move's share of the mass of every token that begins a move at that
position, q = p(move) / p(any move), and the term is -log(1 - q): its gradient reaches the logits of the tokens
that begin a move only, down on the blamed move's, up on the others' in proportion to their share. A token
"begins" a move when its text, leading whitespace stripped, and the move's name are one a prefix of the other
(`R`, `Right`); a move's mass sums all its tokens, so no other spelling of the blamed move gains. On machine 39,
alternating with the terms over the vocabulary on one build, the batches stayed 0.97-1.00 valid over steps 140-200
against 0.93-0.99 (docs/learning.md, "a thirty-ninth machine").

The entropy bonus (`entropy_target`) over the vocabulary raises, at every response position, the tokens the policy
gives little mass to, in proportion to p(-log p - H): at the positions of the reply's format, which a settled
policy writes with near certainty, those are the tokens that break it. Among moves, the bonus is the entropy of the
moves' shares at the token where each valid reply chose its action, the one choice that makes a route: its gradient
reaches the logits of the tokens that begin a move there, and nothing at the format's positions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from rollstream.consumer.learn.format_unlikelihood import Piece, action_positions, away_from
from rollstream.shared.config import RollstreamConfig
from rollstream.shared.schema import Trajectory


@dataclass(frozen=True)
class MoveTokens:
    """The vocabulary's tokens that begin exactly one move, and which."""

    ids: torch.Tensor
    """(K,) long: the token ids."""
    moves: torch.Tensor
    """(K,) long: the index of the move each begins (in the order of the names given to `of`)."""

    @classmethod
    def of(cls, piece: Piece, vocab_size: int, move_names: Sequence[str]) -> MoveTokens:
        """Scan the first `vocab_size` token ids; a token that begins several moves (`Move` for `MoveUp` and
        `MoveDown`) is left out of every one."""
        ids, moves = [], []
        for token_id in range(vocab_size):
            text = (piece(token_id) or "").lstrip()
            begun = [m for m, name in enumerate(move_names) if text and (name.startswith(text) or
                                                                          text.startswith(name))]
            if len(begun) == 1:
                ids.append(token_id)
                moves.append(begun[0])
        if not ids:
            raise ValueError(f"no token of the vocabulary begins any of the moves {list(move_names)}")
        return cls(torch.tensor(ids, dtype=torch.long), torch.tensor(moves, dtype=torch.long))

    def move_of(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The move each token begins, -1 for a token that begins none (same shape as `token_ids`)."""
        match = token_ids.unsqueeze(-1) == self.ids.to(token_ids.device)
        found = match.any(dim=-1)
        moves = self.moves.to(token_ids.device)[match.float().argmax(dim=-1)]
        return torch.where(found, moves, torch.full_like(moves, -1))


def move_log_shares(logits: torch.Tensor, tokens: MoveTokens) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, M): the log of each move's share of the mass of the tokens that begin a move (`logits` (N, V)), for the
    M moves that some token begins; and (M,) those moves' indices, ascending (a column per move)."""
    of_moves = logits.float()[:, tokens.ids.to(logits.device)]  # (N, K)
    moves = tokens.moves.to(logits.device)
    present = torch.unique(moves)
    own = moves.unsqueeze(0) == present.unsqueeze(1)  # (M, K): no move without a token, no -inf row
    per_move = of_moves.unsqueeze(1).masked_fill(~own.unsqueeze(0), float("-inf"))  # (N, M, K)
    return torch.logsumexp(per_move, dim=-1) - torch.logsumexp(of_moves, dim=-1, keepdim=True), present


def move_entropy(logits: torch.Tensor, tokens: MoveTokens) -> torch.Tensor:
    """(N,): the entropy (nats) of the moves' shares at each row of `logits` (N, V)."""
    log_share, _ = move_log_shares(logits, tokens)
    return -(log_share.exp() * log_share).sum(dim=-1)


def move_unlikelihood(logits: torch.Tensor, targets: torch.Tensor, log_p: torch.Tensor,
                      tokens: MoveTokens) -> torch.Tensor:
    """Summed -log(1 - q) over the blamed positions, q the blamed move's share of the moves' mass (`logits` (N, V),
    `targets` (N,) and their logprobs over the vocabulary `log_p` (N,), at those positions only). A target that
    begins no move has no share to lower: a blamed position holds the reply's action token (`text.answer_token`),
    so it cannot happen but with a tokenizer that spells a move some other way, and then that position's term is
    -log(1 - p) over the vocabulary."""
    move = tokens.move_of(targets)
    log_shares, present = move_log_shares(logits, tokens)
    # A target that begins no move reads the first move's column: a finite share that `where` leaves out.
    column = torch.searchsorted(present, move.clamp(min=0)).clamp(max=len(present) - 1)
    log_share = log_shares.gather(1, column.unsqueeze(1)).squeeze(1)
    return away_from(torch.where(move >= 0, log_share, log_p.float()))


def takes_move_share(cfg: RollstreamConfig) -> bool:
    """A term that blames a move is on, and takes the move's share among moves."""
    return cfg.move_unlikelihood_among_moves and (cfg.fatal_move_unlikelihood_coef > 0
                                                  or cfg.no_effect_unlikelihood_coef > 0)


def move_positions(traj: Trajectory, piece: Piece) -> list[int]:
    """The index in `traj.input_ids` of the token at which each valid reply chose its action."""
    return action_positions(traj, (turn for turn in traj.turns if turn.action_is_valid), piece)


def move_names(formats: Mapping[str, Sequence[str]]) -> tuple[str, ...]:
    """Every move of the env tags in `formats` (`format_unlikelihood.reply_formats`), each once: with tags whose
    moves differ, a move of one tag counts among another's (a reply that names it there does not parse)."""
    return tuple(dict.fromkeys(name for names in formats.values() for name in names))
