"""move_unlikelihood_among_moves: the terms that blame a move lower its share among the moves, and the mass they take
goes to the other moves alone, not to tokens that break the reply format; entropy_among_moves: the entropy bonus
raises the moves' shares' entropy at the action token alone."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from rollstream.consumer.learn.format_unlikelihood import tokenizer_piece, unlikelihood
from rollstream.consumer.learn.learner import make_learner
from rollstream.consumer.learn.loss import token_entropy
from rollstream.consumer.learn.move_share import (
    MoveTokens,
    move_entropy,
    move_names,
    move_positions,
    move_unlikelihood,
)
from rollstream.consumer.learn.policy_learner import PolicyLearner
from rollstream.consumer.learn.tensors import build_token_batch
from rollstream.shared.config import ConfigError, load_config
from rollstream.shared.schema import Trajectory, make_group_id, make_traj_id

from .helpers import learner_config, make_batch
from .test_no_effect_moves import walk

NAMES = ("Left", "Down", "Right", "Up")
VOCAB = ["<answer>", "L", "Left", "R", "ight", " Up", "Down", "x", "</answer>"]


def piece(token_id: int) -> str | None:
    return VOCAB[token_id]


def among_moves(logits: torch.Tensor, targets: torch.Tensor, tokens: MoveTokens) -> torch.Tensor:
    """`move_unlikelihood` with the targets' logprobs over the vocabulary taken from `logits`, as the loss has them."""
    log_p = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return move_unlikelihood(logits, targets, log_p, tokens)


def won_alike(tokenizer: AutoTokenizer) -> list[Trajectory]:
    """A group whose four members each won in two moves: beside a group that lost alike, the batch's success is 0.5
    (its ids as the codec takes them, so that it can be recorded too)."""
    group_id = make_group_id("train", "FrozenLake", 1, 0)
    return [dataclasses.replace(walk(tokenizer, m, ["P_\n_G", "_P\n_G"], success=True), group_id=group_id,
                                traj_id=make_traj_id(group_id, m)) for m in range(4)]


def moves_learner(tmp_path: Path, tiny_model: Path, *overrides: str) -> tuple[PolicyLearner, MoveTokens]:
    learner = make_learner(learner_config(tmp_path, tiny_model, "torch_train", *overrides))
    assert isinstance(learner, PolicyLearner) and learner.settings.move_tokens is not None
    return learner, learner.settings.move_tokens


def first_action_logits(learner: PolicyLearner, traj: Trajectory) -> tuple[torch.Tensor, int]:
    """(1, V): the learner's logits where the trajectory's first reply chose its action, and that token's index."""
    at = traj.turns[0].response_span[0] + 1  # after `<answer>`
    tokens = build_token_batch([traj], [0.0])
    with torch.no_grad():
        logits = learner.strategy.model(input_ids=tokens.input_ids).logits[0, at - 1]
    return logits.unsqueeze(0), int(traj.input_ids[at])


def test_a_token_begins_a_move_when_one_is_a_prefix_of_the_other() -> None:
    tokens = MoveTokens.of(piece, len(VOCAB), NAMES)
    assert dict(zip(tokens.ids.tolist(), tokens.moves.tolist())) == {1: 0, 2: 0, 3: 2, 5: 3, 6: 1}
    assert tokens.move_of(torch.tensor([3, 4, 2])).tolist() == [2, -1, 0]
    # A token that begins two moves counts for neither; a vocabulary that begins none is a config error.
    assert MoveTokens.of(lambda i: ["Move", "MoveUp"][i], 2, ("MoveUp", "MoveDown")).ids.tolist() == [1]
    with pytest.raises(ValueError, match="begins any of the moves"):
        MoveTokens.of(piece, len(VOCAB), ("Push",))
    assert move_names({"FrozenLake": NAMES, "Sokoban": ("Up", "Down", "Left", "Right", "Wait")}) == (*NAMES, "Wait")


def test_the_mass_taken_from_the_blamed_move_goes_to_the_other_moves_alone() -> None:
    """`R` at p = 0.98, the other moves and the format's tokens sharing the rest: over the vocabulary the term's
    gradient raises every token in proportion; among moves only the moves', and its value is -log(1 - q) of the
    move's share q, both spellings of a move counted as one."""
    tokens = MoveTokens.of(piece, len(VOCAB), NAMES)
    logits = torch.tensor([[0.0, 1.0, 2.0, 8.0, 0.5, 1.5, 3.0, 2.5, 0.0]], requires_grad=True)
    target = torch.tensor([3])
    among = among_moves(logits, target, tokens)
    (grad,) = torch.autograd.grad(among, logits)
    p = torch.softmax(logits.detach(), dim=-1)[0]
    moves = [1, 2, 3, 5, 6]
    q = p[3] / p[moves].sum()
    torch.testing.assert_close(among.detach(), -torch.log(1 - q), rtol=1e-4, atol=0)  # 1 - q rounds in float32
    assert grad[0, 3] > 0 and (grad[0, [1, 2, 5, 6]] < 0).all()  # descent: `R` down, the other moves up
    assert (grad[0, [0, 4, 7, 8]] == 0).all()  # `<answer>`, `ight`, `x`, `</answer>`: untouched
    left = among_moves(logits.detach(), torch.tensor([1]), tokens)  # `L`: its share is `L`'s and `Left`'s
    torch.testing.assert_close(left, -torch.log(1 - p[[1, 2]].sum() / p[moves].sum()), rtol=1e-4, atol=0)
    logprobs = torch.log_softmax(logits, dim=-1)[:, 3:4]
    (over_vocabulary,) = torch.autograd.grad(unlikelihood(logprobs, torch.ones(1, 1)), logits)
    assert (over_vocabulary[0, [0, 4, 7, 8]] < 0).all()  # the vocabulary's term raises the format breakers too


def test_a_blamed_token_that_begins_no_move_falls_back_to_the_vocabulary() -> None:
    tokens = MoveTokens.of(piece, len(VOCAB), NAMES)
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0, 1.5, 3.0, 2.5, 0.0]], requires_grad=True)
    away = among_moves(logits, torch.tensor([4]), tokens)  # `ight`
    (grad,) = torch.autograd.grad(away, logits)
    p = torch.softmax(logits.detach(), dim=-1)[0, 4]
    torch.testing.assert_close(away.detach(), -torch.log(1 - p))
    assert torch.isfinite(grad).all()


def test_the_move_into_the_wall_loses_its_share_among_moves(tmp_path: Path, tiny_model: Path) -> None:
    """A group that lost alike, each first walking into a wall, beside one that won: with the terms over moves the
    wall move's share among moves falls, as its probability did over the vocabulary."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    group = [walk(tokenizer, m, ["P_\n_G", "P_\n_G", "_P\n_G"]) for m in range(4)]
    learner, moves = moves_learner(tmp_path, tiny_model, "no_effect_unlikelihood_coef=1.0",
                                   "move_unlikelihood_among_moves=true")
    assert "R" in {tokenizer_piece(tokenizer)(int(i)) for i in moves.ids}

    def share() -> float:
        logits, right = first_action_logits(learner, group[0])
        return 1 - float(torch.exp(-among_moves(logits, torch.tensor([right]), moves)))  # q from -log(1 - q)

    before = share()
    metrics = learner.train_step(make_batch([group, won_alike(tokenizer)]))
    assert metrics["actor/no_effect_moves"] == 4.0 and metrics["loss/no_effect_unlikelihood"] > 0
    assert share() < before
    learner.close()


def test_the_bonus_among_moves_is_the_entropy_of_the_moves_shares_and_reaches_their_tokens_alone() -> None:
    tokens = MoveTokens.of(piece, len(VOCAB), NAMES)
    logits = torch.tensor([[0.0, 1.0, 2.0, 8.0, 0.5, 1.5, 3.0, 2.5, 0.0]], requires_grad=True)
    entropy = move_entropy(logits, tokens)
    (grad,) = torch.autograd.grad(entropy.sum(), logits)
    p = torch.softmax(logits.detach(), dim=-1)[0]
    shares = torch.stack([p[[1, 2]].sum(), p[6], p[3], p[5]]) / p[[1, 2, 3, 5, 6]].sum()  # `L` and `Left` one move
    torch.testing.assert_close(entropy.detach(), -(shares * shares.log()).sum().unsqueeze(0))
    assert grad[0, 3] < 0 and (grad[0, [1, 2, 5, 6]] > 0).all()  # ascent: the sure move `R` down, the others up
    assert (grad[0, [0, 4, 7, 8]] == 0).all()  # `<answer>`, `ight`, `x`, `</answer>`: untouched
    (over_vocabulary,) = torch.autograd.grad(token_entropy(logits).sum(), logits)
    assert (over_vocabulary[0, [0, 7, 8]] > 0).all()  # the vocabulary's entropy raises the format breakers too
    uniform = move_entropy(torch.zeros(1, len(VOCAB)).index_fill(1, torch.tensor([1, 2]), -0.6931), tokens)
    torch.testing.assert_close(uniform, torch.tensor([4.0]).log(), rtol=1e-4, atol=0)  # `L`, `Left` at half each


def test_a_named_move_that_no_token_begins_leaves_the_bonus_finite() -> None:
    tokens = MoveTokens.of(piece, len(VOCAB), (*NAMES, "Push"))
    logits = torch.randn(3, len(VOCAB), requires_grad=True)
    entropy = move_entropy(logits, tokens)
    (grad,) = torch.autograd.grad(entropy.sum(), logits)
    assert torch.isfinite(entropy).all() and torch.isfinite(grad).all()


def test_every_valid_reply_chose_its_move_at_its_action_token(tiny_model: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    piece_of = tokenizer_piece(tokenizer)
    traj = walk(tokenizer, 0, ["P_\n_G", "P_\n_G", "_P\n_G"], valid=(True, False, True))
    at = move_positions(traj, piece_of)
    assert at == [traj.turns[0].response_span[0] + 1, traj.turns[2].response_span[0] + 1]  # after `<answer>`
    assert [piece_of(int(traj.input_ids[k])) for k in at] == ["R", "R"]


def test_the_bonus_among_moves_raises_the_moves_entropy_where_no_advantage_trains(tmp_path: Path,
                                                                                  tiny_model: Path) -> None:
    """Two groups that each scored alike: no advantage, no blamed move, so the bonus is the loss's only term; it
    raises the entropy of the moves' shares at the action token and reports it."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    lost = [walk(tokenizer, m, ["P_\n_G", "_P\n_G"]) for m in range(4)]
    learner, moves = moves_learner(tmp_path, tiny_model, "entropy_loss_coef=0.5", "entropy_among_moves=true")

    def entropy() -> float:
        return float(move_entropy(first_action_logits(learner, lost[0])[0], moves))

    before = entropy()
    metrics = learner.train_step(make_batch([lost, won_alike(tokenizer)]))
    assert metrics["loss/move_entropy"] > 0 and metrics["actor/entropy_coef"] == 0.5
    assert entropy() > before
    learner.close()


def test_the_bonus_among_moves_needs_a_bonus() -> None:
    with pytest.raises(ConfigError, match="no entropy bonus to take among the moves"):
        load_config(None, ["entropy_among_moves=true"])
    assert load_config(None, ["entropy_among_moves=true", "entropy_target=0.1"]).entropy_among_moves
