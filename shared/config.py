"""The one typed config schema: every key, its type, its allowed values and a one-line docstring.

Key names follow ROLL's agentic pipeline configs (see the seeds), so a ROLL user reads ours at a glance; how each
ROLL key is honoured, mapped or refused lives in `rollstream.shared.roll_keys`. Reading files and overrides is
`rollstream.shared.config_load`; checks across keys and the settings derived from them are
`rollstream.shared.config_checks`. Every bad value raises `ConfigError` naming the key, the value and what is valid.
The allowed values of a key are a Literal type here, used by the checks, the error messages and the docs alike.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, get_args

from pydantic import AfterValidator, BeforeValidator, ConfigDict, Field
from pydantic.dataclasses import dataclass

from rollstream.shared.config_values import (
    attn_alias,
    check_bad_word,
    check_exp_name,
    check_redis_url,
    check_resume,
    check_turn_template,
    parse_int_list,
    redact_url,
)

if TYPE_CHECKING:
    from rollstream.shared.layout import Layout



class ConfigError(ValueError):
    """A config value is wrong; the message names the key, the value and what is valid."""


InferStrategy = Literal["scripted", "hf_infer", "vllm", "vllm_server"]
TrainStrategy = Literal["stats_only", "torch_train", "deepspeed_train"]
InferDtype = Literal["fp32", "bf16", "fp16"]
TrainDtype = Literal["fp32", "bf16"]
"""fp32, or bf16 mixed precision (fp32 master weights); fp16 training would need loss scaling."""
LrScheduler = Literal["constant", "linear", "cosine"]
ZeroStage = Literal[1, 2, 3]
"""DeepSpeed ZeRO: 1 shards optimizer states, 2 also gradients, 3 also parameters."""
OldLogprobs = Literal["engine", "recompute"]
AdvEstimator = Literal["grpo", "reinforce", "gigpo"]
StdNormalize = Literal["group", "none"]
AttnImplementation = Literal["eager", "sdpa", "flash_attention_2"]
WeightsTransport = Literal["filesystem", "redis"]
WandbMode = Literal["online", "offline", "disabled"]
FatalMoveGroups = Literal["all", "at_success_rate"]
FormatMoves = Literal["begun", "spelled"]

MAX_ENV_GROUPS = 100_000
"""Bounds that keep a typo (num_env_groups: 10**12) an error, not a MemoryError while laying groups out."""
MAX_GROUP_SIZE = 4096
MAX_ENVS_PER_WORKER = 1_000_000
GROUP_FILTERS = ("no_advantage",)
"""The built-in `group_filter_cls` names (rollstream.consumer.data.group_filters)."""


def choices(literal: Any) -> tuple[Any, ...]:
    """The allowed values of a Literal type, e.g. `choices(TrainDtype)` -> ('fp32', 'bf16')."""
    return get_args(literal)


PositiveInt = Annotated[int, Field(ge=1)]
Count = Annotated[int, Field(ge=0)]
IntList = Annotated[list[int], BeforeValidator(parse_int_list)]
SCHEMA = ConfigDict(extra="forbid", use_attribute_docstrings=True, coerce_numbers_to_str=True, allow_inf_nan=False)


@dataclass(config=SCHEMA)
class CustomEnvConfig:
    """One entry of `custom_envs`: what a tag means."""

    env_type: str = "frozen_lake"
    """A registered env type (frozen_lake, sokoban) or an import path `package.module:Class` to a TextEnv."""
    max_actions_per_traj: Annotated[int, Field(ge=1, le=10_000)] = 10
    """Turns per episode before it is truncated."""
    max_tokens_per_step: Annotated[int, Field(ge=1, le=1_000_000)] = 128
    """Most tokens the policy may generate in one reply (capped further by generating_args.max_new_tokens)."""
    env_config: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the env's constructor (checked against it at load time)."""
    agent_system_template: str | None = None
    """ROLL's system prompt text, put before the env's rules, symbols and actions; unset: those alone."""
    agent_template: Annotated[str | None, AfterValidator(check_turn_template)] = None
    """ROLL's user message of a turn, with {turn_idx}, {observation}, {actions_left}, {max_response_length}."""
    step_timeout_s: Annotated[float | None, Field(gt=0)] = 300.0
    """Seconds an env reset or step may take (on a thread) before its episode fails; null: on the event loop."""


XSB_VOCAB = {"wall": "#", "empty": "-", "target": ".", "box": "$", "box_on_target": "*", "player": "@",
             "player_on_target": "+"}
"""The classic Sokoban file notation (with - for floor, so no cell is a space)."""

PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "FrozenLake": ("frozen_lake", {"size": 4, "p": 0.8, "is_slippery": False}),
    "SimpleSokoban": ("sokoban", {"dim_room": [6, 6], "num_boxes": 1, "search_depth": 30}),
    "LargerSokoban": ("sokoban", {"dim_room": [10, 10], "num_boxes": 2, "search_depth": 30}),
    "SokobanDifferentGridVocab": (
        "sokoban", {"dim_room": [6, 6], "num_boxes": 1, "search_depth": 30, "grid_vocab": XSB_VOCAB}),
}
"""The seeds' tags, defined by default: tag -> (env_type, env_config). A tag the config writes replaces its preset."""


def default_custom_envs() -> dict[str, CustomEnvConfig]:
    """Fresh `custom_envs` entries for the default tags (other fields at their CustomEnvConfig defaults)."""
    import copy

    return {tag: CustomEnvConfig(env_type=env_type, env_config=copy.deepcopy(env_config))
            for tag, (env_type, env_config) in PRESETS.items()}


@dataclass(config=SCHEMA)
class EnvManagerConfig:
    """How many envs of which tags run, and how they are packed into worker processes."""

    max_env_num_per_worker: Annotated[int, Field(ge=1, le=MAX_ENVS_PER_WORKER)] = 16
    """Envs one worker process runs at once; a multiple of group_size, since a group is never split."""
    num_env_groups: Annotated[int, Field(ge=1, le=MAX_ENV_GROUPS)] = 8
    """Env groups in total; each plays its own episodes."""
    group_size: Annotated[int, Field(ge=1, le=MAX_GROUP_SIZE)] = 8
    """Envs per group; they play the same episode (same config, same seed): one GRPO group."""
    tags: list[str] = field(default_factory=lambda: ["FrozenLake"])
    """Which `custom_envs` entries to run."""
    num_groups_partition: IntList | None = None
    """Groups per tag, in the order of `tags`; unset splits num_env_groups evenly."""
    group_filter_cls: str | None = None
    """train_env_manager only: which complete groups the trainer drops instead of training (their slots return, so
    others are played in their place: dynamic sampling). no_advantage: groups whose every advantage is zero (all
    members scored alike; gigpo: no step-level difference either); or an import path `package.module:Class` whose
    `Class(cfg)` has `filter(group_id, trajectories) -> bool` (true drops, as ROLL's GroupFilter). Unset: keep all."""
    group_filter_max_batches: PositiveInt = 4
    """While one batch is gathered, at most this many batches' worth of groups are filtered out; past that the
    filter lets groups through until the batch is full (logged), so a filter that drops everything slows the
    steps but never stalls the run."""


@dataclass(config=SCHEMA)
class StrategyArgs:
    """A role's backend and that backend's own settings."""

    strategy_name: str = "scripted"
    """The backend (see actor_infer / actor_train for the allowed names)."""
    strategy_config: dict[str, Any] = field(default_factory=dict)
    """Backend settings, checked against the backend's keys (see `rollstream config show --explain`)."""


@dataclass(config=SCHEMA)
class InferStrategyArgs(StrategyArgs):
    strategy_name: InferStrategy = "scripted"
    """scripted (random valid actions, no model) | hf_infer (transformers generate) | vllm (one engine in each
    env-worker) | vllm_server (env-workers send token ids to `rollstream engine` servers on actor_infer's devices)."""


@dataclass(config=SCHEMA)
class TrainStrategyArgs(StrategyArgs):
    strategy_name: TrainStrategy = "stats_only"
    """stats_only (no model: measures batches) | torch_train (one device) | deepspeed_train (ZeRO)."""


@dataclass(config=SCHEMA)
class GeneratingArgs:
    """Sampling settings of train episodes (validation's greedy member uses temperature 0)."""

    max_new_tokens: Annotated[int, Field(ge=1)] | None = None
    """Cap on one reply's tokens for every tag; the smaller of it and the tag's max_tokens_per_step wins (as ROLL)."""
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p."""
    top_k: Annotated[int, Field(ge=-1)] = -1
    """Keep the k most likely tokens; -1 keeps all."""
    temperature: Annotated[float, Field(ge=0.0)] = 1.0
    """Sampling temperature; 0 is greedy."""
    bad_words: list[Annotated[str, AfterValidator(check_bad_word)]] = field(default_factory=list)
    """Text the policy may not generate, in training and validation alike (vLLM's SamplingParams.bad_words): the
    last token of a word is banned right after its other tokens. `["<think>"]` takes the think path away."""
    num_return_sequences: Literal[1] = 1
    """One reply per env per turn; GRPO samples come from train_env_manager.group_size, not from this."""
    num_beams: Literal[1] = 1
    """Sampling, no beam search (a beam would not be the policy's own sample)."""


@dataclass(config=SCHEMA)
class TrainingArgs:
    """Optimizer and batching settings of actor_train."""

    learning_rate: Annotated[float, Field(gt=0.0)] = 3.0e-4
    """AdamW learning rate (the peak, with warmup and a schedule)."""
    weight_decay: Annotated[float, Field(ge=0.0)] = 0.0
    """AdamW weight decay."""
    adam_beta1: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.9
    """AdamW's first-moment decay (transformers' name)."""
    adam_beta2: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.999
    """AdamW's second-moment decay: it remembers the gradients' scale over about 1 / (1 - adam_beta2) steps."""
    adam_epsilon: Annotated[float, Field(gt=0.0)] = 1.0e-8
    """Added to the root of AdamW's second moment: it bounds the step that follows a stretch of tiny gradients."""
    per_device_train_batch_size: PositiveInt = 8
    """Trajectories per micro-batch (one forward and backward) on each rank."""
    gradient_accumulation_steps: PositiveInt = 1
    """Micro-batches per optimizer step."""
    warmup_steps: Count = 0
    """Optimizer steps of linear learning-rate warmup."""
    lr_scheduler_type: LrScheduler = "constant"
    """Learning-rate schedule (transformers' schedules), stepped once per optimizer step."""
    max_grad_norm: Annotated[float, Field(ge=0.0)] = 1.0
    """Clip the global gradient norm to this before each optimizer step; 0 disables clipping."""
    max_tokens_per_microbatch: Count = 0
    """Token budget of a micro-batch (rows x longest row); 0: per_device_train_batch_size rows per micro-batch."""


@dataclass(config=SCHEMA)
class ModelArgs:
    """How a role loads the model at `pretrain`."""

    dtype: InferDtype = "fp32"
    """Compute dtype."""
    model_type: Literal["causal_lm"] | None = None
    """Only causal LMs load (AutoModelForCausalLM): unset or causal_lm."""
    attn_implementation: Annotated[AttnImplementation, BeforeValidator(attn_alias)] = "sdpa"
    """transformers' attention kernel; ROLL's fa2 reads as flash_attention_2."""
    disable_gradient_checkpointing: bool = True
    """false recomputes activations in backward (less memory, slower)."""


@dataclass(config=SCHEMA)
class TrainModelArgs(ModelArgs):
    dtype: TrainDtype = "fp32"
    """fp32, or bf16 mixed precision (fp32 master weights, bf16 compute; weights are published in bf16)."""


@dataclass(config=SCHEMA)
class WorkerConfig:
    """A role's model, training, generation and strategy settings, and where it runs."""

    model_args: ModelArgs = field(default_factory=ModelArgs)
    """Model loading."""
    training_args: TrainingArgs = field(default_factory=TrainingArgs)
    """Optimizer and batching (actor_train)."""
    generating_args: GeneratingArgs = field(default_factory=GeneratingArgs)
    """Sampling (actor_infer)."""
    strategy_args: StrategyArgs = field(default_factory=StrategyArgs)
    """Backend."""
    device_mapping: IntList | None = None
    """GPU ids for this role (ROLL's list(range(0,4)) reads too): `rollstream run` sets CUDA_VISIBLE_DEVICES."""
    infer_batch_size: Annotated[int, Field(ge=1)] | None = None
    """Rows per no-grad forward: actor_train's old/reference logprob passes; hf_infer's generate batch."""


@dataclass(config=SCHEMA)
class InferWorkerConfig(WorkerConfig):
    strategy_args: InferStrategyArgs = field(default_factory=InferStrategyArgs)
    """The inference backend."""


@dataclass(config=SCHEMA)
class TrainWorkerConfig(WorkerConfig):
    model_args: TrainModelArgs = field(default_factory=TrainModelArgs)
    """Model loading for training."""
    strategy_args: TrainStrategyArgs = field(default_factory=TrainStrategyArgs)
    """The training backend."""


AUTO = "auto"
"""hosts.machines.<name>.env_workers: a share of the env-worker ranks no host lists."""


@dataclass(config=SCHEMA)
class MachineConfig:
    """One host."""

    address: str = "127.0.0.1"
    """How the other hosts reach this one; the Redis URL uses it when this host runs Redis."""
    env_workers: Any = field(default_factory=list)
    """Env-worker ranks this host runs: a list of ranks, or "auto" for a share of the ranks no host lists."""
    engines: list[int] = field(default_factory=list)
    """Inference engine ranks this host runs (strategy_name vllm_server; engine k's URL: strategy_config.urls[k])."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment of every program on this host (e.g. CUDA_VISIBLE_DEVICES)."""


@dataclass(config=SCHEMA)
class RedisPlacement:
    """Where Redis runs."""

    host: str | None = None
    """The host whose supervisord runs Redis from deploy/redis.conf; unset: an external Redis, reached at
    redis.url or ROLLSTREAM_REDIS_URL."""
    port: int = 6379
    """The port of that Redis (deploy/redis.conf is started with it)."""


@dataclass(config=SCHEMA)
class TrainerPlacement:
    """Where the trainer runs."""

    host: str | None = None
    """The host that runs the trainer."""
    ranks: int = 1
    """Trainer processes on that host (one per GPU); more than one are launched with torchrun."""


@dataclass(config=SCHEMA)
class HostsConfig:
    """Unset (no machines): everything runs on one machine (`rollstream run`)."""

    redis: RedisPlacement = field(default_factory=RedisPlacement)
    """Which host runs Redis, and its port."""
    trainer: TrainerPlacement = field(default_factory=TrainerPlacement)
    """Which host runs the trainer, with how many ranks."""
    machines: dict[str, MachineConfig] = field(default_factory=dict)
    """Every host by name, with what it runs (checked by shared/hosts.py)."""


@dataclass(config=SCHEMA)
class TinyModelConfig:
    """An offline stand-in for a pretrained instruct model: no model hub is needed."""

    build: bool = False
    """Make a tiny Qwen2 model (BPE tokenizer trained on the envs' text) at `pretrain` when that dir has none."""
    tie_word_embeddings: bool = False
    """Share the input and output embedding matrices."""
    hidden_size: Annotated[int, Field(ge=16, le=8192)] = 128
    """Width of the tiny model."""
    layers: Annotated[int, Field(ge=1, le=64)] = 2
    """Transformer layers of the tiny model."""
    sft_seconds: Annotated[float, Field(ge=0.0)] | None = 120.0
    """Format warm start: supervised fine-tuning on replies with uniformly random valid actions, at most this long;
    null: sft_steps alone bounds it, so a seed builds the same model on every machine."""
    sft_steps: Count = 2000
    """Most steps of that warm start."""
    think_prob: Annotated[float, Field(ge=0.0, le=1.0)] = 0.5
    """Share of the warm start's replies that open with a short <think> naming the answer's action (no reasoning:
    it only teaches that a think may come first); 0: every warm-start reply answers directly."""
    sft_on_prompts: bool = False
    """The warm start's loss also scores the prompts (the env's text: rules, boards after each random move), as
    a second mean beside the replies': a stand-in for the text a pretrained model has read, so the model has
    learnt to read a board before RL starts. The replies stay uniformly random valid actions."""
    action_tokens: bool = False
    """Every env's action names are one token each. Without it the tokenizer spells `Right` in two (`R` `ight`), so
    a reply chooses that move at one token and must complete it at the next, a format position; with it an unparsed
    answer that began with any other token broke there (`text.format_break`). One run on machine 41, slower to
    start: not the main job's (docs/learning.md)."""


@dataclass(config=SCHEMA)
class RedisConfig:
    """Where the streams live and how clients talk to it."""

    url: Annotated[str | None, AfterValidator(check_redis_url)] = None
    """redis://[user:password@]host:port/db, rediss:// (TLS) or unix://; unset starts an embedded server.
    ROLLSTREAM_REDIS_URL wins over this key; a password here is never printed or written out."""
    block_ms: Annotated[int, Field(ge=1)] = 2000
    """How long one XREADGROUP/XREAD blocks; kept well below socket_timeout_s."""
    socket_timeout_s: Annotated[float, Field(gt=0.0)] = 30.0
    """Must exceed block_ms, or redis-py turns a blocking read into a TimeoutError after retries."""
    read_count: PositiveInt = 128
    """Entries fetched per XREADGROUP (512 read 2 KB trajectories no faster: 0.83x, 5 interleaved rounds)."""
    heartbeat_s: Annotated[float, Field(gt=0.0)] = 2.0
    """How often a worker refreshes its heartbeat; it is considered gone after 5 missed beats."""
    max_outage_s: float = 300.0
    """How long a process waits for an unreachable (or full) Redis, reconnecting with backoff, before it exits."""


@dataclass(config=SCHEMA)
class RollstreamConfig:
    """A whole experiment."""

    exp_name: Annotated[str, AfterValidator(check_exp_name)] = "frozen_lake"
    """Names the experiment: its Redis namespace rollstream:<exp_name> and, by default, its output dir."""
    seed: Annotated[int, Field(ge=0, le=2**32 - 1)] = 42
    """Seeds episodes (per group and episode), sampling and the trainer."""
    output_dir: str = "./output/${exp_name}"
    """Checkpoints, weights, the resolved config.yaml and wandb files."""
    logging_dir: str = "${output_dir}/logs"
    """Env-worker logs of `rollstream run`."""
    render_save_dir: str | None = None
    """When set, every episode saves one PNG per step under this dir."""

    max_steps: PositiveInt = 20
    """Train steps; the run ends after the last."""
    save_steps: PositiveInt = 10000
    """Checkpoint every this many steps (and after the last)."""
    logging_steps: PositiveInt = 1
    """Log metrics every this many steps."""
    eval_steps: Count = 0
    """Validate (val_env_manager, temperature 0) before every step divisible by this and after the last; 0: never."""
    val_before_train: bool = True
    """Also validate before step 0 (the warm start's held-out score); false: the first round is at step eval_steps.
    That round holds the first batch back while it plays: train admission is paused during every round."""
    val_sampled_episodes: Count = 1
    """Validation also plays each held-out map this many times sampled, as `val_sampled/...`; 0: greedy only."""
    val_sampled_maps: PositiveInt | None = None
    """Play the sampled episodes on the first this many held-out maps only (null: on every map): greedy success on
    many maps costs a round less this way (the main job: greedy on 256, sampled on 64)."""
    resume_from_checkpoint: Annotated[Any, AfterValidator(check_resume)] = False
    """false: start fresh; true: the latest checkpoint under output_dir; or a checkpoint dir .../step_<n>."""

    rollout_batch_size: Annotated[int, Field(ge=1, le=MAX_ENV_GROUPS * MAX_GROUP_SIZE)] = 64
    """Trajectories per train step; a multiple of train_env_manager.group_size."""
    sequence_length: Annotated[int, Field(ge=1, le=10_000_000)] = 2048
    """Most tokens of one trajectory (prompt and all turns); an episode that would exceed it ends (max_length)."""
    async_generation_ratio: Count = 0
    """r: generation may run r policy versions ahead of training; 0 is synchronous."""
    group_timeout_s: Annotated[float, Field(gt=0.0)] = 600.0
    """An admitted group whose members have not all arrived after this long is dropped."""
    env_worker_nice: Annotated[int, Field(ge=0, le=19)] = 0
    """Niceness of env-worker and engine-server processes (and the vLLM engine processes they start): on a host
    they share with the trainer, a positive value lets the trainer's update take its core first, while generation,
    which runs ahead, takes what the update leaves."""

    pretrain: str | None = None
    """A local Hugging Face model directory (no hub download); needed by every strategy except scripted/stats_only."""
    adv_estimator: AdvEstimator = "grpo"
    """Advantages: grpo (group-normalised score), reinforce (batch-mean baseline), gigpo (plus step-level)."""
    ppo_epochs: PositiveInt = 1
    """Passes over each batch."""
    gamma: Annotated[float, Field(ge=0.0, le=1.0)] = 1.0
    """Discount of gigpo's step-level returns."""
    pg_clip: Annotated[float, Field(gt=0.0)] = 0.2
    """PPO clip range of the policy ratio: [1 - pg_clip, 1 + pg_clip]."""
    use_pg_clip_range: bool = False
    """true: clip the ratio to [1 - pg_clip_low, 1 + pg_clip_high] instead (DAPO's clip-higher: high > low)."""
    pg_clip_low: Annotated[float, Field(gt=0.0, lt=1.0)] = 0.2
    """Clip range below 1 when use_pg_clip_range is true."""
    pg_clip_high: Annotated[float, Field(gt=0.0)] = 0.2
    """Clip range above 1 when use_pg_clip_range is true (DAPO uses 0.28 with a low of 0.2)."""
    init_kl_coef: Annotated[float, Field(ge=0.0)] = 0.0
    """k3 KL penalty to the initial weights (pretrain); 0 (and no format anchor) loads no reference model."""
    kl_anchor_valid_rate: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    """Format anchor: a step whose batch has fewer valid replies than this share (rollout/valid_action_rate) gets
    the KL penalty to pretrain at kl_anchor_coef (or init_kl_coef, if larger), so a policy that lost its reply
    format, where every group fails alike and no advantage is left, is pulled back to the warm start's format.
    Unset: off."""
    kl_anchor_coef: Annotated[float, Field(gt=0.0)] = 0.01
    """The KL coefficient of a step under kl_anchor_valid_rate, and of kl_anchor_unparsed_replies."""
    kl_anchor_unparsed_replies: bool = False
    """Format anchor on the broken replies alone: on every step, KL(pretrain || policy) over the whole vocabulary
    at kl_anchor_coef at the positions of each reply that did not parse, and at no other, so it engages from the
    first broken reply and moves a broken token however sure the policy is of it (a penalty on the sampled token's
    logprob cannot). It touches no valid reply's position, yet on a resumed run its format came back whole and
    greedy success fell from 0.83-0.86 to 0.62-0.72 (docs/learning.md; likely its pull, through the shared weights,
    towards the warm start's random actions), so it stays off."""
    format_unlikelihood_coef: Annotated[float, Field(ge=0.0)] = 0.0
    """Unlikelihood on the token that broke a reply's format: on every step, -log(1 - p) of the one token at which
    each reply that did not parse first left the reply format (`<answer>Down<answer>`: the second `<answer>`), times
    this, per response token as the policy loss. Its gradient on that token's logit is p, where a policy-gradient
    penalty's is scaled by 1 - p and all but vanishes on a token the policy is sure of; the mass it takes goes to the
    other tokens in proportion to the policy's own distribution there, not to the warm start's. 0: off."""
    format_break_ends_advantage: bool = False
    """An unparsed reply's tokens from the one that broke its format to the reply's end carry no advantage: the env
    read no action from them, so the episode's outcome says nothing of them (FrozenLake wins most episodes that hold
    a broken reply). The two format wobbles traced on machine 41, each one update that raised a breaking token at a
    format position from p ~0 to 0.1-0.3, trained on batches whose broken replies had an advantage on such tokens
    (docs/learning.md). The breaking token keeps format_unlikelihood_coef's push. Replies in the built-in format
    only."""
    format_likelihood_coef: Annotated[float, Field(ge=0.0)] = 0.0
    """Likelihood on the format of the replies that parsed: on every step, -log p of each generated token of each
    well-formed reply but the one that chose its action, and -log p(any move) at that one (the move itself is left
    to the policy gradient), times this, per response token as the policy loss. Its gradient on a token that would
    break the format at such a position is that token's p, on every valid reply: the expected push of
    format_unlikelihood_coef, which acts only on the breaks sampled, before a leak is sampled often enough to be
    seen (`consumer/learn/format_likelihood.py`). Replies in the built-in format only. 0: off (the default); the
    main job's 1.0, with format_likelihood_moves `spelled`: on machine 44 three runs alternating with three of the
    config before it read 0.86 / 0.87 / 0.88 at 15 minutes against 0.77 / 0.80 / 0.84, with 11-23 broken replies
    after step 100 against 288-912 (docs/learning.md)."""
    format_likelihood_moves: FormatMoves = "spelled"
    """Which tokens p(any move) of format_likelihood_coef sums at the action token: `spelled` (the default), the
    tokens at which the step's batch's valid replies chose their action, so that a leak into a token that begins a
    move but that no valid reply finishes (`U` for `Up`) is a leak; `begun`, every token that begins a move (on
    machine 43 three runs with it had a median 0.09 under the config before, the leak moved into `U` and ` Up`;
    docs/learning.md)."""
    fatal_move_unlikelihood_coef: Annotated[float, Field(ge=0.0)] = 0.0
    """Unlikelihood on the move that lost an episode: on every step, -log(1 - p) of the token at which the last
    reply of each episode the env ended without success (FrozenLake: a step into a hole) chose its action, times
    this and the batch's success rate, per response token as the policy loss, whatever the episode's group scored;
    `no_advantage` keeps a group with such a move. Replies in the built-in format only (not with an env's
    action_pattern). At full strength from the first step it taught a warm start that wins almost no map to walk
    into walls instead, hence the scaling (docs/learning.md). 0: off (the default; the main job sets 1.0)."""
    no_effect_unlikelihood_coef: Annotated[float, Field(ge=0.0)] = 0.0
    """Unlikelihood on moves that change nothing: on every step, -log(1 - p) of the token at which each valid move
    after which the env showed the same state (a walk into a wall) chose its action, times this and the batch's
    success rate, per response token as the policy loss, in the groups `no_advantage` keeps. Greedy decoding
    repeats such a move until the episode's moves run out (docs/learning.md, machine 36). Replies in the built-in
    format only. 0: off (the default; the main job sets 1.0)."""
    move_unlikelihood_among_moves: bool = False
    """The two terms above take for p the blamed move's share of the mass of the tokens that begin a move, not its
    probability over the vocabulary: the mass they take goes to the other moves only, not to tokens that break
    the reply format (`consumer/learn/move_share.py`). False by default; the main job sets true."""
    fatal_move_groups: FatalMoveGroups = "all"
    """Which groups `no_advantage` keeps for the fatal-move term alone (all members scored alike, one lost by its
    last move): `all`, or `at_success_rate`, that share of them given by the success of the last 256 episodes the
    filter judged, so that while the policy rarely wins, a batch fills with groups the policy gradient learns from
    and not with groups the term, scaled by the same success, barely trains (docs/learning.md)."""
    whiten_advantages: bool = False
    """Zero mean, unit variance over the batch's response tokens."""
    entropy_loss_coef: Annotated[float, Field(ge=0.0)] = 0.0
    """Entropy bonus; with entropy_target, the adaptive coefficient's start."""
    entropy_target: Annotated[float, Field(gt=0.0)] | None = None
    """Adaptive entropy bonus: the mean token entropy (nats, loss/entropy) to hold. After each step the coefficient
    moves by entropy_coef_step, up while the step's entropy was below this and down while above, within
    [0, entropy_coef_max]; a step that follows one above the target gets no bonus. Unset: entropy_loss_coef is a
    fixed bonus."""
    entropy_coef_step: Annotated[float, Field(gt=0.0)] = 2e-4
    """How far the adaptive coefficient moves per step (entropy_target)."""
    entropy_coef_max: Annotated[float, Field(gt=0.0)] = 5e-3
    """Ceiling of the adaptive coefficient (entropy_target): 0.01 as a fixed bonus blew the main job's entropy up
    to 5-7 nats within 20 steps."""
    entropy_among_moves: bool = False
    """The entropy bonus is the entropy of the moves' shares at the token where each valid reply chose its action
    (`consumer/learn/move_share.py`), not the token entropy of every response position over the vocabulary, which
    also raises, at the positions of the reply's format, the tokens that break it. The adaptive coefficient still
    reads the token entropy (loss/entropy) against entropy_target. Replies in the built-in format only."""
    adv_std_normalize: StdNormalize = "group"
    """grpo/gigpo: group divides by the group's std (floored at adv_std_floor); none keeps mean-only advantages."""
    adv_std_floor: Annotated[float, Field(gt=0.0)] = 1e-6
    """Smallest std a group's advantages are divided by; raise it (e.g. 0.1) so a tiny reward spread stays tiny."""
    adv_clip: Annotated[float, Field(gt=0.0)] | None = None
    """Clip advantages to [-adv_clip, adv_clip] after whitening; unset: no clipping."""
    gigpo_step_weight: Annotated[float, Field(ge=0.0)] = 1.0
    """gigpo: omega in A = A_episode + omega * A_step."""
    failed_group_advantage: Annotated[float, Field(le=0.0)] = 0.0
    """lambda <= 0: a group in which no member succeeded (group-relative advantage zero) is compared with the batch:
    lambda x the batch's success rate is added to every member's advantage; the no_advantage filter keeps such
    groups. 0: nothing (GRPO's)."""
    skip_zero_advantage: bool = True
    """Run no forward or backward on trajectories whose advantages are all zero (their group scored alike): their
    gradient is exactly zero, so the update is the same (mini-batches and the loss's token mean still count
    them), only faster. Has no effect beside a KL penalty or an entropy bonus, which give every row a gradient;
    false computes every row (to compare)."""
    old_logprobs: OldLogprobs = "engine"
    """PPO ratio anchor: engine (the behaviour policy's logprobs) or recompute (trainer weights before the step)."""
    is_ratio_cap: Annotated[float, Field(gt=1.0)] = 3.0
    """Truncation of the importance ratio: the dual clip for negative advantages; with recompute, the IS cap."""
    early_stop_kl: Annotated[float, Field(gt=0.0)] | None = None
    """End a train step at the first mini-batch whose approximate KL (actor/approx_kl: the trainer's weights,
    before that mini-batch's update, against the engine's logprobs) exceeds this: its gradient is discarded and
    the rest of the step is not trained, so no step takes the policy far from the one that sampled the batch.
    Unset: every mini-batch trains. Optimizer steps not taken do not advance the lr schedule. torch_train only."""

    actor_train: TrainWorkerConfig = field(default_factory=TrainWorkerConfig)
    """The trainer's role."""
    actor_infer: InferWorkerConfig = field(default_factory=InferWorkerConfig)
    """The env-workers' policy."""
    train_env_manager: EnvManagerConfig = field(default_factory=EnvManagerConfig)
    """Train envs: tags, groups and their packing into workers."""
    val_env_manager: EnvManagerConfig = field(
        default_factory=lambda: EnvManagerConfig(num_env_groups=8, group_size=1, max_env_num_per_worker=8))
    """Validation envs (group_size 1: validation is greedy)."""
    custom_envs: dict[str, CustomEnvConfig] = field(default_factory=default_custom_envs)
    """Tag -> env; the seeds' FrozenLake, SimpleSokoban, LargerSokoban, SokobanDifferentGridVocab exist by default."""
    redis: RedisConfig = field(default_factory=RedisConfig)
    """Redis connection."""
    weights_transport: WeightsTransport = "filesystem"
    """filesystem: producers read the trainer's weight dirs in place; redis: chunks in Redis for hosts without one."""
    weights_chunk_mb: Annotated[float, Field(gt=0.0)] = 8.0
    """Size of one weights chunk in Redis (weights_transport: redis)."""
    tiny_model: TinyModelConfig = field(default_factory=TinyModelConfig)
    """The offline tiny model."""
    wandb_mode: WandbMode = "offline"
    """offline writes the run under output_dir for a later `wandb sync`."""
    wandb_project: str = "rollstream"
    """wandb project name."""
    record_to: str | None = None
    """When set, the trainer appends every trajectory it trains on to this file (see `rollstream replay`)."""
    hosts: HostsConfig = field(default_factory=HostsConfig)
    """Which host runs Redis, the trainer and which env-workers (`rollstream deploy supervisor`); see hosts.py."""

    @property
    def pg_clip_range(self) -> tuple[float, float]:
        """(below 1, above 1): the PPO clip of the policy ratio."""
        if self.use_pg_clip_range:
            return self.pg_clip_low, self.pg_clip_high
        return self.pg_clip, self.pg_clip

    @property
    def groups_per_batch(self) -> int:
        """G: complete GRPO groups per train step."""
        return self.rollout_batch_size // self.train_env_manager.group_size

    def reply_tokens(self, tag: str) -> int:
        """Most tokens of one reply for `tag`: its max_tokens_per_step, capped by generating_args.max_new_tokens."""
        cap = self.actor_infer.generating_args.max_new_tokens
        per_step = self.custom_envs[tag].max_tokens_per_step
        return per_step if cap is None else min(per_step, cap)

    @cached_property
    def train_layout(self) -> Layout:
        """Which tag each train group plays and which worker runs it; computed once."""
        from rollstream.shared.layout import plan_layout

        return plan_layout(self.train_env_manager, self.custom_envs, "train_env_manager")

    @cached_property
    def val_layout(self) -> Layout:
        """The same for validation."""
        from rollstream.shared.layout import plan_layout

        return plan_layout(self.val_env_manager, self.custom_envs, "val_env_manager")

    def validates_before(self, step: int) -> bool:
        """Whether a validation round comes before train step `step`: every `eval_steps`, step 0 only with
        `val_before_train`."""
        return bool(self.eval_steps) and step % self.eval_steps == 0 and (step > 0 or self.val_before_train)

    def val_members(self, group_index: int) -> int:
        """Episodes a validation round plays on val group `group_index`: one greedy, then the sampled ones if the
        group is among the first `val_sampled_maps`."""
        sampled = self.val_sampled_maps is None or group_index < self.val_sampled_maps
        return 1 + (self.val_sampled_episodes if sampled else 0)


def load_config(path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | None,
                overrides: Sequence[str] = ()) -> RollstreamConfig:
    """YAML file(s) (optional, later over earlier) merged over the schema, then `key=value` overrides, then every
    check; ROLL's keys are read as `rollstream.shared.roll_keys` says (`config_load.load` also returns the notices)."""
    from rollstream.shared.config_load import load

    return load(path, overrides).cfg


def validate(cfg: RollstreamConfig) -> None:
    """Every check across keys (types and ranges were checked while loading)."""
    from rollstream.shared.config_checks import check_config

    check_config(cfg)  # its notices were logged when the config was loaded


def as_dict(cfg: RollstreamConfig) -> dict[str, Any]:
    """Plain containers with the Redis password redacted: for wandb, `config show` and config.yaml."""
    from pydantic import TypeAdapter

    data: dict[str, Any] = TypeAdapter(RollstreamConfig).dump_python(cfg, mode="json")
    if data["redis"]["url"]:
        data["redis"]["url"] = redact_url(data["redis"]["url"])
    return data


def to_yaml(cfg: RollstreamConfig) -> str:
    import yaml

    return yaml.safe_dump(as_dict(cfg), sort_keys=False, allow_unicode=True)


def dump_config(cfg: RollstreamConfig, path: Path) -> None:
    """Write the resolved config (password redacted: child processes get the URL from ROLLSTREAM_REDIS_URL)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_yaml(cfg))
