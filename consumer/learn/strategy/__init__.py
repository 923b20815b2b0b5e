"""Training strategies: where the model lives and how one optimizer step is taken.

A strategy owns the model, the optimizer and the lr schedule, and offers the few primitives the PPO loop in
`policy_learner` needs: a forward pass to logits, backward, an optimizer step, weight publication and
checkpoints. The loop only ever hands it tensors, so a multi-rank strategy can run the same loop on every rank
over its share of a batch (see `deepspeed_strategy` for what that path still needs).

- `torch_train`: one device, plain torch AdamW (`strategy_config.device`, default cuda when available;
  `strategy_config.cpu_threads`, torch's threads, default one per core).
- `deepspeed_train`: a DeepSpeed ZeRO engine (`strategy_config.zero_stage` 1, 2 or 3, default 2) with torch's
  AdamW, in one process or on every rank of a launcher (torchrun, deepspeed); gloo on CPU, nccl on GPUs.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel, get_scheduler

from rollstream.shared.config import ConfigError, LrScheduler, RollstreamConfig, TrainDtype
from rollstream.shared.config_checks import strategy_options


@dataclass(frozen=True)
class ModelSettings:
    model_dir: str
    """A Hugging Face directory (`pretrain`)."""
    dtype: TrainDtype = "fp32"
    """fp32, or bf16 (mixed precision: fp32 master weights, bf16 compute)."""
    attn_implementation: str = "sdpa"
    gradient_checkpointing: bool = False

    @classmethod
    def from_config(cls, cfg: RollstreamConfig) -> ModelSettings:
        if not cfg.pretrain:  # checked at load time; a hand-built config may still lack it
            raise ConfigError("pretrain is unset: a training strategy needs the model directory to start from")
        args = cfg.actor_train.model_args
        return cls(cfg.pretrain, args.dtype, args.attn_implementation, not args.disable_gradient_checkpointing)


@dataclass(frozen=True)
class OptimSettings:
    learning_rate: float
    total_steps: int
    """Optimizer steps over the whole run, for the linear and cosine schedules."""
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping (the norm is still reported)."""
    warmup_steps: int = 0
    lr_scheduler_type: LrScheduler = "constant"
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    @classmethod
    def from_config(cls, cfg: RollstreamConfig) -> OptimSettings:
        args = cfg.actor_train.training_args
        total = cfg.max_steps * cfg.ppo_epochs * optimizer_steps_per_epoch(cfg)
        return cls(args.learning_rate, total, args.weight_decay, args.max_grad_norm, args.warmup_steps,
                   args.lr_scheduler_type, (args.adam_beta1, args.adam_beta2), args.adam_epsilon)


def launched_world_size() -> int:
    """WORLD_SIZE as a launcher (torchrun, deepspeed) set it; 1 without one."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def data_parallel_size(cfg: RollstreamConfig) -> int:
    """Ranks that share each mini-batch: the launched world size for deepspeed_train, 1 otherwise."""
    if cfg.actor_train.strategy_args.strategy_name != "deepspeed_train":
        return 1
    return launched_world_size()


def minibatch_size(cfg: RollstreamConfig) -> int:
    """Trajectories per optimizer step: per_device_train_batch_size x gradient_accumulation_steps x ranks."""
    args = cfg.actor_train.training_args
    return args.per_device_train_batch_size * args.gradient_accumulation_steps * data_parallel_size(cfg)


def optimizer_steps_per_epoch(cfg: RollstreamConfig) -> int:
    return math.ceil(cfg.rollout_batch_size / minibatch_size(cfg))


def load_model(settings: ModelSettings) -> PreTrainedModel:
    """The policy in fp32 (bf16 runs keep fp32 master weights), ready to train."""
    model = AutoModelForCausalLM.from_pretrained(
        settings.model_dir, dtype=torch.float32, attn_implementation=settings.attn_implementation
    )
    if settings.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    # Train mode only matters for gradient checkpointing: Qwen2-style configs have no dropout, so the recomputed
    # and the behaviour logprobs of an unchanged model agree. Forwards pass use_cache=False themselves; the
    # config is left alone because it is published with the weights.
    model.train()
    return model


def causal_lm_logits(model: Callable[..., Any], output_embeddings: torch.nn.Module, input_ids: torch.Tensor,
                     attention_mask: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """A causal LM's logits (B, T, V), or with `positions` ((B, T) bool) only those positions' logits, (N, V).

    For the latter the model computes no logits at all (an empty `logits_to_keep`) and its output embeddings are
    applied to the last hidden states at `positions` only. `model` is the module or the engine wrapping it: a
    DeepSpeed engine must see the whole forward. Called as modules, the output embeddings keep ZeRO-3's hooks.
    """
    padding_mask = model_padding_mask(attention_mask)
    if positions is None:
        return model(input_ids=input_ids, attention_mask=padding_mask, use_cache=False).logits
    no_logits = torch.empty(0, dtype=torch.long, device=input_ids.device)
    out = model(input_ids=input_ids, attention_mask=padding_mask, use_cache=False, logits_to_keep=no_logits,
                output_hidden_states=True)
    return output_embeddings(out.hidden_states[-1][positions])


def model_padding_mask(attention_mask: torch.Tensor) -> torch.Tensor | None:
    """The padding mask the model needs, or None where the causal mask alone is exact.

    In a right-padded batch (every row's tokens, then its padding: what `tensors` builds) the causal mask already
    keeps each real token from the padding after it, and the positions count from 0 either way; so every real
    position's output is the same without the padding mask, and only the padding's own outputs, which nothing
    reads, change. Without it SDPA runs its causal kernel, which skips the blocks above the diagonal instead of
    masking them: the main job's update takes ~15% less time on one CPU thread
    (`benchmarks/train_step_throughput.py`). Any other layout keeps its mask.
    """
    right_padded = bool((attention_mask[:, 1:] <= attention_mask[:, :-1]).all())
    return None if right_padded else attention_mask


def make_scheduler(optimizer: Any, settings: OptimSettings) -> torch.optim.lr_scheduler.LRScheduler:
    """transformers' schedules, stepped once per optimizer step. Its "constant" ignores warmup, so a constant
    schedule with warmup steps becomes "constant_with_warmup"."""
    name: str = settings.lr_scheduler_type
    if name == "constant" and settings.warmup_steps > 0:
        name = "constant_with_warmup"
    return get_scheduler(name, optimizer, num_warmup_steps=settings.warmup_steps,
                         num_training_steps=max(settings.total_steps, 1))


class TrainStrategy(Protocol):
    model: PreTrainedModel
    """The unwrapped transformers model."""
    device: torch.device

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, V) from the training model (with grad unless the caller disables it); with `positions`
        ((B, T) bool) only the logits there, as (N, V) in row-major order (see `causal_lm_logits`)."""
        ...

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate the gradient of `loss` (already scaled by the caller for accumulation)."""
        ...

    def optimizer_step(self) -> float:
        """Clip, step the optimizer and the lr schedule, zero the gradients; returns the pre-clip grad norm."""
        ...

    def discard_gradients(self) -> None:
        """Drop the gradients accumulated since the last optimizer step, stepping nothing (`early_stop_kl`)."""
        ...

    @property
    def lr(self) -> float:
        """The learning rate the next optimizer step uses."""
        ...

    def publish_weights(self, final_dir: Path, tokenizer: Any) -> str:
        """Write the full weights and the tokenizer as a HF directory, atomically; returns its digest."""
        ...

    def save_checkpoint(self, directory: Path) -> None:
        """Model, optimizer and lr schedule into `directory` (which exists and is empty)."""
        ...

    def load_checkpoint(self, directory: Path) -> None: ...

    def close(self) -> None: ...


def make_strategy(cfg: RollstreamConfig) -> TrainStrategy:
    """The strategy `actor_train.strategy_args.strategy_name` names, set up from the config."""
    name = cfg.actor_train.strategy_args.strategy_name
    options = dataclasses.asdict(strategy_options(cfg.actor_train.strategy_args, "actor_train"))
    model, optim = ModelSettings.from_config(cfg), OptimSettings.from_config(cfg)
    if name == "torch_train":
        from rollstream.consumer.learn.strategy.torch_strategy import TorchStrategy

        return TorchStrategy(model, optim, **options)
    if name == "deepspeed_train":
        from rollstream.consumer.learn.strategy.deepspeed_strategy import DeepSpeedStrategy

        del options["rank_timeout_s"]  # the ranks' watch, not the engine (distributed.start_rank)
        return DeepSpeedStrategy(model, optim, **options,
                                 micro_batch_size=cfg.actor_train.training_args.per_device_train_batch_size)
    raise ConfigError(f"actor_train.strategy_args.strategy_name={name!r}: must be torch_train or deepspeed_train")
