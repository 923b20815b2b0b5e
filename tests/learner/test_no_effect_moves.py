"""no_effect_unlikelihood_coef: a valid move after which the env showed the same state is found at the token that
chose its action, and the loss lowers that token's probability in a group the policy gradient leaves alone, scaled
by the batch's success."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from transformers import AutoTokenizer

from rollstream.consumer.learn.format_unlikelihood import tokenizer_piece
from rollstream.consumer.learn.learner import make_learner
from rollstream.consumer.learn.no_effect_moves import no_effect_move_positions
from rollstream.consumer.learn.policy_learner import PolicyLearner
from rollstream.consumer.learn.tensors import build_token_batch
from rollstream.shared.schema import Trajectory

from .helpers import learner_config, make_batch, make_trajectory


def walk(tokenizer: AutoTokenizer, member: int, states: list[str], *, success: bool = False,
         valid: tuple[bool, ...] | None = None) -> Trajectory:
    """One turn per state in `states` (the state the policy saw), each reply `<answer>Right</answer>` and
    end-of-sequence, every reward 0 (the episode lost unless `success`)."""
    ids: list[int] = []
    spans = []
    for turn, state in enumerate(states, 1):
        ids += tokenizer.encode(f"Turn {turn}\nState:\n{state}\n", add_special_tokens=False)
        reply_ids = tokenizer.encode("<answer>Right</answer>", add_special_tokens=False)
        spans.append((len(ids), len(ids) + len(reply_ids) + 1))
        ids += reply_ids + [tokenizer.eos_token_id]
    traj = make_trajectory(0, member, ids, spans, {k: -0.5 for s, e in spans for k in range(s, e)},
                           [(state, 0.0) for state in states])
    traj.turns = [dataclasses.replace(turn, reply="<answer>Right</answer>", action="Right",
                                      action_is_valid=True if valid is None else valid[i])
                  for i, turn in enumerate(traj.turns)]
    return dataclasses.replace(traj, success=success)


def test_a_move_that_changed_nothing_is_its_action_token(tiny_model: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)

    piece = tokenizer_piece(tokenizer)

    def blamed(traj: Trajectory) -> list[int]:
        return no_effect_move_positions(traj, piece)

    walled = walk(tokenizer, 0, ["P_\n_G", "P_\n_G", "_P\n_G"])  # the first move changed nothing, the second did
    first_reply = walled.turns[0].response_span[0]
    assert [piece(int(walled.input_ids[k])) for k in blamed(walled)] == ["R"]  # `R` `ight`: the choice is `R`
    assert blamed(walled) == [first_reply + 1]  # after `<answer>`
    assert blamed(walk(tokenizer, 0, ["P_\n_G", "_P\n_G"])) == []  # every move changed the state
    assert blamed(walk(tokenizer, 0, ["P_\n_G", "P_\n_G"], valid=(False, True))) == []  # no move: an unparsed reply
    assert blamed(walk(tokenizer, 0, ["P_\n_G"])) == []  # the last move's outcome is not in the trajectory


def test_the_move_into_the_wall_falls_in_a_group_that_scored_alike(tmp_path: Path, tiny_model: Path) -> None:
    """Four members that lost alike, each first walking into a wall: no advantage, so without the term no gradient;
    with it the move's action token loses probability. Beside them a group that won alike, so the batch's success,
    which scales the term, is 0.5."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    group = [walk(tokenizer, m, ["P_\n_G", "P_\n_G", "_P\n_G"]) for m in range(4)]
    won = [dataclasses.replace(walk(tokenizer, m, ["P_\n_G", "_P\n_G"], success=True), group_id="won")
           for m in range(4)]
    learners = [make_learner(learner_config(tmp_path / name, tiny_model, "torch_train", *extra))
                for name, extra in (("plain", ()), ("blaming", ("no_effect_unlikelihood_coef=1.0",)))]
    plain, blaming = learners
    assert isinstance(plain, PolicyLearner) and isinstance(blaming, PolicyLearner)
    right_at = group[0].turns[0].response_span[0] + 1

    def logprob(learner: PolicyLearner) -> float:
        tokens = build_token_batch([group[0]], [0.0])
        with torch.no_grad():
            logits = learner.strategy.model(input_ids=tokens.input_ids).logits
        return float(torch.log_softmax(logits[0, right_at - 1], dim=-1)[group[0].input_ids[right_at]])

    before = logprob(blaming)
    kept, moved = plain.train_step(make_batch([group, won])), blaming.train_step(make_batch([group, won]))
    assert kept["actor/grad_norm"] == 0.0 and "loss/no_effect_unlikelihood" not in kept
    assert moved["actor/no_effect_coef"] == 0.5
    assert moved["actor/no_effect_moves"] == 4.0 and moved["loss/no_effect_unlikelihood"] > 0
    assert logprob(blaming) < before
    for learner in learners:
        learner.close()
