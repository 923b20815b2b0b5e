"""format_likelihood_coef: -log p on every valid reply's format tokens and -log p(any move) at its action token; its
push on a token that would break the format is that token's p, on every reply that parsed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from rollstream.consumer.learn.format_likelihood import format_nll, format_positions, spelled_moves
from rollstream.consumer.learn.format_unlikelihood import tokenizer_piece
from rollstream.consumer.learn.move_share import MoveTokens, move_positions

from .helpers import make_batch
from .test_move_share import NAMES, VOCAB, first_action_logits, moves_learner, piece, won_alike
from .test_no_effect_moves import walk


def test_the_format_tokens_are_every_valid_replys_tokens_but_its_action_token(tiny_model: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    piece_of = tokenizer_piece(tokenizer)
    traj = walk(tokenizer, 0, ["P_\n_G", "P_\n_G", "_P\n_G"], valid=(True, False, True))
    kept = format_positions(traj, move_positions(traj, piece_of))
    first, _ = traj.turns[0].response_span
    third, _ = traj.turns[2].response_span
    # `<answer>` `R` `ight` `</answer>` end-of-sequence: `R` chose the move; the broken second reply gives none.
    assert kept == [first, first + 2, first + 3, first + 4, third, third + 2, third + 3, third + 4]
    assert [piece_of(int(traj.input_ids[k])) for k in kept[:4]] == ["<answer>", "ight", "</answer>", None]


def test_its_push_on_a_breaking_token_is_that_tokens_p_and_the_moves_keep_their_order() -> None:
    """Row 0, a format position (`</answer>` sure, `x` at a few percent): the gradient on each other token's logit
    is its p. Row 1, an action token (`R` the likeliest move, `</answer>` leaking): the term is -log p(any move), it
    lowers every token that begins no move by its p and raises the moves, the likelier more."""
    tokens = MoveTokens.of(piece, len(VOCAB), NAMES)
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 3.0, 6.5],
                           [0.0, 1.0, 2.0, 6.0, 0.5, 1.5, 3.0, 0.0, 3.5]], requires_grad=True)
    targets = torch.tensor([8, 3])
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).T  # (1, 2): one row of targets
    response = torch.ones(1, 2)
    value = format_nll(logits, logprobs, response, torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]]),
                       tokens.ids)
    (grad,) = torch.autograd.grad(value, logits)
    p = torch.softmax(logits.detach(), dim=-1)
    moves = [1, 2, 3, 5, 6]
    torch.testing.assert_close(value.detach(), -p[0, 8].log() - p[1, moves].sum().log())
    torch.testing.assert_close(grad[0, :8], p[0, :8])  # descent lowers each breaker by its p
    torch.testing.assert_close(grad[1, [0, 4, 7, 8]], p[1, [0, 4, 7, 8]])
    assert (grad[1, moves] < 0).all() and grad[1, 3] < grad[1, 6] < grad[1, 2]  # `R` raised most, then `Down`


@pytest.mark.parametrize("moves", ["begun", "spelled"])
def test_it_lowers_a_leak_where_no_advantage_trains(tmp_path: Path, tiny_model: Path, moves: str) -> None:
    """Two groups that each scored alike, every reply valid: no advantage, no blamed move, so the format's likelihood
    is the loss's only term; the mass at the action token on tokens that begin no move falls."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    lost = [walk(tokenizer, m, ["P_\n_G", "_P\n_G"]) for m in range(4)]
    learner, tokens = moves_learner(tmp_path, tiny_model, "format_likelihood_coef=1.0",
                                    f"format_likelihood_moves={moves}")
    assert not learner.settings.zero_advantage_rows_have_no_gradient

    def leak() -> float:
        logits = first_action_logits(learner, lost[0])[0]
        return 1 - float(torch.softmax(logits, dim=-1)[0, tokens.ids].sum())

    before = leak()
    metrics = learner.train_step(make_batch([lost, won_alike(tokenizer)]))
    assert metrics["loss/format_likelihood"] > 0 and metrics["actor/zero_adv_rows"] == 8.0
    assert leak() < before
    learner.close()


def test_spelled_moves_count_a_token_that_no_valid_reply_finishes_as_a_leak() -> None:
    """`format_likelihood_moves: spelled`: p(any move) sums the tokens at which the batch's valid replies chose their
    action (`R`, `Down`), so ` Up`, which begins a move that no valid reply spelled so, is pushed down by its p."""
    input_ids = torch.tensor([[0, 3, 4, 8], [0, 6, 8, 8]])  # `<answer>` `R` `ight` `</answer>`; `<answer>` `Down` ...
    move_mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    spelled = spelled_moves(input_ids, move_mask)
    assert spelled.tolist() == [3, 6]
    logits = torch.tensor([[0.0, 1.0, 2.0, 6.0, 0.5, 3.0, 3.0, 0.0, 1.0]], requires_grad=True)
    logprobs = torch.zeros(1, 1)
    at_action = (torch.ones(1, 1), torch.zeros(1, 1), torch.ones(1, 1))
    (begun,) = torch.autograd.grad(format_nll(logits, logprobs, *at_action, MoveTokens.of(piece, len(VOCAB),
                                                                                          NAMES).ids), logits)
    (only_spelled,) = torch.autograd.grad(format_nll(logits, logprobs, *at_action, spelled), logits)
    p = torch.softmax(logits.detach(), dim=-1)[0]
    assert begun[0, 5] < 0  # every token that begins a move: ` Up` raised with the moves
    torch.testing.assert_close(only_spelled[0, 5], p[5])  # spelled: ` Up` is a leak, pushed down by its p
