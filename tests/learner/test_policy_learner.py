"""The learner on a real tiny model with the torch strategy: it learns, publishes, and resumes exactly."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollstream.consumer.learn.advantages import AdvantageSettings, compute_advantages
from rollstream.consumer.learn.learner import make_learner
from rollstream.consumer.learn.loss import forward_kl, response_positions
from rollstream.consumer.learn.policy_learner import PolicyLearner, UpdateSettings, microbatch_loss, unparsed_drift
from rollstream.consumer.learn.tensors import build_token_batch
from rollstream.shared.bad_words import bad_word_ids
from rollstream.shared.config import ConfigError
from rollstream.shared.schema import Trajectory
from rollstream.shared.weights_io import verify_digest, weights_path_from_uri

from .helpers import (
    TinySampler,
    draw_until_mixed,
    even_first_token,
    learner_config,
    make_batch,
    make_trajectory,
    sample_single_turn_groups,
    sample_two_turn_group,
)

METRICS = ("loss/pg", "loss/kl", "loss/entropy", "actor/clip_frac", "actor/approx_kl", "actor/grad_norm",
           "actor/lr", "adv/mean", "adv/std", "adv/min", "adv/max", "actor/ratio_mean", "actor/tokens_per_s",
           "time/advantages_s", "time/update_s")


@pytest.fixture(scope="module")
def sampler(tiny_model: Path) -> TinySampler:
    return TinySampler(tiny_model, seed=3)


@pytest.fixture(scope="module")
def groups(sampler: TinySampler) -> list[list[Trajectory]]:
    return draw_until_mixed(lambda: sample_single_turn_groups(sampler, groups=2, group_size=4,
                                                              reward=even_first_token))


def torch_learner(tmp_path: Path, model: Path, *overrides: str) -> PolicyLearner:
    cfg = learner_config(tmp_path, model, "torch_train", *overrides)
    learner = make_learner(cfg)
    assert isinstance(learner, PolicyLearner)
    return learner


def params(learner: PolicyLearner) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in learner.strategy.model.state_dict().items()}


def test_rewarded_replies_gain_probability(tmp_path: Path, tiny_model: Path, sampler: TinySampler,
                                           groups: list[list[Trajectory]]) -> None:
    learner = torch_learner(tmp_path, tiny_model)
    trajs = [t for g in groups for t in g]
    before = [sampler.reply_logprob(t) for t in trajs]
    history = [learner.train_step(make_batch(groups, step)) for step in range(6)]
    after = [sampler.reply_logprob(t, learner.strategy.model) for t in trajs]
    learner.close()

    for metrics in history:
        assert set(METRICS) <= set(metrics) and all(np.isfinite(v) for v in metrics.values())
    # The surrogate falls as the replayed batch is fitted; clipping starts to bite.
    assert history[-1]["loss/pg"] < history[0]["loss/pg"] - 0.05
    assert history[-1]["actor/clip_frac"] > 0
    gain = np.array(after) - np.array(before)
    rewarded = np.array([t.score > 0 for t in trajs])
    assert gain[rewarded].mean() > 0.2, gain
    assert gain[~rewarded].mean() < -0.2, gain


def test_micro_batching_does_not_change_the_update(tmp_path: Path, tiny_model: Path,
                                                   groups: list[list[Trajectory]]) -> None:
    """Micro-batches of any size give the same gradient: each loss is scaled by the mini-batch's token count."""
    whole = torch_learner(tmp_path / "a", tiny_model)
    one_row_each = torch_learner(tmp_path / "b", tiny_model, "actor_train.training_args.max_tokens_per_microbatch=1")
    m_whole = whole.train_step(make_batch(groups))
    m_rows = one_row_each.train_step(make_batch(groups))
    assert m_whole["loss/pg"] == pytest.approx(m_rows["loss/pg"], rel=1e-5, abs=1e-7)
    assert m_whole["actor/grad_norm"] == pytest.approx(m_rows["actor/grad_norm"], rel=1e-4)
    # Adam's first step is about lr x g / (|g| + eps), so float noise in gradients near eps (embedding rows of
    # tokens the batch barely uses) shows up as a few differences of ~1e-5 against steps of 1e-3 (lr).
    a, b = params(whole), params(one_row_each)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=5e-5)
    whole.close()
    one_row_each.close()


def test_skipping_zero_advantage_rows_gives_the_same_update(tmp_path: Path, tiny_model: Path,
                                                           groups: list[list[Trajectory]]) -> None:
    """A group whose members all scored the same has zero advantages and so a zero gradient: skipping its rows
    (the default) gives the update that computing them gives, over two PPO epochs, and counts them."""
    alike = [dataclasses.replace(t, score=0.0, turns=[dataclasses.replace(u, reward=0.0) for u in t.turns])
             for t in groups[0]]
    batch = [alike, groups[1]]
    # mini-batches of 2 rows: some hold only skipped rows and are still optimizer steps (Adam moves on momentum)
    shape = ("ppo_epochs=2", "actor_train.training_args.per_device_train_batch_size=2")
    skipping = torch_learner(tmp_path / "a", tiny_model, *shape)
    computing = torch_learner(tmp_path / "b", tiny_model, *shape, "skip_zero_advantage=false")
    for step in range(2):
        skipped = skipping.train_step(make_batch(batch, step))
        computed = computing.train_step(make_batch(batch, step))
        assert skipped["actor/zero_adv_rows"] == computed["actor/zero_adv_rows"] == len(alike)
        assert skipped["actor/optimizer_steps"] == computed["actor/optimizer_steps"] == 8
        assert skipped["actor/grad_norm"] == pytest.approx(computed["actor/grad_norm"], rel=1e-4)
        assert skipped["actor/tokens_per_s"] > 0
    a, b = params(skipping), params(computing)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=5e-5)  # as micro-batching (above)
    skipping.close()
    computing.close()


def test_early_stop_kl_discards_the_minibatch_that_crossed_it_and_ends_the_step(
        tmp_path: Path, tiny_model: Path, groups: list[list[Trajectory]]) -> None:
    """The first mini-batch is measured at the sampling weights (KL ~ 0, under the limit) and trains; the second,
    measured after that update, is over it: its gradient is dropped and the step ends. So the weights are those
    of a one-mini-batch step. Without a limit all eight mini-batches of two epochs train."""
    shape = ("ppo_epochs=2", "actor_train.training_args.per_device_train_batch_size=2")
    stopping = torch_learner(tmp_path / "a", tiny_model, *shape, "early_stop_kl=1e-6")
    training_on = torch_learner(tmp_path / "b", tiny_model, *shape)
    before = params(stopping)
    stopped = stopping.train_step(make_batch(groups))
    full = training_on.train_step(make_batch(groups))
    assert (stopped["actor/optimizer_steps"], stopped["actor/early_stopped"]) == (1, 1.0)
    assert stopped["actor/approx_kl_max"] > 1e-6
    assert (full["actor/optimizer_steps"], full["actor/early_stopped"]) == (8, 0.0)
    assert full["actor/approx_kl_max"] >= full["actor/approx_kl"] > 0
    # the dropped gradient reached no parameter: a later step starts from clean gradients
    assert all(p.grad is None for p in stopping.strategy.model.parameters())
    assert any(not torch.equal(before[k], v) for k, v in params(stopping).items())
    stopping.close()
    training_on.close()


def test_the_format_anchor_engages_only_on_a_batch_whose_replies_fail_to_parse(
        tmp_path: Path, tiny_model: Path, groups: list[list[Trajectory]]) -> None:
    """kl_anchor_valid_rate: a batch whose replies parse trains exactly as without the anchor (no KL term); a
    batch of unparsed replies that all scored alike (no advantage left: a policy that lost its format) gets the KL
    penalty to the warm start, the only gradient such a batch has, so the weights then differ. The reference model
    runs only on the step with the KL term."""
    anchored = torch_learner(tmp_path / "a", tiny_model, "kl_anchor_valid_rate=0.5", "kl_anchor_coef=0.05")
    plain = torch_learner(tmp_path / "b", tiny_model)
    assert anchored.reference is not None and plain.reference is None
    reference, reference_forwards = anchored.reference, []

    def counted_reference(*args: Any) -> torch.Tensor:
        reference_forwards.append(args)
        return reference(*args)

    anchored.reference = counted_reference
    parsed = [anchored.train_step(make_batch(groups)), plain.train_step(make_batch(groups))]
    assert [m["actor/kl_coef"] for m in parsed] == [0.0, 0.0]
    assert reference_forwards == []
    same = params(anchored)
    for name, value in params(plain).items():
        torch.testing.assert_close(same[name], value, rtol=0, atol=0)
    failed = [[dataclasses.replace(t, score=-1.0, success=False,
                                   turns=[dataclasses.replace(u, action=None, action_is_valid=False, reward=-1.0)
                                          for u in t.turns]) for t in group] for group in groups]
    broken = [anchored.train_step(make_batch(failed, 1)), plain.train_step(make_batch(failed, 1))]
    assert [m["actor/kl_coef"] for m in broken] == [0.05, 0.0]
    assert reference_forwards
    assert broken[0]["adv/std"] == broken[1]["adv/std"] == 0.0
    assert broken[0]["loss/kl"] > 0  # the first step moved the policy away from the warm start
    pulled = params(anchored)
    assert any(not torch.equal(pulled[k], v) for k, v in params(plain).items())
    anchored.close()
    plain.close()


def test_the_anchor_on_unparsed_replies_pulls_their_rows_alone(
        tmp_path: Path, tiny_model: Path, groups: list[list[Trajectory]]) -> None:
    """kl_anchor_unparsed_replies: a batch whose replies all parse trains exactly as without the anchor, with no
    reference forward; in a batch where one reply of a group that scored alike (no advantage) did not parse, the
    reference runs on that reply's row alone, the pull is on its positions alone, and that row, skipped without
    the anchor, now moves the weights."""
    anchored = torch_learner(tmp_path / "a", tiny_model, "kl_anchor_unparsed_replies=true", "kl_anchor_coef=0.05")
    plain = torch_learner(tmp_path / "b", tiny_model)
    assert anchored.reference is not None
    reference, reference_rows = anchored.reference, []

    def counted_reference(*args: Any) -> torch.Tensor:
        reference_rows.append(int(args[0].shape[0]))
        return reference(*args)

    anchored.reference = counted_reference
    parsed = [anchored.train_step(make_batch(groups)), plain.train_step(make_batch(groups))]
    assert reference_rows == [] and [m["loss/unparsed_kl"] for m in parsed] == [0.0, 0.0]
    same = params(anchored)
    for name, value in params(plain).items():
        torch.testing.assert_close(same[name], value, rtol=0, atol=0)
    alike = [dataclasses.replace(t, score=0.0, turns=[dataclasses.replace(u, reward=0.0) for u in t.turns])
             for t in groups[0]]
    broken = dataclasses.replace(alike[0], turns=[dataclasses.replace(u, action=None, action_is_valid=False)
                                                  for u in alike[0].turns])
    batch = [[broken, *alike[1:]], alike]
    pulled, kept = anchored.train_step(make_batch(batch, 1)), plain.train_step(make_batch(batch, 1))
    assert reference_rows == [1]  # the broken reply's row, in one forward
    assert pulled["actor/kl_coef"] == kept["actor/kl_coef"] == 0.0  # no step-wide penalty
    assert pulled["loss/unparsed_kl"] > 0 and kept["loss/unparsed_kl"] == 0.0
    assert kept["actor/grad_norm"] == 0.0 < pulled["actor/grad_norm"]  # no advantage anywhere: only the pull
    anchored.close()
    plain.close()


def test_unparsed_drift_is_the_kl_at_the_broken_replies_positions_only() -> None:
    """The pull's value, against KL(reference || policy) computed by hand at the positions of the one reply that did
    not parse (the second reply of the second row: tokens 5 and 6, predicted at positions 4 and 5)."""
    tables = [torch.randn(32, 32, generator=torch.Generator().manual_seed(seed)) for seed in (0, 1)]

    def model(table: torch.Tensor) -> Any:
        # logits that depend on the token and its position, so a misaligned row or position shows
        def forward(ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
            full = table[ids] + 0.1 * torch.arange(ids.shape[1])[None, :, None]
            return full if positions is None else full[positions]
        return forward

    def trajectory(member: int, second_parses: bool) -> Trajectory:
        traj = make_trajectory(0, member, [10, 11, 12, 13, 14, 15, 16], [(2, 4), (5, 7)], {}, [("a", 0.0), ("b", 0.0)])
        traj.turns[1] = dataclasses.replace(traj.turns[1], action_is_valid=second_parses)
        return traj

    tokens = build_token_batch([trajectory(0, True), trajectory(1, False)], [0.0, 0.0])
    policy, reference = model(tables[0]), model(tables[1])
    logits = policy(tokens.input_ids, tokens.attention_mask, response_positions(tokens.response_mask))
    drift = unparsed_drift(logits, tokens, reference)
    assert drift is not None
    row = tokens.input_ids[1:]
    expected = forward_kl(policy(row, row, None)[0, 4:6], reference(row, row, None)[0, 4:6]).sum()
    torch.testing.assert_close(drift, expected)
    assert unparsed_drift(logits, build_token_batch([trajectory(0, True)] * 2, [0.0, 0.0]), reference) is None


def test_gigpo_recompute_kl_and_entropy_together(tmp_path: Path, tiny_model: Path, sampler: TinySampler) -> None:
    """Two-turn episodes with per-turn GiGPO advantages, recomputed old logprobs, a KL penalty and an entropy
    bonus, two PPO epochs of two mini-batches each."""
    observations = ["Turn 2\nState:\n_P\n_G", "Turn 2\nState:\n__\nPG"]
    groups = draw_until_mixed(lambda: [sample_two_turn_group(sampler, g, 4, observations, even_first_token)
                                       for g in range(2)])
    learner = torch_learner(tmp_path, tiny_model, "adv_estimator=gigpo", "gamma=0.9", "old_logprobs=recompute",
                            "init_kl_coef=0.1", "entropy_loss_coef=0.01", "ppo_epochs=2",
                            "actor_train.training_args.max_tokens_per_microbatch=200")
    # The per-turn advantages reach the tokens of their own turn only.
    advantages = compute_advantages(groups, AdvantageSettings("gigpo", gamma=0.9))
    tokens = build_token_batch([t for g in groups for t in g], advantages)
    first = groups[0][0]
    (s1, e1), (s2, e2) = (turn.response_span for turn in first.turns)
    np.testing.assert_allclose(tokens.advantages[0, s1 - 1:e1 - 1], advantages[0][0], rtol=1e-6)
    np.testing.assert_allclose(tokens.advantages[0, s2 - 1:e2 - 1], advantages[0][1], rtol=1e-6)

    metrics = learner.train_step(make_batch(groups))
    learner.close()
    assert all(np.isfinite(v) for v in metrics.values())
    assert metrics["actor/optimizer_steps"] == 4
    assert metrics["loss/kl"] > 0  # the policy moved away from the reference during the step
    assert metrics["loss/entropy"] > 0
    # The sampler is the initial policy, so pi_old / mu is 1 up to float noise.
    assert metrics["actor/is_weight_mean"] == pytest.approx(1.0, abs=1e-3)


def unused_word(tokenizer: AutoTokenizer, trajectories: list[Trajectory]) -> tuple[str, list[int]]:
    """A one-token word, all of whose banned forms appear nowhere in the trajectories, and those forms' tokens."""
    used = {i for t in trajectories for i in t.input_ids}
    for token in range(len(tokenizer)):
        word = tokenizer.decode([token]).strip()
        forms = bad_word_ids(tokenizer, (word,)) if word.isalnum() else [[-1, -1]]
        if all(len(f) == 1 and f[0] not in used for f in forms):
            return word, [f[0] for f in forms]
    raise AssertionError("every alphanumeric token appears in the trajectories")


def test_a_banned_word_gets_no_gradient_and_keeps_every_compared_value(tmp_path: Path, tiny_model: Path,
                                                                         groups: list[list[Trajectory]]) -> None:
    """The engine samples without the banned words, so the loss trains that distribution: the banned token's
    output row gets no gradient (through the full softmax it gets one from every sampled token), while the loss,
    the ratio and the KL are computed from the raw logprobs the engine recorded, as without the ban."""
    trajs = [t for g in groups for t in g]
    word, banned = unused_word(AutoTokenizer.from_pretrained(tiny_model), trajs)
    learner = torch_learner(tmp_path, tiny_model, f"actor_infer.generating_args.bad_words=[{word}]")
    assert learner.settings.bad_words == tuple((token,) for token in banned)
    tokens = build_token_batch(trajs, compute_advantages(groups, learner.advantages))
    normalizer = float(tokens.response_mask.sum())

    def banned_rows_grad(settings: UpdateSettings) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        learner.strategy.model.zero_grad()
        loss, sums = microbatch_loss(learner.strategy.forward, tokens, settings, normalizer)
        loss.backward()
        grad = learner.strategy.model.get_output_embeddings().weight.grad
        assert grad is not None
        return grad[banned].clone(), {"loss": loss.detach(), **sums}

    with_ban, masked = banned_rows_grad(learner.settings)
    without_ban, full = banned_rows_grad(dataclasses.replace(learner.settings, bad_words=()))
    assert with_ban.abs().sum() == 0 and without_ban.abs().sum() > 0
    for key in ("loss", "pg", "ratio", "approx_kl", "clip"):
        torch.testing.assert_close(masked[key], full[key])
    assert 0 < float(masked["banned_mass"]) / normalizer < 0.01  # a random model: about 1 / vocabulary each

    metrics = learner.train_step(make_batch(groups))
    learner.close()
    assert 0 < metrics["actor/banned_mass"] < 0.01 and np.isfinite(metrics["loss/entropy"])


def test_publish_writes_a_loadable_verified_directory(tmp_path: Path, tiny_model: Path,
                                                      groups: list[list[Trajectory]]) -> None:
    learner = torch_learner(tmp_path, tiny_model)
    learner.train_step(make_batch(groups))
    announced = learner.publish(1)
    path = weights_path_from_uri(announced.uri)
    assert announced.version == 1 and announced.uri.startswith("file://")
    assert path == tmp_path / "out" / "weights" / "v1"
    verify_digest(path, announced.digest)
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for name, value in learner.strategy.model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], value.cpu())
    published, original = AutoTokenizer.from_pretrained(path), AutoTokenizer.from_pretrained(tiny_model)
    assert published.encode("<think>Go</think>") == original.encode("<think>Go</think>")

    # A version left by a run that crashed before announcing it is replaced, not an error.
    learner.train_step(make_batch(groups, 1))
    again = learner.publish(1)
    verify_digest(path, again.digest)
    assert again.digest != announced.digest
    learner.close()


def test_checkpoint_round_trip_resumes_exactly(tmp_path: Path, tiny_model: Path,
                                               groups: list[list[Trajectory]]) -> None:
    """Save after one step; a fresh learner loaded from it takes the next step exactly as the original did, the
    adaptive entropy bonus included (an unreachable target: the coefficient climbs one step per train step)."""
    overrides = ("actor_train.training_args.per_device_train_batch_size=2", "ppo_epochs=2",
                 "actor_train.training_args.warmup_steps=3", "actor_train.training_args.lr_scheduler_type=cosine",
                 "entropy_target=100", "entropy_coef_step=0.001")
    original = torch_learner(tmp_path / "a", tiny_model, *overrides)
    original.train_step(make_batch(groups, 0))
    original.save_checkpoint(tmp_path / "ckpt")
    expected_rng = torch.rand(3)
    torch.manual_seed(12345)  # disturb the global RNG: loading must restore it
    m_next = original.train_step(make_batch(groups, 1))
    p_next = params(original)
    opt_next = original.strategy.optimizer.state_dict()  # type: ignore[attr-defined]
    original.close()

    resumed = torch_learner(tmp_path / "b", tiny_model, *overrides)
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert resumed.steps_done == 1
    assert resumed.strategy.scheduler.last_epoch == 8  # type: ignore[attr-defined]  # 2 epochs x 4 mini-batches
    assert torch.equal(torch.rand(3), expected_rng)
    torch.manual_seed(12345)
    m_resumed = resumed.train_step(make_batch(groups, 1))
    assert m_resumed["loss/pg"] == m_next["loss/pg"] and m_resumed["actor/lr"] == m_next["actor/lr"]
    assert m_resumed["actor/entropy_coef"] == m_next["actor/entropy_coef"] == 0.001
    for name, value in params(resumed).items():
        assert torch.equal(value, p_next[name]), name
    state = resumed.strategy.optimizer.state_dict()  # type: ignore[attr-defined]
    for key, slot in opt_next["state"].items():
        assert torch.equal(state["state"][key]["exp_avg_sq"], slot["exp_avg_sq"])
    resumed.close()


def test_bad_strategy_options_are_refused_when_the_config_loads(tmp_path: Path, tiny_model: Path) -> None:
    # Checked with the config, before any process or model starts (not first inside make_strategy).
    with pytest.raises(ConfigError, match="unknown key 'gpus' for torch_train; valid keys: device"):
        learner_config(tmp_path, tiny_model, "torch_train", "actor_train.strategy_args.strategy_config={gpus: 2}")
    with pytest.raises(ConfigError, match="strategy_config.cpu_threads=0: must be >= 1"):
        learner_config(tmp_path, tiny_model, "torch_train",
                       "actor_train.strategy_args.strategy_config={device: cpu, cpu_threads: 0}")
    with pytest.raises(ConfigError, match="strategy_config.zero_stage=4: must be 1, 2 or 3"):
        learner_config(tmp_path, tiny_model, "deepspeed_train",
                       "actor_train.strategy_args.strategy_config={zero_stage: 4}")
    with pytest.raises(ConfigError, match="early_stop_kl=0.05: deepspeed_train cannot drop"):
        learner_config(tmp_path, tiny_model, "deepspeed_train", "early_stop_kl=0.05")


def test_batches_without_engine_logprobs_are_refused(tmp_path: Path, tiny_model: Path,
                                                     groups: list[list[Trajectory]]) -> None:
    # A policy that records no logprobs leaves 0.0 everywhere; the importance ratio would read it as staleness.
    blank = [[dataclasses.replace(t, logprobs=np.zeros_like(t.logprobs)) for t in g] for g in groups]
    learner = torch_learner(tmp_path, tiny_model)
    with pytest.raises(ValueError, match="engine logprob 0.0"):
        learner.train_step(make_batch(blank))
    learner.close()
