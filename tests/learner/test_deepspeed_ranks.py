"""DeepSpeed on two ranks (two spawned CPU processes over gloo): rank 0 plans and scatters the update, both train
their shard, and the result is the one-process step on the whole batch; publication writes one directory."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from rollstream.consumer.learn.learner import make_learner
from rollstream.consumer.learn.policy_learner import UpdateSettings, plan_update
from rollstream.consumer.learn.tensors import build_token_batch
from rollstream.shared.config import RollstreamConfig
from rollstream.shared.schema import Trajectory
from rollstream.shared.weights_io import load_safetensors_dir

from .helpers import (
    TinySampler,
    draw_until_mixed,
    even_first_token,
    learner_config,
    make_batch,
    sample_single_turn_groups,
    sample_two_turn_group,
)
from .ranks import RESUME, SAVE, STEP, run_ranks

pytestmark = [
    # As in test_deepspeed (the one-process reference runs here): DeepSpeed's import-time torch.compile and
    # ZeRO-3's deprecated all_gather_into_tensor / reduce_scatter_tensor.
    pytest.mark.filterwarnings(r"ignore:`torch\.jit\.script_method` is deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings(
        r"ignore:`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated:FutureWarning"),
]

# Mini-batches of 4 rows: 2 ranks x per_device_train_batch_size 2, against 1 process x 2 x 2 accumulation steps;
# two epochs give a shard rows from different mini-batches. The token budget per micro-batch is chosen from the
# sampled rows' lengths (`common` below) so that the ranks' micro-batch counts differ.
BASE = ("actor_train.training_args.weight_decay=0.01", "actor_train.training_args.max_grad_norm=0.5",
        "actor_train.training_args.per_device_train_batch_size=2", "ppo_epochs=2")
# ZeRO-3 also recomputes old logprobs: forwards gather parameters there, so their count is padded too.
STAGES = {2: ("old_logprobs=engine",), 3: ("old_logprobs=recompute",)}


@pytest.fixture(scope="module")
def groups(tiny_model: Path) -> list[list[Trajectory]]:
    # One-turn and two-turn episodes: rows of two lengths, so shards balanced by tokens differ in rows.
    sampler = TinySampler(tiny_model, seed=5)
    return draw_until_mixed(lambda: [
        *sample_single_turn_groups(sampler, 1, 4, even_first_token),
        sample_two_turn_group(sampler, 1, 4, ["Turn 2\nState:\n_P\n_G", "Turn 2\nState:\n__\nPG"],
                              even_first_token)])


@pytest.fixture(scope="module")
def common(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path,
           groups: list[list[Trajectory]]) -> tuple[str, ...]:
    """BASE with a seed (the mini-batch shuffle) and a token budget under which the ranks' plans differ in
    length, so the runs below exercise zero-weight micro-batches and padded logprob forwards (ZeRO reduces in
    backward and, at stage 3, gathers in forward: a rank that ran fewer would hang the others). Found by trying
    them: row lengths depend on the tokenizer the env corpus trained."""
    trajs = [t for g in groups for t in g]
    tokens = build_token_batch(trajs, [1.0] * len(trajs))  # every row trained: none is skipped for zero advantage
    lengths = tokens.lengths.tolist()
    tmp = tmp_path_factory.mktemp("budget")
    for seed, budget in itertools.product(range(10), range(max(lengths), 3 * max(lengths))):
        overrides = (*BASE, f"seed={seed}", f"actor_train.training_args.max_tokens_per_microbatch={budget}")
        cfg = one_process_config(tmp, tiny_model, overrides, 2)
        shards = plan_update(tokens, UpdateSettings.from_config(cfg), torch.Generator().manual_seed(seed), 2)
        if (any(len(step.microbatches) < step.num_microbatches for shard in shards for step in shard.steps)
                and any(len(shard.logprob_microbatches) < shard.num_logprob_microbatches for shard in shards)):
            return overrides
    raise AssertionError(f"no seed and token budget make the 2-rank plan pad for rows of lengths {lengths}")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, groups: list[list[Trajectory]],
              common: tuple[str, ...]) -> tuple[Path, dict[str, dict[str, float]]]:
    """One 2-rank session (the imports and the process group are the slow part) running a step per ZeRO stage."""
    root = tmp_path_factory.mktemp("ranks")
    runs = [(f"zero{stage}", two_rank_overrides(common, stage), STEP) for stage in STAGES]
    # A checkpoint written by both ranks and read back by both: ZeRO-2 (each rank holds half the optimizer state).
    runs += [("saved", two_rank_overrides(common, 2), SAVE),
             ("resumed", two_rank_overrides(common, 2), f"{RESUME}:saved")]
    return root, run_ranks(2, root, tiny_model, groups, runs)


def two_rank_overrides(common: tuple[str, ...], stage: int) -> tuple[str, ...]:
    """The config of one_process_config on two ranks: half the accumulation per rank, the same mini-batches."""
    return (*common, *STAGES[stage], "actor_train.training_args.gradient_accumulation_steps=1",
            f"actor_train.strategy_args.strategy_config={{zero_stage: {stage}}}")


def one_process_config(tmp: Path, model: Path, common: tuple[str, ...], stage: int) -> RollstreamConfig:
    return learner_config(tmp, model, "deepspeed_train", *common, *STAGES[stage],
                          "actor_train.training_args.gradient_accumulation_steps=2",
                          f"actor_train.strategy_args.strategy_config={{zero_stage: {stage}}}")


def one_process(tmp: Path, tiny_model: Path, groups: list[list[Trajectory]], common: tuple[str, ...],
                stage: int) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """The same step in one process on the whole batch, same ZeRO stage. (Against torch_train ZeRO-3 differs by
    up to 3e-5 after these 4 steps, in one process as in two: its own rounding, which would hide a rank's.)"""
    learner = make_learner(one_process_config(tmp, tiny_model, common, stage))
    try:
        metrics = learner.train_step(make_batch(groups))
        learner.publish(1)
    finally:
        learner.close()
    return metrics, load_safetensors_dir(tmp / "out" / "weights" / "v1")


@pytest.mark.parametrize("stage", STAGES)
def test_two_rank_step_equals_one_process_step(tmp_path: Path, two_ranks: tuple[Path, dict[str, dict[str, float]]],
                                               tiny_model: Path, groups: list[list[Trajectory]],
                                               common: tuple[str, ...], stage: int) -> None:
    root, metrics = two_ranks
    m_one, w_one = one_process(tmp_path, tiny_model, groups, common, stage)
    m_two = metrics[f"zero{stage}"]
    assert m_two["actor/optimizer_steps"] == m_one["actor/optimizer_steps"] == 4
    # grad_norm also catches a gradient off by a constant factor, to which Adam's update is nearly blind.
    for key in ("loss/pg", "loss/entropy", "actor/clip_frac", "actor/ratio_mean", "actor/approx_kl",
                "actor/grad_norm", "actor/lr"):
        assert m_two[key] == pytest.approx(m_one[key], rel=1e-4, abs=1e-6), key
    w_two = load_safetensors_dir(root / f"zero{stage}" / "out" / "weights" / "v1")
    assert set(w_two) == set(w_one)
    # Adam's early steps are about lr x g / (|g| + eps), so float noise in gradients near eps (summation order
    # differs between one process and two ranks) moves a few weights by ~1e-5: one of 16k by 2.1e-5 on one
    # machine. The same tolerance as test_micro_batching_does_not_change_the_update.
    for name, value in w_one.items():
        torch.testing.assert_close(w_two[name], value, rtol=1e-4, atol=5e-5, msg=name)
    # The step moved the weights well beyond that tolerance, so the comparison says something.
    initial = load_safetensors_dir(tiny_model)
    assert max(float((w_one[n] - initial[n]).abs().max()) for n in w_one) > 1e-3


@pytest.mark.parametrize("stage", STAGES)
def test_two_ranks_publish_one_directory(two_ranks: tuple[Path, dict[str, dict[str, float]]], stage: int) -> None:
    root, metrics = two_ranks
    weights = root / f"zero{stage}" / "out" / "weights"
    # Only rank 0 wrote: one version directory, no temporary leftovers from a second writer.
    assert sorted(p.name for p in weights.iterdir()) == ["v1"]
    published = weights / "v1"
    assert (published / "config.json").exists() and (published / "tokenizer.json").exists()
    assert metrics[f"zero{stage}"]["publish/digest"]


def test_two_ranks_resume_from_their_checkpoint(two_ranks: tuple[Path, dict[str, dict[str, float]]]) -> None:
    """Save after step 1, train step 2; resume in fresh processes, train step 2 again: the same weights, so every
    rank restored its optimizer partition (a rank that restarted its Adam moments from zero would differ)."""
    root, metrics = two_ranks
    assert (root / "saved" / "checkpoint").is_dir()
    saved = load_safetensors_dir(root / "saved" / "out" / "weights" / "v2")
    resumed = load_safetensors_dir(root / "resumed" / "out" / "weights" / "v2")
    for name, value in saved.items():
        torch.testing.assert_close(resumed[name], value, rtol=0, atol=1e-6, msg=name)
    assert metrics["resumed"]["loss/pg"] == pytest.approx(metrics["saved"]["loss/pg"], rel=1e-5, abs=1e-7)
