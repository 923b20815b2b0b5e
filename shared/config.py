"""The one typed config schema (omegaconf structured configs), its loading and its validation.

Key names follow ROLL's agentic pipeline configs (see the seeds), so a ROLL user reads ours at a glance.
Every bad value raises `ConfigError` naming the key, the value and what would be valid.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException


class ConfigError(ValueError):
    """A config value is wrong; the message names the key, the value and what is valid."""


@dataclass
class CustomEnvConfig:
    """One entry of `custom_envs`: what a tag means."""

    env_type: str = "frozen_lake"
    """A registered env type (frozen_lake, sokoban, ...) or an import path `package.module:Class`."""
    max_actions_per_traj: int = 10
    """Turns per episode before it is truncated."""
    max_tokens_per_step: int = 128
    """Most tokens the policy may generate in one reply."""
    env_config: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the env's constructor."""
    step_timeout_s: float | None = 300.0
    """Seconds an env reset or step may take (on a thread) before its episode fails; null: on the event loop."""


@dataclass
class EnvManagerConfig:
    """How many envs of which tags run, and how they are packed into worker processes."""

    max_env_num_per_worker: int = 16
    """Envs one worker process runs at once; a multiple of group_size, since a group is never split."""
    num_env_groups: int = 8
    """Env groups in total; each plays its own episodes."""
    group_size: int = 8
    """Envs per group; they play the same episode (same config, same seed): one GRPO group."""
    tags: list[str] = field(default_factory=lambda: ["FrozenLake"])
    """Which `custom_envs` entries to run."""
    num_groups_partition: list[int] | None = None
    """Groups per tag, in the order of `tags`; unset splits num_env_groups evenly."""


@dataclass
class StrategyArgs:
    strategy_name: str = "scripted"
    """actor_infer: scripted | hf_infer | vllm; actor_train: stats_only | torch_train | deepspeed_train."""
    strategy_config: dict[str, Any] = field(default_factory=dict)
    """Backend-specific settings (vLLM: gpu_memory_utilization, tensor_parallel_size, ...; torch_train: device;
    deepspeed_train: zero_stage 1 | 2 | 3, default 2)."""


@dataclass
class GeneratingArgs:
    max_new_tokens: int = 128
    top_p: float = 1.0
    top_k: int = -1
    temperature: float = 1.0
    num_return_sequences: int = 1


@dataclass
class TrainingArgs:
    learning_rate: float = 3.0e-4
    weight_decay: float = 0.0
    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    warmup_steps: int = 0
    lr_scheduler_type: str = "constant"
    """constant | linear | cosine (transformers' schedules), stepped once per optimizer step."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this before each optimizer step; 0 disables clipping."""
    max_tokens_per_microbatch: int = 0
    """Token budget of a micro-batch (rows x longest row) for gradient accumulation; 0: per_device_train_batch_size
    rows per micro-batch. A mini-batch (one optimizer step) is per_device_train_batch_size x
    gradient_accumulation_steps trajectories either way."""


@dataclass
class ModelArgs:
    dtype: str = "fp32"
    model_type: str = "causal_lm"
    attn_implementation: str = "sdpa"
    disable_gradient_checkpointing: bool = True


@dataclass
class WorkerConfig:
    """`actor_train` / `actor_infer`: a role's model, training, generation and strategy settings."""

    model_args: ModelArgs = field(default_factory=ModelArgs)
    training_args: TrainingArgs = field(default_factory=TrainingArgs)
    generating_args: GeneratingArgs = field(default_factory=GeneratingArgs)
    strategy_args: StrategyArgs = field(default_factory=StrategyArgs)
    device_mapping: Any = None
    infer_batch_size: int = 1


@dataclass
class TinyModelConfig:
    """An offline stand-in for a pretrained instruct model: no model hub is needed."""

    build: bool = False
    """Make a tiny Qwen2 model (BPE tokenizer trained on the envs' text) at `pretrain` when that dir has none."""
    tie_word_embeddings: bool = False
    hidden_size: int = 128
    layers: int = 2
    sft_seconds: float = 120.0
    """Format warm start: supervised fine-tuning on replies with uniformly random valid actions, this long."""
    sft_steps: int = 2000


@dataclass
class RedisConfig:
    url: str | None = None
    """redis://[user:password@]host:port/db or rediss:// for TLS; unset starts an embedded server.
    The environment variable ROLLSTREAM_REDIS_URL wins over this key."""
    block_ms: int = 2000
    """How long one XREADGROUP/XREAD blocks; kept well below socket_timeout_s."""
    socket_timeout_s: float = 30.0
    """Must exceed block_ms, or redis-py turns a blocking read into a TimeoutError after retries."""
    read_count: int = 128
    """Entries fetched per XREADGROUP."""
    heartbeat_s: float = 2.0
    """How often a worker refreshes its heartbeat; it is considered gone after 5 missed beats."""


@dataclass
class RollstreamConfig:
    exp_name: str = "frozen_lake"
    seed: int = 42
    output_dir: str = "./output/${exp_name}"
    logging_dir: str = "${output_dir}/logs"
    render_save_dir: str | None = None
    """When set, every episode saves one PNG per step under this dir."""

    max_steps: int = 20
    save_steps: int = 10000
    logging_steps: int = 1
    eval_steps: int = 0
    """Validate (val_env_manager, temperature 0) before every step divisible by this and after the last; 0: never."""
    val_sampled_episodes: int = 1
    """Validation also plays each held-out map this many times sampled (actor_infer.generating_args), as
    `val_sampled/...`: what the training policy does, beside the greedy `val/...`. 0: greedy only."""
    resume_from_checkpoint: Any = False

    rollout_batch_size: int = 64
    """Trajectories per train step; a multiple of train_env_manager.group_size."""
    sequence_length: int = 2048
    async_generation_ratio: int = 0
    """r: generation may run r policy versions ahead of training; 0 is synchronous."""
    group_timeout_s: float = 600.0
    """An admitted group whose members have not all arrived after this long is dropped."""

    pretrain: str | None = None
    adv_estimator: str = "grpo"
    ppo_epochs: int = 1
    gamma: float = 1.0
    lambd: float = 1.0
    pg_clip: float = 0.2
    init_kl_coef: float = 0.0
    whiten_advantages: bool = False
    entropy_loss_coef: float = 0.0
    adv_std_normalize: str = "group"
    """grpo/gigpo: group divides by the group's std (floored at adv_std_floor); none keeps mean-only advantages."""
    adv_std_floor: float = 1e-6
    """Smallest std a group's advantages are divided by; raise it (e.g. 0.1) so a tiny reward spread stays tiny."""
    adv_clip: float | None = None
    """Clip advantages to [-adv_clip, adv_clip] after whitening; unset: no clipping."""
    gigpo_step_weight: float = 1.0
    """gigpo: omega in A = A_episode + omega * A_step."""
    old_logprobs: str = "engine"
    """Anchor of the PPO ratio: engine (the behaviour policy's own logprobs: corrects async staleness) or
    recompute (the trainer's weights before the step, with a truncated importance weight to the engine's)."""
    is_ratio_cap: float = 3.0
    """Truncation of the importance ratio: the dual clip for negative advantages; with recompute, the IS weight cap."""

    actor_train: WorkerConfig = field(
        default_factory=lambda: WorkerConfig(strategy_args=StrategyArgs(strategy_name="stats_only"))
    )
    actor_infer: WorkerConfig = field(default_factory=WorkerConfig)
    train_env_manager: EnvManagerConfig = field(default_factory=EnvManagerConfig)
    val_env_manager: EnvManagerConfig = field(
        default_factory=lambda: EnvManagerConfig(num_env_groups=8, group_size=1, max_env_num_per_worker=8)
    )
    custom_envs: dict[str, CustomEnvConfig] = field(
        default_factory=lambda: {"FrozenLake": CustomEnvConfig()}
    )
    redis: RedisConfig = field(default_factory=RedisConfig)
    weights_transport: str = "filesystem"
    """filesystem: producers read the trainer's weight directories in place (a shared filesystem across hosts);
    redis: the trainer also copies each version into Redis in chunks and producers download it."""
    weights_chunk_mb: float = 8.0
    """Size of one weights chunk in Redis (weights_transport: redis)."""
    tiny_model: TinyModelConfig = field(default_factory=TinyModelConfig)
    wandb_mode: str = "offline"
    """online | offline | disabled: offline writes the run under output_dir for a later `wandb sync`."""
    wandb_project: str = "rollstream"
    record_to: str | None = None
    """When set, the trainer appends every trajectory it trains on to this file (see `rollstream replay`)."""

    @property
    def groups_per_batch(self) -> int:
        """G: complete GRPO groups per train step."""
        return self.rollout_batch_size // self.train_env_manager.group_size


INFER_STRATEGIES = ("scripted", "hf_infer", "vllm")
TRAIN_STRATEGIES = ("stats_only", "torch_train", "deepspeed_train")
ADV_ESTIMATORS = ("grpo", "reinforce", "gigpo")


def load_config(path: str | os.PathLike[str] | None, overrides: Sequence[str] = ()) -> RollstreamConfig:
    """YAML file (optional) merged over the schema, then `key=value` overrides, then validation."""
    schema = OmegaConf.structured(RollstreamConfig)
    try:
        layers = [schema]
        if path is not None:
            if not Path(path).is_file():
                raise ConfigError(f"config file {str(path)!r} does not exist")
            layers.append(OmegaConf.load(path))
        layers.append(OmegaConf.from_dotlist(list(overrides)))
        merged = OmegaConf.merge(*layers)
        OmegaConf.resolve(merged)
        cfg: RollstreamConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as e:
        raise ConfigError(_describe_omegaconf_error(e)) from None
    validate(cfg)
    return cfg


def _describe_omegaconf_error(e: OmegaConfBaseException) -> str:
    key = getattr(e, "full_key", None)
    first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
    if key:
        return f"config key {key!r}: {first_line}"
    return f"config: {first_line}"


def to_yaml(cfg: RollstreamConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def validate(cfg: RollstreamConfig) -> None:
    """Check what types alone cannot; the layout checks live in `rollstream.shared.layout`."""
    from rollstream.shared.layout import plan_layout  # the layout owns the env-manager arithmetic

    _positive(cfg.max_steps, "max_steps", allow_zero=False)
    _positive(cfg.rollout_batch_size, "rollout_batch_size", allow_zero=False)
    _positive(cfg.save_steps, "save_steps", allow_zero=False)
    _positive(cfg.logging_steps, "logging_steps", allow_zero=False)
    _positive(cfg.eval_steps, "eval_steps", allow_zero=True)
    _positive(cfg.val_sampled_episodes, "val_sampled_episodes", allow_zero=True)
    _positive(cfg.ppo_epochs, "ppo_epochs", allow_zero=False)
    if cfg.async_generation_ratio < 0:
        raise ConfigError(
            f"async_generation_ratio={cfg.async_generation_ratio}: must be an integer >= 0 "
            "(0 = synchronous, 1 = generation may run one version ahead of training)"
        )
    if cfg.group_timeout_s <= 0:
        raise ConfigError(f"group_timeout_s={cfg.group_timeout_s}: must be > 0 seconds")
    group_size = cfg.train_env_manager.group_size
    if group_size > 0 and cfg.rollout_batch_size % group_size:
        raise ConfigError(
            f"rollout_batch_size={cfg.rollout_batch_size} is not a multiple of "
            f"train_env_manager.group_size={group_size}: a batch holds whole GRPO groups; "
            f"try rollout_batch_size={max(1, cfg.rollout_batch_size // group_size) * group_size}"
        )
    _one_of(cfg.actor_infer.strategy_args.strategy_name, "actor_infer.strategy_args.strategy_name", INFER_STRATEGIES)
    _one_of(cfg.actor_train.strategy_args.strategy_name, "actor_train.strategy_args.strategy_name", TRAIN_STRATEGIES)
    _one_of(cfg.adv_estimator, "adv_estimator", ADV_ESTIMATORS)
    _validate_learning(cfg)
    _one_of(cfg.wandb_mode, "wandb_mode", ("online", "offline", "disabled"))
    _one_of(cfg.weights_transport, "weights_transport", ("filesystem", "redis"))
    _greater(cfg.weights_chunk_mb, "weights_chunk_mb", 0.0)
    _one_of(cfg.actor_infer.model_args.dtype, "actor_infer.model_args.dtype", ("fp32", "bf16", "fp16"))
    if cfg.tiny_model.build and not cfg.pretrain:
        raise ConfigError("tiny_model.build=true needs pretrain: the directory to build the tiny model in")
    if cfg.redis.block_ms / 1000 >= cfg.redis.socket_timeout_s:
        raise ConfigError(
            f"redis.block_ms={cfg.redis.block_ms} must stay below redis.socket_timeout_s="
            f"{cfg.redis.socket_timeout_s} s, or a blocking read times out on the socket"
        )
    for tag, env in cfg.custom_envs.items():
        _positive(env.max_actions_per_traj, f"custom_envs.{tag}.max_actions_per_traj", allow_zero=False)
        _positive(env.max_tokens_per_step, f"custom_envs.{tag}.max_tokens_per_step", allow_zero=False)
    plan_layout(cfg.train_env_manager, cfg.custom_envs, "train_env_manager")
    if cfg.eval_steps:
        plan_layout(cfg.val_env_manager, cfg.custom_envs, "val_env_manager")
        if cfg.val_env_manager.group_size != 1:
            raise ConfigError(
                f"val_env_manager.group_size={cfg.val_env_manager.group_size}: validation runs at "
                "temperature 0, so every member of a group would play the same; use 1"
            )


def _validate_learning(cfg: RollstreamConfig) -> None:
    """Advantage and loss settings always; optimizer and model settings when a strategy trains a model."""
    _one_of(cfg.adv_std_normalize, "adv_std_normalize", ("group", "none"))
    _one_of(cfg.old_logprobs, "old_logprobs", ("engine", "recompute"))
    _greater(cfg.adv_std_floor, "adv_std_floor", 0.0)
    if cfg.adv_clip is not None:
        _greater(cfg.adv_clip, "adv_clip", 0.0, "(or unset for no clipping)")
    _greater(cfg.pg_clip, "pg_clip", 0.0)
    _greater(cfg.is_ratio_cap, "is_ratio_cap", 1.0)
    if not 0.0 <= cfg.gamma <= 1.0:
        raise ConfigError(f"gamma={cfg.gamma}: must be in [0, 1]")
    for key in ("init_kl_coef", "entropy_loss_coef", "gigpo_step_weight"):
        if getattr(cfg, key) < 0:
            raise ConfigError(f"{key}={getattr(cfg, key)}: must be >= 0")
    if cfg.actor_train.strategy_args.strategy_name not in ("torch_train", "deepspeed_train"):
        return
    if not cfg.pretrain:
        raise ConfigError("pretrain is unset: actor_train.strategy_args.strategy_name="
                          f"{cfg.actor_train.strategy_args.strategy_name!r} trains the model in that directory")
    args = cfg.actor_train.training_args
    _greater(args.learning_rate, "actor_train.training_args.learning_rate", 0.0)
    _positive(args.per_device_train_batch_size, "actor_train.training_args.per_device_train_batch_size",
              allow_zero=False)
    _positive(args.gradient_accumulation_steps, "actor_train.training_args.gradient_accumulation_steps",
              allow_zero=False)
    _positive(args.warmup_steps, "actor_train.training_args.warmup_steps", allow_zero=True)
    _positive(args.max_tokens_per_microbatch, "actor_train.training_args.max_tokens_per_microbatch", allow_zero=True)
    if args.max_grad_norm < 0 or args.weight_decay < 0:
        raise ConfigError(f"actor_train.training_args.max_grad_norm={args.max_grad_norm} and weight_decay="
                          f"{args.weight_decay}: both must be >= 0 (max_grad_norm 0 disables clipping)")
    _one_of(args.lr_scheduler_type, "actor_train.training_args.lr_scheduler_type", ("constant", "linear", "cosine"))
    _one_of(cfg.actor_train.model_args.dtype, "actor_train.model_args.dtype", ("fp32", "bf16"))


def _greater(value: float, key: str, bound: float, hint: str = "") -> None:
    if not value > bound:
        raise ConfigError(f"{key}={value}: must be > {bound} {hint}".rstrip())


def _positive(value: int, key: str, *, allow_zero: bool) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else ">= 1"
        raise ConfigError(f"{key}={value}: must be an integer {bound}")


def _one_of(value: str, key: str, valid: Sequence[str]) -> None:
    if value not in valid:
        raise ConfigError(f"{key}={value!r}: must be one of {', '.join(valid)}")


def as_dict(cfg: RollstreamConfig) -> dict[str, Any]:
    """Plain containers, for logging the run's config (wandb) and for child processes."""
    container = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    assert isinstance(container, dict)
    return container  # type: ignore[return-value]


def dump_config(cfg: RollstreamConfig, path: Path) -> None:
    """Write the resolved config, so child processes and later readers see exactly what ran."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_yaml(cfg))
