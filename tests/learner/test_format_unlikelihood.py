"""format_unlikelihood_coef: the token at which a reply broke the format, found in its tokens, and a loss on it
that moves it however sure the policy is."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from transformers import AutoTokenizer

from rollstream.consumer.learn.format_unlikelihood import (
    break_positions,
    reply_formats,
    spells_moves_whole,
    tokenizer_piece,
    unlikelihood,
)
from rollstream.consumer.learn.learner import make_learner
from rollstream.consumer.learn.loss import response_positions
from rollstream.consumer.learn.policy_learner import PolicyLearner
from rollstream.consumer.learn.tensors import build_token_batch
from rollstream.shared.config import RollstreamConfig
from rollstream.shared.schema import Trajectory
from rollstream.tiny_model import build_tiny_model

from .helpers import learner_config, make_batch, make_trajectory

NAMES = ("Left", "Down", "Right", "Up")


def reply_trajectory(tokenizer: AutoTokenizer, member: int, reply: str, parsed: bool, end: bool = True) -> Trajectory:
    """One turn: a short prompt, then `reply`'s tokens (and end-of-sequence) as the generated reply."""
    prompt = tokenizer.encode("Turn 1\nState:\nP_\n_G\n", add_special_tokens=False)
    generated = tokenizer.encode(reply, add_special_tokens=False) + ([tokenizer.eos_token_id] if end else [])
    span = (len(prompt), len(prompt) + len(generated))
    traj = make_trajectory(0, member, prompt + generated, [span], {k: -0.5 for k in range(*span)}, [("s", 0.0)])
    traj.turns[0] = dataclasses.replace(traj.turns[0], reply=reply, action_is_valid=parsed,
                                        action="Down" if parsed else None)
    return traj


def test_the_break_is_found_in_the_replys_own_tokens(tiny_model: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)

    piece = tokenizer_piece(tokenizer)

    def broke_at(reply: str, parsed: bool = False, end: bool = True) -> list[str | None]:
        traj = reply_trajectory(tokenizer, 0, reply, parsed, end)
        return [piece(int(traj.input_ids[k])) for k in break_positions(traj, piece, NAMES)]

    assert broke_at("<answer>Down<answer>Down") == ["<answer>"]
    assert broke_at("<answer></answer>") == ["</answer>"]
    assert broke_at("<answer>Down") == [None]  # ended where the closing tag belongs
    assert broke_at("<answer>Do", end=False) == []  # cut off by the token cap: nothing to blame
    assert broke_at("<answer>Down</answer>", parsed=True) == []
    assert reply_formats(RollstreamConfig().custom_envs)["FrozenLake"] == NAMES


def test_with_every_move_one_token_an_answer_breaks_at_its_first_token(tiny_model: Path, tmp_path: Path) -> None:
    """`tiny_model.action_tokens`: `<answer>` `L` `Right` broke at the `L`, where the tokenizer that spells
    `Right` as `R` `ight` reads the break at the `R` after it (the `L` could still have begun `Left`)."""
    formats = reply_formats(RollstreamConfig().custom_envs)
    split = AutoTokenizer.from_pretrained(tiny_model)
    whole = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path, tie_word_embeddings=True, corpus_episodes=20,
                                                           action_tokens=True))
    assert spells_moves_whole(split, formats)["FrozenLake"] is False
    assert spells_moves_whole(whole, formats)["FrozenLake"] is True

    for tokenizer, expected in ((split, "R"), (whole, "L")):
        piece = tokenizer_piece(tokenizer)
        traj = reply_trajectory(tokenizer, 0, "<answer>LRight</answer>", parsed=False)
        at = break_positions(traj, piece, NAMES, whole_moves=spells_moves_whole(tokenizer, formats)["FrozenLake"])
        assert [piece(int(traj.input_ids[k])) for k in at] == [expected]


def test_its_gradient_moves_a_token_the_policy_is_sure_of() -> None:
    """On a token at p = 0.996 a policy-gradient push reaches its logit scaled by 1 - p; the unlikelihood's is p,
    and the mass it frees goes to the other tokens in proportion to their own probabilities."""
    logits = torch.tensor([[0.0, 1.0, 2.0, 9.0]], requires_grad=True)
    logprobs = torch.log_softmax(logits, dim=-1)[:, 3:4]
    p = float(logprobs.detach().exp())
    (push,) = torch.autograd.grad(logprobs.sum(), logits, retain_graph=True)  # a penalty's gradient, advantage -1
    (away,) = torch.autograd.grad(unlikelihood(logprobs, torch.ones(1, 1)), logits)
    assert p > 0.99
    torch.testing.assert_close(push[0, 3], torch.tensor(1 - p))
    torch.testing.assert_close(away[0, 3], torch.tensor(p), atol=1e-3, rtol=0)  # float32: 1 - p from log p
    others = torch.softmax(logits.detach(), dim=-1)[0, :3]
    torch.testing.assert_close(away[0, :3] / away[0, :3].sum(), others / others.sum())


def test_a_broken_reply_with_no_advantage_is_trained_and_its_breaking_token_falls(tmp_path: Path,
                                                                                  tiny_model: Path) -> None:
    """A group that scored alike (no advantage) with one reply broken: without the term the step has no gradient;
    with it that row trains, and the breaking token's logprob falls."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    group = [reply_trajectory(tokenizer, m, "<answer>Down</answer>", parsed=True) for m in range(4)]
    group[0] = reply_trajectory(tokenizer, 0, "<answer>Down<answer>Down", parsed=False)
    learners = [make_learner(learner_config(tmp_path / name, tiny_model, "torch_train", *extra))
                for name, extra in (("plain", ()), ("away", ("format_unlikelihood_coef=1.0",)))]
    assert all(isinstance(learner, PolicyLearner) for learner in learners)
    plain, away = learners
    assert isinstance(plain, PolicyLearner) and isinstance(away, PolicyLearner)

    break_at = group[0].num_tokens - 3  # the second <answer>: prompt, <answer>, Down, <answer>, Down, end

    def break_logprob(learner: PolicyLearner) -> float:
        tokens = build_token_batch([group[0]], [0.0])
        with torch.no_grad():
            logits = learner.strategy.forward(tokens.input_ids, tokens.attention_mask,
                                              response_positions(tokens.response_mask))
        targets = tokens.input_ids[0, 1:][tokens.response_mask[0] > 0]
        row = int((tokens.response_mask[0].nonzero().squeeze(1) == break_at - 1).nonzero())
        return float(torch.log_softmax(logits[row], dim=-1)[targets[row]])

    # A random model is unsure of every token; make both sure of the breaking one, as the runs' policies were: its
    # lm_head row raised along the hidden state that predicts it, by 12 nats.
    for learner in learners:
        tokens = build_token_batch([group[0]], [0.0])
        with torch.no_grad():
            model = learner.strategy.model
            hidden = model(input_ids=tokens.input_ids, output_hidden_states=True).hidden_states[-1][0, break_at - 1]
            model.get_output_embeddings().weight[group[0].input_ids[break_at]] += 12 * hidden / hidden.dot(hidden)
    before = break_logprob(away)
    assert before > -0.05  # p > 0.95
    kept, moved = plain.train_step(make_batch([group])), away.train_step(make_batch([group]))
    assert kept["actor/grad_norm"] == 0.0 and "loss/format_unlikelihood" not in kept
    assert moved["actor/format_breaks"] == 1.0 and moved["loss/format_unlikelihood"] > 0
    assert moved["actor/grad_norm"] > 0
    assert break_logprob(away) < before - 0.5
    for learner in learners:
        learner.close()


def test_with_the_advantage_ended_at_the_break_a_reply_broken_from_its_first_token_is_not_trained(
        tmp_path: Path, tiny_model: Path) -> None:
    """`format_break_ends_advantage`: a group whose replies all broke at their first token, one of them in a won
    episode, carries advantages; with the key every reply token is at or after a break, so the step has no
    gradient (and no format unlikelihood here to give it one)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    group = [reply_trajectory(tokenizer, m, "Jump", parsed=False) for m in range(4)]
    group[0].turns[0] = dataclasses.replace(group[0].turns[0], reward=1.0)
    group[0] = dataclasses.replace(group[0], score=1.0, success=True)
    for ends, expect_gradient in ((False, True), (True, False)):
        learner = make_learner(learner_config(tmp_path / str(ends), tiny_model, "torch_train",
                                              f"format_break_ends_advantage={str(ends).lower()}"))
        stats = learner.train_step(make_batch([group]))
        assert (stats["adv/max"] > 0) is expect_gradient  # the advantages trained, after the key's cut
        assert (stats["actor/grad_norm"] > 0) is expect_gradient
        learner.close()
