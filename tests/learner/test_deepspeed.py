"""The DeepSpeed strategy in one process on CPU: same step as the torch strategy, and an exact resume."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollstream.consumer.learn.learner import make_learner
from rollstream.consumer.learn.policy_learner import PolicyLearner
from rollstream.shared.schema import Trajectory
from rollstream.shared.weights_io import load_safetensors_dir, weights_path_from_uri

from .helpers import (
    TinySampler,
    draw_until_mixed,
    even_first_token,
    learner_config,
    make_batch,
    sample_single_turn_groups,
)

pytestmark = [
    # DeepSpeed's engine imports its Muon optimizer module, which applies torch.compile at import time; that
    # imports torch._inductor and with it torch.utils.mkldnn, whose classes still use the deprecated
    # torch.jit.script_method. Nothing here calls it; the warning fires once per process, inside whichever
    # test first builds an engine.
    pytest.mark.filterwarnings(r"ignore:`torch\.jit\.script_method` is deprecated:DeprecationWarning"),
]


@pytest.fixture(scope="module")
def groups(tiny_model: Path) -> list[list[Trajectory]]:
    sampler = TinySampler(tiny_model, seed=5)
    return draw_until_mixed(lambda: sample_single_turn_groups(sampler, 2, 4, even_first_token))


def learner(tmp_path: Path, model: Path, strategy: str, *overrides: str) -> PolicyLearner:
    built = make_learner(learner_config(tmp_path, model, strategy,
                                        "actor_train.training_args.per_device_train_batch_size=2",
                                        "actor_train.training_args.gradient_accumulation_steps=2",
                                        "actor_train.training_args.weight_decay=0.01",
                                        "actor_train.training_args.max_grad_norm=0.5", *overrides))
    assert isinstance(built, PolicyLearner)
    return built


def one_step(tmp_path: Path, model: Path, strategy: str, groups: list[list[Trajectory]],
             *overrides: str) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """Metrics of one train step and the weights it publishes (gathered from ZeRO-3 partitions too)."""
    trained = learner(tmp_path, model, strategy, *overrides)
    try:
        metrics = trained.train_step(make_batch(groups))
        published = weights_path_from_uri(trained.publish(1).uri)
        return metrics, load_safetensors_dir(published)
    finally:
        trained.close()


@pytest.mark.parametrize("zero_stage", [
    1,
    2,
    # ZeRO-3 gathers parameters and reduce-scatters gradients with torch.distributed.all_gather_into_tensor and
    # reduce_scatter_tensor, which torch 2.13 deprecates (for all_gather_single / reduce_scatter_single);
    # DeepSpeed 0.19.8 has not moved yet.
    pytest.param(3, marks=pytest.mark.filterwarnings(
        r"ignore:`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated:FutureWarning")),
])
def test_deepspeed_step_equals_torch_step(tmp_path: Path, tiny_model: Path, groups: list[list[Trajectory]],
                                          zero_stage: int) -> None:
    m_torch, w_torch = one_step(tmp_path / "torch", tiny_model, "torch_train", groups)
    m_ds, w_ds = one_step(tmp_path / "ds", tiny_model, "deepspeed_train", groups,
                          f"actor_train.strategy_args.strategy_config={{zero_stage: {zero_stage}}}")
    for key in ("loss/pg", "loss/entropy", "actor/clip_frac", "actor/ratio_mean", "actor/grad_norm", "actor/lr"):
        assert m_ds[key] == pytest.approx(m_torch[key], rel=1e-4, abs=1e-6), key
    assert m_ds["actor/optimizer_steps"] == m_torch["actor/optimizer_steps"] == 2
    assert set(w_ds) == set(w_torch)
    for name, value in w_torch.items():
        torch.testing.assert_close(w_ds[name], value, rtol=1e-4, atol=2e-5, msg=name)


def test_deepspeed_checkpoint_round_trip(tmp_path: Path, tiny_model: Path, groups: list[list[Trajectory]]) -> None:
    overrides = ("actor_train.training_args.warmup_steps=2", "actor_train.training_args.lr_scheduler_type=linear")
    original = learner(tmp_path / "a", tiny_model, "deepspeed_train", *overrides)
    try:
        original.train_step(make_batch(groups, 0))
        original.save_checkpoint(tmp_path / "ckpt")
        m_next = original.train_step(make_batch(groups, 1))
        p_next = {k: v.clone() for k, v in original.strategy.model.state_dict().items()}
    finally:
        original.close()

    resumed = learner(tmp_path / "b", tiny_model, "deepspeed_train", *overrides)
    try:
        resumed.load_checkpoint(tmp_path / "ckpt")
        assert resumed.steps_done == 1
        assert resumed.strategy.scheduler.last_epoch == 2  # type: ignore[attr-defined]
        m_resumed = resumed.train_step(make_batch(groups, 1))
        assert m_resumed["loss/pg"] == m_next["loss/pg"] and m_resumed["actor/lr"] == m_next["actor/lr"]
        for name, value in resumed.strategy.model.state_dict().items():
            assert torch.equal(value, p_next[name]), name
    finally:
        resumed.close()


@pytest.mark.parametrize("strategy", ["torch_train", "deepspeed_train"])
def test_a_bf16_run_publishes_bf16_weights_that_load(tmp_path: Path, tiny_model: Path,
                                                      groups: list[list[Trajectory]], strategy: str) -> None:
    trained = learner(tmp_path, tiny_model, strategy, "actor_train.model_args.dtype=bf16")
    try:
        trained.train_step(make_batch(groups))
        published = weights_path_from_uri(trained.publish(1).uri)
        master = {k: v.detach().clone() for k, v in trained.strategy.model.state_dict().items()}
    finally:
        trained.close()
    weights = load_safetensors_dir(published)
    assert weights and all(w.dtype == torch.bfloat16 for w in weights.values())
    for name, value in weights.items():  # the trained weights, rounded once to bf16
        assert torch.equal(value, master[name].to(torch.bfloat16)), name
    reloaded = AutoModelForCausalLM.from_pretrained(published, dtype=torch.float32)
    tied = reloaded.get_output_embeddings().weight
    assert tied.data_ptr() == reloaded.get_input_embeddings().weight.data_ptr()  # still one tensor, two names
    assert torch.equal(tied, master["model.embed_tokens.weight"].to(torch.bfloat16).float())
