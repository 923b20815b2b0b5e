"""The version cap, provably: a simulation over hundreds of steps for r = 0, 1, 2 against a real Redis.

Scripted policy with random per-reply delays, 4 workers, a trainer whose step sleeps; every step checks
staleness, the backlog bound, r = 0's on-policy guarantee, reconciliation and that validation never mixes in;
validation rounds overlap the training of their step and are still played by one version; the round before
training is optional.
"""

from __future__ import annotations

import threading
import time

import pytest
import redis

from rollstream.consumer.data.batcher import Batch
from rollstream.consumer.train import run_trainer
from rollstream.shared.keys import Keys
from rollstream.shared.ledger import read_counters, reconciles
from rollstream.shared.messages import WeightsAnnouncement
from rollstream.shared.versioning import admission_cap
from tests.conftest import scripted_config
from tests.harness import workers_in_thread

GROUPS_PER_BATCH = 4


class CheckingLearner:
    """Asserts the cap's invariants at every step, then sleeps like a train step would."""

    def __init__(self, client: redis.Redis, keys: Keys, ratio: int, step_s: float) -> None:
        self.client, self.keys, self.ratio, self.step_s = client, keys, ratio, step_s
        self.max_in_flight = 0
        self.mixed_version_trajectories = 0
        self.steps = 0
        self.trained_during_round = 0
        """Steps that began while a validation round was in progress."""

    def train_step(self, batch: Batch) -> dict[str, float]:
        step, r = batch.step, self.ratio
        trajs = batch.trajectories
        assert all(t.mode == "train" for t in trajs), "a val trajectory reached a train batch"
        assert min(t.version for t in trajs) >= step - r, f"step {step}: a group staler than r={r}"
        if r == 0:
            assert {turn.version for t in trajs for turn in t.turns} == {step}, f"step {step}: off-policy at r=0"
        self.mixed_version_trajectories += sum(len({turn.version for turn in t.turns}) > 1 for t in trajs)
        for t in trajs:
            assert t.version == min(turn.version for turn in t.turns)
        counts = read_counters(self.client, self.keys)
        assert reconciles(counts), counts
        assert counts["in_flight"] <= (r + 1) * GROUPS_PER_BATCH, counts
        assert counts["admitted"] - counts.get("returned", 0) <= admission_cap(step, r, GROUPS_PER_BATCH)
        self.max_in_flight = max(self.max_in_flight, counts["in_flight"])
        self.trained_during_round += bool(self.client.exists(self.keys.paused))
        self.steps += 1
        time.sleep(self.step_s)
        return {}

    def publish(self, version: int, suffix: str = "") -> WeightsAnnouncement:
        return WeightsAnnouncement(version)

    def save_checkpoint(self, directory: object) -> None:
        pass

    def load_checkpoint(self, directory: object) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.mark.parametrize("ratio", [0, 1, 2])
def test_version_cap_holds_over_hundreds_of_steps(ratio: int, tmp_path, redis_server, redis_client) -> None:
    steps = 150
    cfg = scripted_config(
        tmp_path, f"exp_name=sim{ratio}", f"async_generation_ratio={ratio}", f"max_steps={steps}",
        "rollout_batch_size=16", "train_env_manager.group_size=4", "train_env_manager.num_env_groups=8",
        "train_env_manager.num_groups_partition=[6,2]", "train_env_manager.max_env_num_per_worker=8",
        "actor_infer.strategy_args.strategy_config.delay_s=0.001", "eval_steps=50",
        "val_env_manager.num_env_groups=6", "val_env_manager.tags=[FrozenLake,SimpleSokoban]",
        "val_env_manager.num_groups_partition=[4,2]", "val_env_manager.max_env_num_per_worker=2",
        "val_sampled_maps=4",
    )
    keys = Keys.for_exp(cfg.exp_name)
    learner = CheckingLearner(redis_client, keys, ratio, step_s=0.01)
    with workers_in_thread(cfg, redis_server.url):
        summary = run_trainer(cfg, redis_client, learner=learner, progress=False)
    assert summary.last_version == steps and learner.steps == steps
    counts = read_counters(redis_client, keys)
    assert reconciles(counts)
    assert counts["trained"] == steps * GROUPS_PER_BATCH
    if ratio == 0:
        assert counts.get("stale_dropped", 0) == 0  # synchronous: nothing is ever generated ahead
    if ratio == 2:
        assert learner.max_in_flight > GROUPS_PER_BATCH  # generation really ran ahead of training
        assert learner.mixed_version_trajectories > 0  # weights changed mid-episode, turns say so
    # Every round complete: 6 held-out maps, each played greedily, the first 4 (val_sampled_maps) once sampled too.
    assert summary.history["val/episodes"] == [(s, 10.0) for s in (0, 50, 100, 150)]
    assert summary.history["val/missing"] == [(s, 0.0) for s in (0, 50, 100, 150)]
    # Rounds at steps 50 and 100 begin with the step's batch generated ahead (r > 0), so the step trains while
    # the round is played; the round's episodes still all come from the step's version.
    assert summary.history["val/off_version"] == [(s, 0.0) for s in (0, 50, 100, 150)]
    if ratio > 0:
        assert learner.trained_during_round > 0
    assert len(summary.history["val/FrozenLake/success"]) == len(summary.history["val/SimpleSokoban/success"]) == 4
    assert len(summary.history["val_sampled/success"]) == 4  # the first 4 maps, all FrozenLake: not split by tag
    assert redis_client.xlen(keys.val) == 0 and not redis_client.exists(keys.paused)


class StoppingLearner(CheckingLearner):
    """Stops the trainer (as SIGTERM does) from inside the step that a validation round overlaps."""

    def __init__(self, client: redis.Redis, keys: Keys, stop: threading.Event, at_step: int) -> None:
        super().__init__(client, keys, ratio=1, step_s=0.0)
        self.stop, self.at_step = stop, at_step
        self.round_in_progress = False

    def train_step(self, batch: Batch) -> dict[str, float]:
        if batch.step == self.at_step:
            self.round_in_progress = bool(self.client.exists(self.keys.paused))
            self.stop.set()
        return super().train_step(batch)


def test_a_stop_during_an_overlapped_round_ends_it(tmp_path, redis_server, redis_client) -> None:
    # Slow replies, so the round at step 4 is still being played when its step trains. The stop ends the round's
    # collection and lifts the pause; the step in hand commits (as any step does that a stop comes during), and
    # the part of the round played is not logged as the round.
    cfg = scripted_config(
        tmp_path, "exp_name=stopround", "max_steps=20", "eval_steps=4", "rollout_batch_size=16",
        "train_env_manager.group_size=4", "train_env_manager.num_env_groups=8",
        "train_env_manager.num_groups_partition=[6,2]", "train_env_manager.max_env_num_per_worker=8",
        "actor_infer.strategy_args.strategy_config.delay_s=0.05", "val_env_manager.num_env_groups=8",
        "val_env_manager.tags=[FrozenLake]", "val_env_manager.max_env_num_per_worker=2", "group_timeout_s=120",
    )
    keys = Keys.for_exp(cfg.exp_name)
    stop = threading.Event()
    learner = StoppingLearner(redis_client, keys, stop, at_step=4)
    with workers_in_thread(cfg, redis_server.url):
        started = time.monotonic()
        summary = run_trainer(cfg, redis_client, learner=learner, stop=stop, progress=False)
        stopped_in = time.monotonic() - started
    assert learner.round_in_progress, "the round at step 4 had ended before its step trained: slow the replies"
    assert summary.last_version == 5
    assert not redis_client.exists(keys.paused)
    assert [s for s, _ in summary.history["val/episodes"]] == [0]  # the round at step 4 was abandoned
    assert stopped_in < 60  # the round's collection did not wait out group_timeout_s


def test_without_the_round_before_training_the_first_round_is_at_eval_steps(tmp_path, redis_server,
                                                                           redis_client) -> None:
    cfg = scripted_config(
        tmp_path, "exp_name=nostartround", "max_steps=8", "eval_steps=4", "val_before_train=false",
        "rollout_batch_size=16", "train_env_manager.group_size=4", "train_env_manager.num_env_groups=8",
        "train_env_manager.num_groups_partition=[6,2]", "train_env_manager.max_env_num_per_worker=8",
        "actor_infer.strategy_args.strategy_config.delay_s=0.001", "val_env_manager.num_env_groups=4",
        "val_env_manager.tags=[FrozenLake]", "val_env_manager.max_env_num_per_worker=2",
    )
    keys = Keys.for_exp(cfg.exp_name)
    learner = CheckingLearner(redis_client, keys, ratio=1, step_s=0.0)
    with workers_in_thread(cfg, redis_server.url):
        summary = run_trainer(cfg, redis_client, learner=learner, progress=False)
    assert summary.last_version == 8
    assert [s for s, _ in summary.history["val/episodes"]] == [4, 8]  # no round at step 0; the last still runs
