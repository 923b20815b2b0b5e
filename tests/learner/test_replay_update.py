"""benchmarks/replay_update.py: a run's updates replayed from a checkpoint and its recorded batches are the run's
own, bit for bit (and a record that is not refuses to pass); an update taken apart trains each variant from the
same state and leaves the learner as it found it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from rollstream.consumer.data.batcher import Batch
from rollstream.consumer.learn.checkpoints import checkpoint_dir
from rollstream.consumer.learn.learner import make_learner
from rollstream.consumer.learn.policy_learner import PolicyLearner
from rollstream.shared.codec import encode_trajectory
from rollstream.shared.config import RollstreamConfig
from rollstream.shared.recording import Recorder
from rollstream.shared.schema import Trajectory
from tests.benchmark_modules import load_benchmark

from .helpers import learner_config, make_batch
from .test_move_share import won_alike
from .test_no_effect_moves import walk

replay_update = load_benchmark("replay_update")


def into_walls(tokenizer: AutoTokenizer, walls: int) -> list[Trajectory]:
    """A group that lost alike, each member first walking into `walls` walls: the no-effect term blames them."""
    return [walk(tokenizer, m, ["P_\n_G"] * walls + ["_P\n_G"]) for m in range(4)]


def config(tmp_path: Path, tiny_model: Path) -> RollstreamConfig:
    return learner_config(tmp_path, tiny_model, "torch_train", "no_effect_unlikelihood_coef=1.0",
                          "move_unlikelihood_among_moves=true", f"record_to={tmp_path / 'batches.msgpack'}")


def learner_of(cfg: RollstreamConfig) -> PolicyLearner:
    learner = make_learner(cfg)
    assert isinstance(learner, PolicyLearner)
    return learner


def weights(learner: PolicyLearner) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in learner.strategy.model.state_dict().items()}


def train_and_record(cfg: RollstreamConfig, batches: list[Batch], recorded: list[Batch]) -> dict[str, torch.Tensor]:
    """Train `batches` as the trainer does, checkpointing after steps 1 and 3; record `recorded` in their place."""
    learner = learner_of(cfg)
    with Recorder(str(cfg.record_to)) as recorder:
        for step, (batch, record) in enumerate(zip(batches, recorded, strict=True)):
            learner.train_step(batch)
            if step + 1 in (1, 3):
                learner.save_checkpoint(checkpoint_dir(cfg, step + 1))
            recorder.write_all([encode_trajectory(t) for t in record.trajectories])
    trained = weights(learner)
    learner.close()
    return trained


def test_a_replay_from_a_checkpoint_is_the_run_bit_for_bit(tmp_path: Path, tiny_model: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    cfg = config(tmp_path, tiny_model)
    batches = [make_batch([into_walls(tokenizer, 1 + step % 2), won_alike(tokenizer)], step) for step in range(3)]
    trained = train_and_record(cfg, batches, batches)

    recorded = replay_update.recorded_batches(Path(str(cfg.record_to)), cfg.rollout_batch_size, 4)
    assert [len(b.groups) for b in recorded] == [2, 2, 2]
    learner = learner_of(cfg)
    assert replay_update.replay(learner, cfg, recorded, 1, 3) == 1  # checked against step 3's checkpoint
    assert all(torch.equal(trained[k], v) for k, v in weights(learner).items())
    learner.close()


def test_a_record_that_is_not_the_run_fails_the_replay(tmp_path: Path, tiny_model: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    cfg = config(tmp_path, tiny_model)
    batches = [make_batch([into_walls(tokenizer, 1), won_alike(tokenizer)], step) for step in range(3)]
    other = make_batch([into_walls(tokenizer, 2), won_alike(tokenizer)], 1)
    train_and_record(cfg, batches, [batches[0], other, batches[2]])

    recorded = replay_update.recorded_batches(Path(str(cfg.record_to)), cfg.rollout_batch_size, 4)
    with pytest.raises(SystemExit, match="the replay of step 2 differs"):
        replay_update.replay(learner_of(cfg), cfg, recorded, 1, 3)


def test_an_update_taken_apart_names_the_term_that_moved_the_policy(tmp_path: Path, tiny_model: Path) -> None:
    """Two groups each alike (no advantage) and walls blamed: the no-effect term is the update's one gradient, so
    without it, and with the momentum alone on a fresh optimizer, nothing moves; as run, the action tokens' mass
    moves. The learner is as it was after."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    learner = learner_of(config(tmp_path, tiny_model))
    batch = make_batch([into_walls(tokenizer, 2), won_alike(tokenizer)], 0)
    probe = replay_update.Probe.of(learner, batch)
    assert probe.actions == 4 * 3 + 4 * 2 and not probe.breaks
    before = weights(learner)
    variants = {v.name: v for v in replay_update.VARIANTS}
    rows = dict(replay_update.take_apart(learner, [batch], probe, tuple(
        variants[name] for name in ("as run", "without the no-effect term", "the momentum alone"))))

    assert rows["without the no-effect term"] == rows["before the update"]
    assert rows["the momentum alone"] == rows["before the update"]
    assert rows["as run"]["leak mean"] != rows["before the update"]["leak mean"]
    # every reply chose Right: the mass off it counts the other moves too, a leak into them as into the format
    assert len(probe.spelled) == 1
    assert all(row["unspelled mean"] > row["leak mean"] for row in rows.values())
    assert all(torch.equal(before[k], v) for k, v in weights(learner).items())
    learner.train_step(batch)  # the state take_apart restored trains as a fresh learner would
    fresh = learner_of(config(tmp_path / "fresh", tiny_model))
    fresh.train_step(batch)
    assert all(torch.equal(weights(fresh)[k], v) for k, v in weights(learner).items())
    learner.close()
    fresh.close()
