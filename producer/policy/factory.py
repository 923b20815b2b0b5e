"""Choosing the inference backend: `actor_infer.strategy_args.strategy_name`, as in the seed configs."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

from rollstream.producer.policy.base import Policy
from rollstream.shared.config import ConfigError, RollstreamConfig

if TYPE_CHECKING:
    from rollstream.producer.policy.conversation import ChatTemplateDeltas


def make_policy(cfg: RollstreamConfig) -> Policy:
    """The configured backend; LLM backends load `pretrain` (the published version replaces it at start)."""
    strategy = cfg.actor_infer.strategy_args
    options = dict(strategy.strategy_config)
    if strategy.strategy_name == "scripted":
        from rollstream.producer.policy.scripted import ScriptedPolicy

        return ScriptedPolicy(**_checked(ScriptedPolicy, options))
    if not cfg.pretrain:
        raise ConfigError(f"actor_infer.strategy_args.strategy_name={strategy.strategy_name!r} needs pretrain: "
                          "a Hugging Face model directory (or tiny_model.build to make one)")
    if strategy.strategy_name == "hf_infer":
        from rollstream.producer.policy.hf import HFPolicy

        if cfg.actor_infer.infer_batch_size is not None:  # ROLL's key for the same thing; strategy_config wins
            options.setdefault("max_batch_size", cfg.actor_infer.infer_batch_size)
        return HFPolicy(cfg.pretrain, seed=cfg.seed, **_checked(HFPolicy, options))
    if strategy.strategy_name == "vllm_server":
        from rollstream.producer.policy.vllm_server import VLLMServerPolicy
        from rollstream.shared.engines import engine_plans, server_options

        server = server_options(cfg)
        return VLLMServerPolicy(cfg.pretrain, [plan.url for plan in engine_plans(cfg)],
                                startup_timeout_s=server.startup_timeout_s,
                                request_timeout_s=server.request_timeout_s, max_connections=server.max_connections)
    from rollstream.producer.policy.vllm import VLLMPolicy

    # The engine computes in the trainer's dtype: "auto" picked bf16 on CPU, and then the behaviour logprobs
    # the PPO ratio is anchored on came from other numerics than the trainer's fp32.
    defaults: dict[str, Any] = {"max_model_len": cfg.sequence_length,
                                "dtype": _VLLM_DTYPES[cfg.actor_infer.model_args.dtype]}
    return VLLMPolicy(cfg.pretrain, seed=cfg.seed, **(defaults | _checked(VLLMPolicy, options)))


_VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _checked(cls: type, options: dict[str, Any]) -> dict[str, Any]:
    """strategy_config keys must be the backend's keyword arguments: a typo is an error, not a TypeError later."""
    accepted = [name for name, p in inspect.signature(cls).parameters.items()
                if p.kind is p.KEYWORD_ONLY and name not in ("version", "seed")]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ConfigError(f"actor_infer.strategy_args.strategy_config has {', '.join(unknown)}, which "
                          f"{cls.__name__} does not take; valid keys: {', '.join(accepted)}")
    return options


def chat_template_of(policy: Policy) -> ChatTemplateDeltas | None:
    """Token-in/token-out needs the policy's tokenizer; a policy without one plays on messages alone."""
    tokenizer = getattr(policy, "tokenizer", None)
    if tokenizer is None:
        return None
    from rollstream.producer.policy.conversation import ChatTemplateDeltas

    return ChatTemplateDeltas(tokenizer)
