"""Choosing the inference backend: `actor_infer.strategy_args.strategy_name`, as in the seed configs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from producer.policy.base import Policy
from shared.config import ConfigError, RollstreamConfig

if TYPE_CHECKING:
    from producer.policy.conversation import ChatTemplateDeltas


def make_policy(cfg: RollstreamConfig) -> Policy:
    """The configured backend; LLM backends load `pretrain` (the published version replaces it at start)."""
    strategy = cfg.actor_infer.strategy_args
    options = dict(strategy.strategy_config)
    if strategy.strategy_name == "scripted":
        from producer.policy.scripted import ScriptedPolicy

        return ScriptedPolicy(**options)
    if not cfg.pretrain:
        raise ConfigError(f"actor_infer.strategy_args.strategy_name={strategy.strategy_name!r} needs pretrain: "
                          "a Hugging Face model directory (or tiny_model.build to make one)")
    if strategy.strategy_name == "hf_infer":
        from producer.policy.hf import HFPolicy

        return HFPolicy(cfg.pretrain, seed=cfg.seed, **options)
    from producer.policy.vllm import VLLMPolicy

    return VLLMPolicy(cfg.pretrain, seed=cfg.seed, max_model_len=cfg.sequence_length, **options)


def chat_template_of(policy: Policy) -> "ChatTemplateDeltas | None":
    """Token-in/token-out needs the policy's tokenizer; a policy without one plays on messages alone."""
    tokenizer = getattr(policy, "tokenizer", None)
    if tokenizer is None:
        return None
    from producer.policy.conversation import ChatTemplateDeltas

    return ChatTemplateDeltas(tokenizer)
