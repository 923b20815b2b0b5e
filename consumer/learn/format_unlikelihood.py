"""Unlikelihood on the token that broke a reply's format (`format_unlikelihood_coef`).

Twice a run of the main job lost part of its reply format for good: from some step on, a fifth or a seventh of the
replies broke at one token the policy was nearly sure of (`<answer>Down<answer>...`, the second `<answer>` at
p = 0.990; `<answer></answer>`, the closing tag at p = 0.996), and neither the policy gradient nor a k3 penalty
moved it, because a loss on a sampled token's logprob reaches that position's logits scaled by 1 - p
(docs/learning.md). The forward KL to the warm start moved it, but also pulled the actions there towards the warm
start's random ones. This term is -log(1 - p) of the breaking token alone: its gradient on that token's logit is
p, however sure the policy is, and the mass it takes goes to the other tokens in proportion to the policy's own
distribution at that position (unlikelihood training, Welleck et al. 2019). It needs no reference model.

Which token broke the format is read from the reply's tokens (`text.format_break`): the first after which no
well-formed reply can begin with what was written.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from rollstream.shared.config import CustomEnvConfig
from rollstream.shared.envs.registry import resolve_env_type
from rollstream.shared.envs.text import answer_token, format_break
from rollstream.shared.schema import Trajectory, Turn

Piece = Callable[[int], "str | None"]
"""A token id's text; None for a token that ends a reply (end-of-sequence and the other special tokens)."""


def tokenizer_piece(tokenizer: Any) -> Piece:
    """`tokenizer`'s `Piece`, each token decoded once."""
    special = set(tokenizer.all_special_ids)
    pieces: dict[int, str | None] = {}

    def piece(token_id: int) -> str | None:
        if token_id not in pieces:
            pieces[token_id] = None if token_id in special else str(tokenizer.decode([token_id]))
        return pieces[token_id]

    return piece


def reply_formats(custom_envs: Mapping[str, CustomEnvConfig]) -> dict[str, tuple[str, ...]]:
    """Each env tag's action names, for the tags whose replies use the built-in format (an env read with ROLL's
    `action_pattern` has its own, and gets no break)."""
    return {tag: tuple(resolve_env_type(env.env_type).action_names) for tag, env in custom_envs.items()
            if "action_pattern" not in env.env_config}


def reply_tokens(traj: Trajectory, turn: Turn, piece: Piece) -> tuple[list[int], list[str | None]]:
    """A reply's generated tokens: their indices in `traj.input_ids`, and their text (`piece`)."""
    start, end = turn.response_span
    generated = [k for k in range(start, end) if traj.response_mask[k] > 0]
    return generated, [piece(int(traj.input_ids[k])) for k in generated]


def action_positions(traj: Trajectory, turns: Iterable[Turn], piece: Piece) -> list[int]:
    """The index in `traj.input_ids` of the token at which each of `turns`' replies chose its action; a reply whose
    tokens do not spell a well-formed reply has none (`text.answer_token`)."""
    return reply_positions(traj, turns, piece, answer_token)


def spells_moves_whole(tokenizer: Any, formats: Mapping[str, Sequence[str]]) -> dict[str, bool]:
    """Per env tag of `formats` (`reply_formats`): whether `tokenizer` spells each of its action names in one token
    (`format_break`'s `whole_moves`)."""
    return {tag: all(len(tokenizer.encode(name, add_special_tokens=False)) == 1 for name in names)
            for tag, names in formats.items()}


def break_positions(traj: Trajectory, piece: Piece, action_names: Sequence[str], *,
                    whole_moves: bool = False) -> list[int]:
    """The index in `traj.input_ids` of the token at which each reply that did not parse left the format
    (`whole_moves`: as `text.format_break` reads it for a tokenizer that spells every move in one token)."""
    unparsed = (turn for turn in traj.turns if not turn.action_is_valid)
    return reply_positions(traj, unparsed, piece,
                           lambda pieces: format_break(pieces, action_names, whole_moves=whole_moves))


def reply_positions(traj: Trajectory, turns: Iterable[Turn], piece: Piece,
                    find: Callable[[list[str | None]], int | None]) -> list[int]:
    """The index in `traj.input_ids` of the token `find` picks among each of `turns`' reply tokens (their texts;
    None: that reply has none)."""
    positions = []
    for turn in turns:
        generated, pieces = reply_tokens(traj, turn, piece)
        at = find(pieces)
        if at is not None:
            positions.append(generated[at])
    return positions


def unlikelihood(logprobs: torch.Tensor, break_mask: torch.Tensor) -> torch.Tensor:
    """Summed -log(1 - p) over the breaking tokens (`break_mask` > 0; `logprobs` (B, T - 1) are their log p)."""
    return away_from(logprobs[break_mask > 0])


def away_from(log_p: torch.Tensor) -> torch.Tensor:
    """Summed -log(1 - p) for log p (any shape)."""
    # log(1 - p) as log(-expm1(log p)): exact near p = 1, where 1 - exp() would round to 0.
    return -torch.log(-torch.expm1(log_p.float().clamp(max=-1e-7))).sum()
