"""ROLL's config keys: each honoured with the same meaning, mapped (a one-line notice says what rollstream does
instead) or refused (an error names the key and the rollstream way). Pure: plain data in, plain data out.

`translate` runs on the merged config before the types are checked, so a ROLL config (the seeds' examples, the
agentic pipeline's key table) reads as it stands. `ROLL_KEYS` is the same knowledge as a table; `markdown_table`
renders it for docs/roll_keys.md (`rollstream config roll-keys`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from rollstream.shared.config import ConfigError

Status = Literal["honoured", "mapped", "refused"]


@dataclass(frozen=True)
class RollKey:
    key: str
    """Dotted path; <role> is actor_train or actor_infer, <tag> any custom_envs tag."""
    status: Status
    note: str


_HONOURED_TOP = ("exp_name", "seed", "output_dir", "logging_dir", "render_save_dir", "max_steps", "save_steps",
                 "logging_steps", "eval_steps", "resume_from_checkpoint", "pretrain", "ppo_epochs", "pg_clip",
                 "use_pg_clip_range", "pg_clip_low", "pg_clip_high",
                 "init_kl_coef", "whiten_advantages", "entropy_loss_coef", "rollout_batch_size", "sequence_length",
                 "async_generation_ratio")
ROLL_KEYS: tuple[RollKey, ...] = (
    *(RollKey(k, "honoured", "same meaning") for k in _HONOURED_TOP),
    RollKey("defaults", "honoured", "Hydra's defaults list: files composed in order (path@_here_, path@pkg, "
            "_self_); config-group options and overrides refused"),
    RollKey("hydra", "mapped", "unused: no Hydra run dir or logging; output_dir and logging_dir say where files go"),
    RollKey("<variables>", "mapped", "top-level keys that only interpolations read (custom_env, "
            "max_actions_per_traj, ...) are resolved, then dropped with a notice"),
    RollKey("adv_estimator", "honoured", "grpo and reinforce as in ROLL, plus gigpo; gae is refused (no critic)"),
    RollKey("gamma", "honoured", "discount of returns; used by gigpo's step-level returns"),
    RollKey("lambd", "refused", "GAE's lambda needs a critic; rollstream's estimators (grpo, reinforce, gigpo) "
            "have none: delete the key"),
    RollKey("target_kl", "refused", "adaptive KL control is not implemented: init_kl_coef is a fixed coefficient; "
            "delete the key or set it to null"),
    RollKey("reward_pretrain", "mapped", "unused: env rewards are rule-based"),
    RollKey("val_batch_size", "mapped", "validation plays every val_env_manager group once per round "
            "(num_env_groups x group_size episodes)"),
    RollKey("critic", "refused", "no critic: use adv_estimator grpo, reinforce or gigpo and delete the section"),
    RollKey("reference", "mapped", "the KL reference is pretrain's weights, loaded by the trainer when "
            "init_kl_coef > 0 or a format anchor (kl_anchor_valid_rate, kl_anchor_unparsed_replies) is set"),
    RollKey("track_with", "mapped", "metrics go to wandb (wandb_mode: offline writes files under output_dir)"),
    RollKey("tracker_kwargs", "mapped", "wandb_project and wandb_mode configure the tracker"),
    RollKey("checkpoint_config", "mapped", "checkpoints go to output_dir/checkpoints/step_<n>"),
    RollKey("num_gpus_per_node", "mapped", "no Ray cluster: each role's device_mapping places it"),
    RollKey("system_envs", "mapped", "env-workers inherit the launching shell's environment"),
    RollKey("<role>.model_args.dtype", "honoured", "bf16, fp16 (inference only) or fp32"),
    RollKey("<role>.model_args.model_type", "honoured", "only causal LMs: unset or causal_lm; other types refused"),
    RollKey("<role>.model_args.attn_implementation", "honoured", "fa2 reads as flash_attention_2"),
    RollKey("<role>.model_args.disable_gradient_checkpointing", "honoured", "same meaning"),
    *(RollKey(f"actor_train.training_args.{k}", "honoured", "same meaning") for k in (
        "learning_rate", "weight_decay", "per_device_train_batch_size", "gradient_accumulation_steps",
        "warmup_steps", "adam_beta1", "adam_beta2", "adam_epsilon")),
    RollKey("actor_train.training_args.lr_scheduler_type", "honoured", "constant, linear or cosine"),
    *(RollKey(f"actor_infer.generating_args.{k}", "honoured", "same meaning") for k in (
        "top_p", "top_k", "temperature")),
    RollKey("actor_infer.generating_args.max_new_tokens", "honoured", "caps every reply; the smaller of it and "
            "the tag's max_tokens_per_step wins"),
    RollKey("actor_infer.generating_args.num_return_sequences", "honoured", "1 only; GRPO samples come from "
            "train_env_manager.group_size"),
    RollKey("actor_infer.generating_args.num_beams", "honoured", "1 only (sampling)"),
    RollKey("actor_infer.strategy_args.strategy_name", "honoured", "vllm (an engine per env-worker), vllm_server "
            "(env-workers share engine servers on actor_infer's devices, as ROLL's actor_infer) and hf_infer; "
            "sglang refused (use vllm)"),
    RollKey("actor_infer.strategy_args.strategy_config", "honoured", "vllm: gpu_memory_utilization, "
            "tensor_parallel_size, ... ; other vLLM engine keys (block_size, load_format, ...) go to engine_kwargs"),
    RollKey("actor_train.strategy_args.strategy_name", "mapped", "deepspeed_train honoured; megatron_train -> "
            "deepspeed_train (ZeRO-1 for use_distributed_optimizer, gradient checkpointing for recompute)"),
    RollKey("actor_train.strategy_args.strategy_config", "mapped", "deepspeed_train: zero_stage (or ROLL's "
            "zero_optimization.stage); megatron: parallel sizes must be 1 (refused otherwise)"),
    RollKey("<role>.device_mapping", "honoured", "GPU ids (list(range(0,4)) reads); `rollstream run` sets "
            "CUDA_VISIBLE_DEVICES of the role's processes; under vllm_server, len / tensor_parallel_size engine "
            "servers, each on its slice"),
    RollKey("actor_train.infer_batch_size", "honoured", "rows per no-grad forward (old and reference logprobs)"),
    RollKey("actor_infer.infer_batch_size", "mapped", "hf_infer: requests per generate call; vllm batches "
            "continuously (notice), as in ROLL"),
    *(RollKey(f"<env_manager>.{k}", "honoured", "same meaning") for k in (
        "max_env_num_per_worker", "num_env_groups", "group_size", "tags", "num_groups_partition")),
    RollKey("<env_manager>.group_filter_cls", "honoured", "train_env_manager only: a class by import path "
            "`package.module:Class` with filter(group_id, trajectories) (true drops, as ROLL's), or the built-in "
            "no_advantage; ROLL's default GroupFilter (keeps every group) reads as unset"),
    *(RollKey(f"custom_envs.<tag>.{k}", "honoured", "same meaning") for k in (
        "env_type", "env_config", "max_tokens_per_step", "max_actions_per_traj")),
    RollKey("custom_envs.<tag>.env_manager_cls", "mapped", "one env loop for every env (producer/episode.py)"),
    RollKey("custom_envs.<tag>.use_thread_lock", "mapped", "each env runs in its own coroutine; no lock needed"),
    RollKey("custom_envs.<tag>.agent_system_template", "honoured", "the system prompt, before the env's rules, "
            "symbols and actions"),
    RollKey("custom_envs.<tag>.agent_template", "honoured", "each turn's user message, with {turn_idx}, "
            "{observation}, {actions_left}, {max_response_length}"),
    RollKey("custom_envs.<tag>.env_config.action_pattern", "honoured", "regex whose first group is the action "
            "(first match in the reply), e.g. <answer>(.*?)</answer>"),
    RollKey("custom_envs.<tag>.env_config.format_penalty", "honoured", "reward of a reply with no valid action"),
    RollKey("custom_envs.<tag>.max_steps", "mapped", "read as max_actions_per_traj (which wins when both are set)"),
    RollKey("custom_envs.<tag>.env_config.max_steps", "mapped", "the episode ends after the tag's "
            "max_actions_per_traj turns"),
)

ROLL_TOP_KEYS = {k.key for k in ROLL_KEYS if "." not in k.key and "<" not in k.key}
"""ROLL's own top-level keys: never mistaken for interpolation variables."""
_MAPPED_TOP = {k.key: k.note for k in ROLL_KEYS if k.status == "mapped" and "." not in k.key and "<" not in k.key}
_REFUSED_TOP = {k.key: k.note for k in ROLL_KEYS if k.status == "refused" and "." not in k.key}
_ENV_NOTES = {k.key.removeprefix("custom_envs.<tag>."): k for k in ROLL_KEYS
              if k.key.startswith("custom_envs.<tag>.") and k.status != "honoured"}
ROLL_DEFAULT_GROUP_FILTER = "roll.pipeline.agentic.agentic_pipeline.GroupFilter"
_MEGATRON_PARALLEL = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                      "expert_model_parallel_size", "virtual_pipeline_model_parallel_size")


def translate(data: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """ROLL's keys read into rollstream's schema: (the translated config, one notice per mapped key)."""
    out = dict(data)
    notices: list[str] = []
    for key, note in _REFUSED_TOP.items():
        if key in out and not (key == "target_kl" and out[key] is None):
            raise ConfigError(f"{key}={_short(out[key])}: {note}")
        out.pop(key, None)
    for key, note in _MAPPED_TOP.items():
        if key in out:
            value = out.pop(key)
            notices.append(f"{key}: {note}" if isinstance(value, dict) else f"{key}={_short(value)}: {note}")
    for role in ("actor_train", "actor_infer"):
        if isinstance(out.get(role), dict):
            out[role] = _translate_worker(role, out[role], out, notices)
    for manager in ("train_env_manager", "val_env_manager"):
        if isinstance(out.get(manager), dict) and out[manager].get("group_filter_cls") == ROLL_DEFAULT_GROUP_FILTER:
            out[manager] = {k: v for k, v in out[manager].items() if k != "group_filter_cls"}
            notices.append(f"{manager}.group_filter_cls={ROLL_DEFAULT_GROUP_FILTER!r}: ROLL's default keeps every "
                           "group; unset")
    if isinstance(out.get("custom_envs"), dict):
        out["custom_envs"] = {tag: _translate_env(tag, entry, notices) for tag, entry in out["custom_envs"].items()}
    if out.get("adv_estimator") == "gae":
        raise ConfigError("adv_estimator='gae': GAE needs a critic, which rollstream does not train; use grpo, "
                          "reinforce or gigpo")
    return out, notices


def _translate_worker(role: str, worker: dict[str, Any], cfg: dict[str, Any], notices: list[str]) -> dict[str, Any]:
    worker = dict(worker)
    strategy = worker.get("strategy_args")
    name = strategy.get("strategy_name") if isinstance(strategy, dict) else None
    if role == "actor_infer" and name == "sglang":
        raise ConfigError("actor_infer.strategy_args.strategy_name='sglang': not supported; use vllm (its "
                          "strategy_config keys are vLLM's engine arguments, as in ROLL)")
    if role == "actor_train" and name == "megatron_train":
        worker["strategy_args"] = _from_megatron(dict(strategy or {}), worker, notices)
    if role == "actor_train" and name == "deepspeed_train":
        worker["strategy_args"] = _from_deepspeed(dict(strategy or {}), notices)
    if role == "actor_infer" and name == "vllm":
        worker["strategy_args"] = _vllm_engine_keys(dict(strategy or {}), notices)
    if role == "actor_infer" and worker.get("infer_batch_size") is not None and name in ("vllm", "scripted"):
        value = worker.pop("infer_batch_size")
        notices.append(f"actor_infer.infer_batch_size={_short(value)}: {name} has no batch to size "
                       "(vLLM batches requests continuously, as in ROLL)")
    return worker


def _from_megatron(strategy: dict[str, Any], worker: dict[str, Any], notices: list[str]) -> dict[str, Any]:
    options = dict(strategy.get("strategy_config") or {})
    for key in _MEGATRON_PARALLEL:
        value = options.pop(key, 1)
        if value not in (1, None):
            raise ConfigError(f"actor_train.strategy_args.strategy_config.{key}={_short(value)}: megatron_train "
                              "reads as deepspeed_train, which is data parallel only; set it to 1 (zero_stage 3 "
                              "shards the parameters instead)")
    recompute = options.pop("recompute_granularity", None)
    if recompute:
        model_args = dict(worker.get("model_args") or {})
        model_args["disable_gradient_checkpointing"] = False
        worker["model_args"] = model_args
    options.pop("use_distributed_optimizer", None)
    dropped = sorted(options)
    notices.append("actor_train.strategy_args.strategy_name='megatron_train': trains with deepspeed_train, "
                   "zero_stage 1 (sharded optimizer states, like Megatron's distributed optimizer)"
                   + (", gradient checkpointing on (recompute_granularity)" if recompute else "")
                   + (f"; no DeepSpeed equivalent, dropped: {', '.join(dropped)}" if dropped else ""))
    return {"strategy_name": "deepspeed_train", "strategy_config": {"zero_stage": 1}}


def _from_deepspeed(strategy: dict[str, Any], notices: list[str]) -> dict[str, Any]:
    """ROLL's deepspeed_train takes a DeepSpeed JSON config; its ZeRO stage is what rollstream's strategy reads."""
    options = dict(strategy.get("strategy_config") or {})
    zero = options.pop("zero_optimization", None)
    if isinstance(zero, dict) and "stage" in zero:
        options.setdefault("zero_stage", zero["stage"])
        rest = sorted(set(options) - {"zero_stage"})
        notices.append("actor_train.strategy_args.strategy_config: a DeepSpeed JSON config; rollstream reads its "
                       f"zero_optimization.stage ({zero['stage']}) and builds the rest itself"
                       + (f"; dropped: {', '.join(rest)}" if rest else ""))
        options = {"zero_stage": options["zero_stage"]}
    return {**strategy, "strategy_config": options}


_VLLM_OWN = ("tensor_parallel_size", "gpu_memory_utilization", "dtype", "max_model_len", "enable_prefix_caching",
             "enable_chunked_prefill", "enforce_eager", "logprobs_mode", "engine_kwargs")
_VLLM_ENGINE = ("block_size", "load_format", "max_num_batched_tokens", "max_num_seqs", "swap_space",
                "kv_cache_dtype", "quantization", "disable_custom_all_reduce", "disable_log_stats", "cpu_offload_gb",
                "num_gpu_blocks_override", "enable_sleep_mode", "distributed_executor_backend", "trust_remote_code")


def _vllm_engine_keys(strategy: dict[str, Any], notices: list[str]) -> dict[str, Any]:
    """ROLL hands vllm's strategy_config to the engine; keys rollstream does not name itself go to engine_kwargs."""
    options = dict(strategy.get("strategy_config") or {})
    moved = {k: options.pop(k) for k in list(options) if k in _VLLM_ENGINE}
    if moved:
        options["engine_kwargs"] = {**(options.get("engine_kwargs") or {}), **moved}
    return {**strategy, "strategy_config": options}


def _translate_env(tag: str, entry: Any, notices: list[str]) -> Any:
    if not isinstance(entry, dict):
        return entry
    entry = dict(entry)
    env_config = entry.get("env_config")
    if isinstance(env_config, dict) and "max_steps" in env_config:
        env_config = dict(env_config)
        value = env_config.pop("max_steps")
        entry["env_config"] = env_config
        notices.append(f"custom_envs.{tag}.env_config.max_steps={_short(value)}: the episode ends after "
                       f"custom_envs.{tag}.max_actions_per_traj turns")
    if "max_steps" in entry:  # ROLL's turn limit on the tag; rollstream's name for it is max_actions_per_traj
        value = entry.pop("max_steps")
        read = "max_actions_per_traj" not in entry
        if read:
            entry["max_actions_per_traj"] = value
        notices.append(f"custom_envs.{tag}.max_steps={_short(value)}: " + (
            "read as max_actions_per_traj" if read else "max_actions_per_traj, also set, wins"))
    for key, roll_key in _ENV_NOTES.items():
        if "." in key:
            continue
        if key not in entry:
            continue
        if roll_key.status == "refused":
            raise ConfigError(f"custom_envs.{tag}.{key}: {roll_key.note}; delete the key")
        value = entry.pop(key)
        notices.append(f"custom_envs.{tag}.{key}={_short(value)}: {roll_key.note}")
    return entry


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def markdown_table() -> str:
    """docs/roll_keys.md: every ROLL key and what rollstream does with it."""
    lines = ["# ROLL config keys in rollstream", "",
             "Generated by `rollstream config roll-keys` from `shared/roll_keys.py`; do not edit by hand.",
             "A mapped key prints a one-line notice when a config is loaded; a refused key is an error that says "
             "what to do instead. `<role>` is actor_train or actor_infer, `<env_manager>` train_env_manager or "
             "val_env_manager.", "", "| ROLL key | rollstream | what happens |", "|---|---|---|"]
    lines += [f"| `{k.key}` | {k.status} | {k.note} |" for k in ROLL_KEYS]
    return "\n".join(lines) + "\n"
