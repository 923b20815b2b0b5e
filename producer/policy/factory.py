"""Choosing the inference backend: `actor_infer.strategy_args.strategy_name`, as in the seed configs."""

from __future__ import annotations

from producer.policy.base import Policy
from shared.config import RollstreamConfig


def make_policy(cfg: RollstreamConfig) -> Policy:
    strategy = cfg.actor_infer.strategy_args
    if strategy.strategy_name == "scripted":
        from producer.policy.scripted import ScriptedPolicy

        return ScriptedPolicy(**strategy.strategy_config)
    raise ValueError(
        f"actor_infer.strategy_args.strategy_name={strategy.strategy_name!r} is not available yet; use scripted"
    )
