"""`deepspeed_train` on several ranks: rank 0 reads the stream and leads, the other ranks follow.

Under a launcher (torchrun, deepspeed) every rank runs `rollstream trainer`, and `start_rank` builds its part.
Rank 0 gets a `LeaderLearner`, which `run_trainer` drives like any learner: it reads the batches, computes the
advantages and the token batch, plans the update (`plan_update`: the mini-batches exactly as one process would
draw them, each split over the ranks by tokens) and sends every rank its shard. Every call that needs all ranks
(a train step, a publication, a checkpoint save or load) is first announced to the followers on a control group.
Ranks > 0 run `Follower.run`: receive a message, do their part of it, until the leader's stop, which it sends
when run_trainer closes its learner: at max_steps, after SIGTERM, or on an error.

A rank that dies is found by rank 0's `RankWatch` (heartbeats in the launcher's store): within
`strategy_config.rank_timeout_s` rank 0 stops with one line that names it and says how to resume, whether it was
inside a collective (which fails once the transport sees the peer gone, or would wait long on a frozen one),
waiting for a batch, or stopping on the launcher's SIGTERM. The launcher stops the remaining ranks.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from rollstream.consumer.learn.checkpoints import strategy_dir
from rollstream.consumer.learn.policy_learner import Adjust, PolicyLearner, UpdateSettings, plan_update, run_shard
from rollstream.consumer.learn.rank_watch import Heartbeat, RankLost, RankWatch
from rollstream.consumer.learn.strategy import launched_world_size, make_strategy
from rollstream.consumer.learn.tensors import TokenBatch
from rollstream.shared.config import ConfigError, RollstreamConfig
from rollstream.shared.config_checks import strategy_options
from rollstream.shared.messages import WeightsAnnouncement

log = logging.getLogger(__name__)

TRAIN, PUBLISH, SAVE, LOAD, STOP = "train", "publish", "save", "load", "stop"

CONTROL_TIMEOUT = timedelta(days=1)
"""How long a follower waits for the leader's next message. The leader may wait long for a batch (producers
slow or down) and that must not break the group; collectives inside a step keep the default timeout."""


class Control:
    """Leader -> followers messages, on a gloo group of their own: objects travel on CPU even when training runs
    over nccl, and the group has the long timeout above."""

    def __init__(self) -> None:
        self.group = torch.distributed.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
        self.rank = torch.distributed.get_rank()
        self.world_size = torch.distributed.get_world_size()

    def scatter(self, messages: list[tuple[Any, ...]]) -> None:
        """Leader: message i to rank i (its own included)."""
        out: list[Any] = [None]
        torch.distributed.scatter_object_list(out, messages, src=0, group=self.group)

    def broadcast(self, message: tuple[Any, ...]) -> None:
        self.scatter([message] * self.world_size)

    def receive(self) -> tuple[Any, ...]:
        """Follower: the leader's next message to this rank."""
        out: list[Any] = [None]
        torch.distributed.scatter_object_list(out, None, src=0, group=self.group)
        return tuple(out[0])

    def barrier(self) -> None:
        torch.distributed.barrier(group=self.group)


class LeaderLearner(PolicyLearner):
    """Rank 0's learner: a PolicyLearner whose every collective call brings the followers along."""

    def __init__(self, cfg: RollstreamConfig, control: Control, watch: RankWatch) -> None:
        super().__init__(cfg, make_strategy(cfg))
        self.control = control
        self.watch = watch
        self.stopped = False

    @contextlib.contextmanager
    def _with_followers(self) -> Iterator[None]:
        """A call that needs every rank: if it fails because a rank is gone, say which (RankLost)."""
        try:
            yield
        except RankLost:
            raise
        except Exception as e:
            self.watch.check(e)
            raise

    def update(self, tokens: TokenBatch, settings: UpdateSettings, adjust: Adjust | None = None) -> dict[str, float]:
        if adjust is not None:
            raise ValueError("an update is taken apart in one process (benchmarks/replay_update.py), not over ranks")
        shards = plan_update(tokens, settings, self.generator, self.control.world_size)
        with self._with_followers():
            # The settings travel with each shard: the adaptive entropy bonus changes them step by step.
            self.control.scatter([(TRAIN, shard, settings) for shard in shards])
            return run_shard(self.strategy, shards[0], settings, self.reference)

    def publish(self, version: int, suffix: str = "") -> WeightsAnnouncement:
        with self._with_followers():
            self.control.broadcast((PUBLISH,))
            return super().publish(version, suffix)

    def save_strategy(self, directory: Path) -> None:
        # Every rank writes its ZeRO partition into the same (temporary) directory; the leader renames it only
        # after all of them are done.
        with self._with_followers():
            self.control.broadcast((SAVE, str(directory)))
            super().save_strategy(directory)
            self.control.barrier()

    def load_checkpoint(self, directory: str | os.PathLike[str]) -> None:
        with self._with_followers():
            self.control.broadcast((LOAD, str(strategy_dir(directory))))
            super().load_checkpoint(directory)

    def close(self) -> None:
        """Stop the followers, then close; once (run_trainer closes on every exit, errors included, and so does
        the trainer command in case run_trainer never started). If a follower is gone (the launcher's SIGTERM
        after a rank died ends the loop like an operator's stop would), raise RankLost instead of ending well."""
        if self.stopped:
            return
        self.stopped = True
        try:
            if self.watch.lost is None:
                with self._with_followers():
                    self.watch.check(resume=False)  # every follower beat since: none is gone, the stop can go out
                    self.control.broadcast((STOP,))
        finally:
            super().close()


class Follower:
    """A rank > 0: the same model and update code as the leader, fed by the leader's messages."""

    def __init__(self, cfg: RollstreamConfig, control: Control) -> None:
        self.learner = PolicyLearner(cfg, make_strategy(cfg))
        self.control = control

    def run(self) -> None:
        """Serve the leader's messages until its stop."""
        learner, strategy = self.learner, self.learner.strategy
        try:
            while True:
                kind, *args = self.control.receive()
                if kind == STOP:
                    return
                if kind == TRAIN:
                    shard, settings = args
                    run_shard(strategy, shard, settings, learner.reference)
                    learner.steps_done += 1
                elif kind == PUBLISH:
                    strategy.publish_weights(learner.weights_dir, learner.tokenizer)  # rank 0 alone writes
                elif kind == SAVE:
                    strategy.save_checkpoint(Path(args[0]))
                    self.control.barrier()
                elif kind == LOAD:
                    strategy.load_checkpoint(Path(args[0]))
                else:
                    raise RuntimeError(f"rank {self.control.rank}: unknown message {kind!r} from rank 0")
        finally:
            learner.close()


def start_rank(cfg: RollstreamConfig) -> LeaderLearner | Follower:
    """This process's part of a multi-rank trainer: rank 0 leads (give it to run_trainer), the others follow."""
    name = cfg.actor_train.strategy_args.strategy_name
    if name != "deepspeed_train":
        raise ConfigError(f"WORLD_SIZE={launched_world_size()} (a multi-rank launch) needs "
                          f"actor_train.strategy_args.strategy_name=deepspeed_train, not {name!r}")
    from rollstream.consumer.learn.strategy.deepspeed_strategy import init_distributed

    init_distributed()
    control = Control()  # every rank creates it at the same point, before the engine's own groups
    timeout_s = strategy_options(cfg.actor_train.strategy_args, "actor_train").rank_timeout_s
    if control.rank == 0:
        return LeaderLearner(cfg, control, RankWatch(control.world_size, timeout_s))
    Heartbeat(control.rank, timeout_s)  # before the model loads: rank 0 watches from now on
    return Follower(cfg, control)


def end_rank() -> None:
    """Destroy this process's torch.distributed group before it exits, once its learner is closed. Left to
    interpreter teardown, a multi-rank gloo group's threads can abort the process ("terminate called without an
    active exception", exit -6) after all its work was done."""
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
