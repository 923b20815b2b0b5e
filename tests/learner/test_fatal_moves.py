"""fatal_move_unlikelihood_coef: the move after which the env ended an episode in failure is found at the token
that chose its action, its group is kept by the filter whatever it scored, and the loss moves that token however
sure the policy is."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from transformers import AutoTokenizer

from rollstream.consumer.data.group_filters import NoAdvantageFilter
from rollstream.consumer.learn.fatal_moves import fatal_move_positions, success_scaled_coef
from rollstream.consumer.learn.format_unlikelihood import tokenizer_piece
from rollstream.consumer.learn.learner import make_learner
from rollstream.consumer.learn.policy_learner import PolicyLearner
from rollstream.consumer.learn.tensors import build_token_batch
from rollstream.shared.config import load_config
from rollstream.shared.envs.text import answer_token
from rollstream.shared.schema import Trajectory

from .helpers import learner_config, make_batch, make_trajectory


def test_the_answer_token_is_where_the_action_was_chosen() -> None:
    assert answer_token(["<answer>", "R", "ight", "</answer>", None]) == 1
    assert answer_token(["<think>", "go", "</think>", "<answer>", " Down", "</answer>"]) == 4
    assert answer_token(["<ans", "wer>Ri", "ght</answer>"]) == 1  # a token across the tag holds the choice
    assert answer_token(["<answer>", "Down", "<answer>"]) is None  # not a well-formed reply
    assert answer_token([]) is None


def lost_trajectory(tokenizer: AutoTokenizer, member: int, reply: str = "<answer>Down</answer>", *,
                    success: bool = False, end_reason: str = "terminated", valid: bool = True) -> Trajectory:
    """Two turns, the last one `reply` (and end-of-sequence), every reward 0: the episode lost unless `success`."""
    ids: list[int] = []
    spans = []
    for turn in (1, 2):
        ids += tokenizer.encode(f"Turn {turn}\nState:\nP_\n_G\n", add_special_tokens=False)
        reply_ids = tokenizer.encode(reply if turn == 2 else "<answer>Right</answer>", add_special_tokens=False)
        spans.append((len(ids), len(ids) + len(reply_ids) + 1))
        ids += reply_ids + [tokenizer.eos_token_id]
    traj = make_trajectory(0, member, ids, spans, {k: -0.5 for s, e in spans for k in range(s, e)},
                           [("a", 0.0), ("b", 0.0)])
    traj.turns[-1] = dataclasses.replace(traj.turns[-1], reply=reply, action_is_valid=valid)
    return dataclasses.replace(traj, success=success, end_reason=end_reason)


def test_the_fatal_move_is_the_last_replys_action_token(tiny_model: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)

    piece = tokenizer_piece(tokenizer)

    def blamed(traj: Trajectory) -> list[str | None]:
        return [piece(int(traj.input_ids[k])) for k in fatal_move_positions(traj, piece)]

    assert blamed(lost_trajectory(tokenizer, 0)) == ["Down"]
    assert blamed(lost_trajectory(tokenizer, 0, "<answer>Right</answer>")) == ["R"]  # `R` `ight`: the choice is `R`
    assert blamed(lost_trajectory(tokenizer, 0, success=True)) == []
    assert blamed(lost_trajectory(tokenizer, 0, end_reason="truncated")) == []  # out of moves: no one move to blame
    assert blamed(lost_trajectory(tokenizer, 0, "<answer>Down<answer>", valid=False)) == []


def test_the_filter_keeps_a_group_that_lost_by_a_move_only_with_the_term(tmp_path: Path, tiny_model: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    lost = [lost_trajectory(tokenizer, m) for m in range(4)]
    out_of_moves = [lost_trajectory(tokenizer, m, end_reason="truncated") for m in range(4)]
    plain = NoAdvantageFilter(load_config(None, [f"output_dir={tmp_path}"]))
    blaming = NoAdvantageFilter(load_config(None, [f"output_dir={tmp_path}", "fatal_move_unlikelihood_coef=1.0"]))
    assert plain.filter("g", lost) and plain.filter("g", out_of_moves)
    assert not blaming.filter("g", lost) and blaming.filter("g", out_of_moves)


def test_at_success_rate_the_filter_keeps_that_share_of_groups_kept_for_the_term(tmp_path: Path,
                                                                                  tiny_model: Path) -> None:
    """`fatal_move_groups: at_success_rate`: while nothing is won such groups are dropped as any other without an
    advantage; once a quarter of the recent episodes win, every fourth is kept."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    lost = [lost_trajectory(tokenizer, m) for m in range(4)]
    won = [lost_trajectory(tokenizer, m, success=True) for m in range(4)]
    sharing = NoAdvantageFilter(load_config(None, [f"output_dir={tmp_path}", "fatal_move_unlikelihood_coef=1.0",
                                                   "fatal_move_groups=at_success_rate"]))
    assert all(sharing.filter("g", lost) for _ in range(64))  # 256 episodes, none won
    assert sharing.fatal_share is not None and sharing.fatal_share.rate() == 0.0
    for _ in range(16):  # the last 256 episodes: 64 won
        assert sharing.filter("g", won)  # all won alike: nothing to learn, no fatal move
    assert sharing.fatal_share.rate() == 0.25
    kept = [not sharing.filter("g", lost) for _ in range(12)]
    assert kept == [False, False, False, True] * 3  # a quarter of the last 256 won: every fourth


def test_the_term_scales_with_the_batchs_success(tiny_model: Path) -> None:
    """At full strength from the first step a policy that never reached the goal learnt to walk into walls instead
    (docs/learning.md); scaled by the batch's success, it waits for the goal to be found."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    lost = [lost_trajectory(tokenizer, m) for m in range(4)]
    won = [lost_trajectory(tokenizer, m, success=True) for m in range(4)]
    assert success_scaled_coef(1.0, lost) == 0.0
    assert success_scaled_coef(1.0, lost + won) == 0.5
    assert success_scaled_coef(0.0, won) == 0.0 and success_scaled_coef(1.0, []) == 0.0


def test_a_group_that_lost_alike_is_trained_and_the_fatal_move_falls(tmp_path: Path, tiny_model: Path) -> None:
    """Four members that fell into the same hole: no advantage, so without the term no gradient; with it the
    fatal move's action token loses probability, even where the policy was sure of it. (Beside them a group that
    won alike, so the batch's success, which scales the term, is 0.5.)"""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    group = [lost_trajectory(tokenizer, m) for m in range(4)]
    won = [dataclasses.replace(lost_trajectory(tokenizer, m, success=True), group_id="won") for m in range(4)]
    learners = [make_learner(learner_config(tmp_path / name, tiny_model, "torch_train", *extra))
                for name, extra in (("plain", ()), ("blaming", ("fatal_move_unlikelihood_coef=1.0",)))]
    plain, blaming = learners
    assert isinstance(plain, PolicyLearner) and isinstance(blaming, PolicyLearner)
    down_at = group[0].num_tokens - 3  # the last reply: <answer>, Down, </answer>, end

    def hidden_and_logprob(learner: PolicyLearner) -> tuple[torch.Tensor, float]:
        tokens = build_token_batch([group[0]], [0.0])
        with torch.no_grad():
            out = learner.strategy.model(input_ids=tokens.input_ids, output_hidden_states=True)
        logprob = torch.log_softmax(out.logits[0, down_at - 1], dim=-1)[group[0].input_ids[down_at]]
        return out.hidden_states[-1][0, down_at - 1], float(logprob)

    for learner in learners:  # make both sure of the fatal move, as a collapsed policy is
        hidden, _ = hidden_and_logprob(learner)
        with torch.no_grad():
            learner.strategy.model.get_output_embeddings().weight[group[0].input_ids[down_at]] += (
                12 * hidden / hidden.dot(hidden))
    before = hidden_and_logprob(blaming)[1]
    assert before > -0.05  # p > 0.95
    kept, moved = plain.train_step(make_batch([group, won])), blaming.train_step(make_batch([group, won]))
    assert kept["actor/grad_norm"] == 0.0 and "loss/fatal_unlikelihood" not in kept
    assert moved["actor/fatal_move_coef"] == 0.5
    assert moved["actor/fatal_moves"] == 4.0 and moved["loss/fatal_unlikelihood"] > 0
    assert hidden_and_logprob(blaming)[1] < before - 0.5
    for learner in learners:
        learner.close()
