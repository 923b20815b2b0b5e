"""The trainer loop: wait for a batch of complete groups, train, publish the next version, acknowledge.

Step s consumes a batch and publishes version s + 1. The step counter is the published version in Redis,
so a restarted trainer continues where the last committed step left off.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import redis
from tqdm import tqdm

from rollstream.consumer.data.batch_stats import rollout_stats
from rollstream.consumer.data.batcher import Batcher
from rollstream.consumer.learn.checkpoints import checkpoint_dir, checkpoint_step, resume_path
from rollstream.consumer.learn.learner import Learner, make_learner
from rollstream.consumer.metrics import MetricsLogger, PhaseTimer
from rollstream.consumer.pruning import prune_redis_versions, prune_versions
from rollstream.consumer.validation import Validator
from rollstream.shared.codec import encode_trajectory
from rollstream.shared.config import RollstreamConfig
from rollstream.shared.keys import Keys
from rollstream.shared.ledger import Ledger, reconciles
from rollstream.shared.messages import WeightsAnnouncement
from rollstream.shared.recording import Recorder
from rollstream.shared.status import loaded_versions
from rollstream.shared.weights_transport import share_weights

log = logging.getLogger(__name__)


@dataclass
class TrainSummary:
    steps_done: int
    last_version: int
    counters: dict[str, int]
    plot: str | None
    history: dict[str, list[tuple[int, float]]]
    """Every logged metric as (step, value) pairs."""


def run_trainer(cfg: RollstreamConfig, client: redis.Redis, *, consumer: str = "trainer-0",
                stop: threading.Event | None = None, learner: Learner | None = None,
                progress: bool = True) -> TrainSummary:
    stop = stop or threading.Event()
    batcher = Batcher(client, cfg, consumer)
    learner = learner or make_learner(cfg)
    metrics = MetricsLogger(cfg)
    recorder = Recorder(cfg.record_to) if cfg.record_to else None
    validator = Validator(client, cfg, consumer, stop) if cfg.eval_steps else None
    start = batcher.ledger.version()
    _reopen_if_extended(cfg, batcher.ledger, start)
    resume(cfg, learner, batcher.ledger, start)
    bar = tqdm(total=cfg.max_steps, initial=start, desc="train", unit="step", disable=not progress,
               dynamic_ncols=True)
    try:
        for step in range(start, cfg.max_steps):
            val_round = None
            if validator and cfg.validates_before(step) and not stop.is_set():
                val_round = validator.start(step, version=step)
            batch, waiting = None, time.monotonic()
            while batch is None and not stop.is_set():  # the wait is every round of this loop, not the last
                batcher.ledger.expect_version(step)  # each second: Redis may have lost steps while we wait
                batch = batcher.next_batch(step, timeout_s=1.0)
            if batch is None:
                break
            wait_s = time.monotonic() - waiting
            timer = PhaseTimer()
            stats = learner.train_step(batch)
            timer.lap("train")
            if val_round is not None:  # the round is played by this step's version: publish the next one only after it
                if val_stats := val_round.result():
                    metrics.log(step, val_stats)
                timer.lap("val_wait")
            announcement = publish(cfg, client, batcher.keys, learner, step + 1)
            timer.lap("publish")
            batcher.commit(batch, announcement)
            timer.lap("commit")
            if (step + 1) % cfg.save_steps == 0 or step + 1 == cfg.max_steps:
                learner.save_checkpoint(checkpoint_dir(cfg, step + 1))  # after the commit: ledger and model agree
            timer.lap("checkpoint")
            loaded = loaded_versions(client, batcher.keys)
            prune_versions(Path(cfg.output_dir) / "weights", loaded, step + 1)
            if cfg.weights_transport == "redis":
                prune_redis_versions(client, batcher.keys, loaded, step + 1)
            timer.lap("prune")
            if recorder:  # the batch in one write: a kill -9 between entries would record part of a group
                recorder.write_all([encode_trajectory(traj) for traj in batch.trajectories])
            counts = batcher.ledger.counters()
            stats |= rollout_stats(batch.trajectories, step, cfg.async_generation_ratio)
            stats |= {"time/wait_s": wait_s} | timer.seconds()
            stats |= {f"groups/{k}": float(v) for k, v in counts.items()}
            stats |= {f"groups/step_{k}": float(v) for k, v in batch.dropped.items()}
            if not reconciles(counts):
                log.error("group counters do not reconcile after step %d: %s", step, counts)
            metrics.log(step, stats, console=(step + 1) % cfg.logging_steps == 0)
            bar.update()
            bar.set_postfix(success=f"{stats.get('rollout/success', 0):.2f}",
                            held_out=f"{metrics.latest('val/success') or 0:.2f}", wait=f"{wait_s:.1f}s")
        if validator and not stop.is_set() and batcher.ledger.version() == cfg.max_steps > start:
            if val_stats := validator.run(cfg.max_steps, version=cfg.max_steps):
                metrics.log(cfg.max_steps, val_stats)
        if not stop.is_set() and batcher.ledger.version() >= cfg.max_steps:
            finish_experiment(batcher, cfg.max_steps)
    finally:
        bar.close()
        if validator:
            validator.close()
        if recorder:
            recorder.close()
        learner.close()
        plot = metrics.close()
    done = batcher.ledger.version()
    return TrainSummary(done - start, done, batcher.ledger.counters(), str(plot) if plot else None,
                        dict(metrics.history))


def finish_experiment(batcher: Batcher, version: int) -> None:
    """Tell every env-worker the run is over: they return their slots and exit 0, and none admits again.

    Groups still in flight end as unused_at_end; the entries of theirs this trainer holds are acknowledged."""
    unused = batcher.ledger.finish_experiment(version)
    held = batcher.assembler.drain()
    batcher.ledger.ack_orphans(held)
    log.info("experiment finished at version %d: %d groups in flight ended unused, env-workers told to exit",
             version, unused)


def _reopen_if_extended(cfg: RollstreamConfig, ledger: Ledger, version: int) -> None:
    finished = ledger.finished()
    if finished is not None and version < cfg.max_steps:
        log.warning("experiment %r was finished at version %d; continuing it to max_steps=%d (restart the "
                    "env-workers: they exited at the end)", cfg.exp_name, finished, cfg.max_steps)
        ledger.reopen()


def publish(cfg: RollstreamConfig, client: redis.Redis, keys: Keys, learner: Learner, version: int,
            suffix: str = "") -> WeightsAnnouncement:
    """Write the learner's weights as `version` and make them reachable over the configured transport;
    returns what to announce. The version is announced only by the step's commit, after all of this."""
    announcement = learner.publish(version, suffix)
    if cfg.weights_transport == "redis":
        announcement = share_weights(client, keys, announcement, int(cfg.weights_chunk_mb * 2**20))
    return announcement


def resume(cfg: RollstreamConfig, learner: Learner, ledger: Ledger, version: int) -> None:
    """Load the checkpoint resume_from_checkpoint names and re-announce its weights under the ledger's version.

    The ledger in Redis is the truth about data: groups it counts as trained were acknowledged and are never
    trained again. A checkpoint older than the ledger (the trainer died between save_steps) therefore loses
    the steps in between from the model, not from the count; the weights announced next are the model's.
    """
    path = resume_path(cfg)
    if path is None:
        if cfg.resume_from_checkpoint and version:
            log.warning("resume_from_checkpoint is set but there is no checkpoint: continuing at version %d "
                        "from %s", version, cfg.pretrain)
        return
    step = checkpoint_step(path)
    if step > version:
        raise RuntimeError(f"checkpoint {path} is at step {step} but the ledger in Redis is at version {version}: "
                           "Redis lost committed steps (was it restarted without its AOF?)")
    learner.load_checkpoint(path)
    if step < version:
        log.warning("resuming from %s: the model misses steps %d..%d (their groups were trained and acknowledged, "
                    "so they are not trained again); lower save_steps to lose less", path, step + 1, version)
        ledger.announce(publish(cfg, ledger.client, ledger.keys, learner, version, f"-resumed-from-{step}"))
    log.info("resumed from %s at version %d", path, version)
