"""What a train step does with a batch. The GRPO/PPO learners plug in behind this interface."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from rollstream.consumer.data.batcher import Batch
from rollstream.shared.config import RollstreamConfig
from rollstream.shared.messages import WeightsAnnouncement


class Learner(Protocol):
    def train_step(self, batch: Batch) -> dict[str, float]:
        """Update the policy on one batch; returns metrics namespaced like `loss/pg`."""
        ...

    def publish(self, version: int, suffix: str = "") -> WeightsAnnouncement:
        """Write the weights of `version` where producers can load them; returns what to announce.
        `suffix` names a re-publication of an already announced version (after a resume)."""
        ...

    def save_checkpoint(self, directory: Path) -> None:
        """Everything needed to continue training exactly: model, optimizer, schedule, RNG."""
        ...

    def load_checkpoint(self, directory: Path) -> None: ...

    def close(self) -> None: ...


class StatsOnlyLearner:
    """`actor_train.strategy_args.strategy_name: stats_only`: no model, a step only measures its batch.

    For exercising the pipeline (and the scripted policy) without a model; versions still advance, so the
    version cap and the staleness filter behave exactly as with a real learner.
    """

    def train_step(self, batch: Batch) -> dict[str, float]:
        return {}

    def publish(self, version: int, suffix: str = "") -> WeightsAnnouncement:
        return WeightsAnnouncement(version)

    def save_checkpoint(self, directory: Path) -> None:
        pass  # no state: the ledger in Redis is all there is to resume

    def load_checkpoint(self, directory: Path) -> None:
        pass

    def close(self) -> None:
        pass


def make_learner(cfg: RollstreamConfig) -> Learner:
    name = cfg.actor_train.strategy_args.strategy_name
    if name == "stats_only":
        return StatsOnlyLearner()
    if name in ("torch_train", "deepspeed_train"):
        from rollstream.consumer.learn.policy_learner import PolicyLearner
        from rollstream.consumer.learn.strategy import make_strategy

        return PolicyLearner(cfg, make_strategy(cfg))
    raise ValueError(f"actor_train.strategy_args.strategy_name={name!r} has no learner yet")
