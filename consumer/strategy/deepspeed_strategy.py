"""`deepspeed_train`: the policy in a DeepSpeed ZeRO engine (stage 1, 2 or 3) with torch's AdamW.

It runs in one process: on CPU (CI, these machines) over gloo, or on one GPU over nccl. DeepSpeedCPUAdam would
need a C++ build, so the optimizer is torch's AdamW (`torch_adam`), which also makes a step here equal to a
`torch_train` step up to float rounding (the tests check it).

Gradient accumulation is unmanaged (`managed_gradient_accumulation: false`): the PPO loop calls backward once
per micro-batch, with losses it already scaled (micro-batches are sized by a token budget, so their number
varies from step to step and DeepSpeed's fixed `gradient_accumulation_steps` cannot describe them), and step()
is the accumulation boundary.

What the multi-rank path (several GPUs, `deepspeed --num_gpus N`) still needs, and why it is refused here:
1. Rank 0 alone reads the stream and assembles the batch; it computes the advantages and the TokenBatch, splits
   the rows into one shard per rank (balanced by tokens) and scatters them (torch.distributed scatter_object_list
   or broadcast of the padded tensors). Ranks other than 0 run a loop that receives a shard, calls the same
   `ppo_update`, and waits for the next one or a stop message.
2. Every rank must call backward the same number of times per optimizer step (ZeRO-2 reduces gradients in the
   backward hooks): the micro-batch plan must be agreed (e.g. all_reduce the max count and pad with empty
   micro-batches), and the loss normalizer must be the token count of the whole mini-batch over all ranks
   (all_reduce it), or ranks with fewer tokens get more weight.
3. Mini-batches are per rank: per_device_train_batch_size x gradient_accumulation_steps x world_size rows per
   optimizer step, and the lr schedule's total steps must count them that way.
4. Publication and checkpoints: all ranks enter `publish_weights` (ZeRO-3 gathers parameters collectively),
   rank 0 writes; `engine.save_checkpoint` is called by all ranks into a shared directory.
5. The reference model for the KL penalty is replicated on every rank; for large models it should itself be a
   ZeRO-3 inference engine.
None of this can be exercised without several GPUs, so WORLD_SIZE > 1 is an error rather than an untested path.
"""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path
from typing import Any

import deepspeed
import torch

from consumer.strategy import ModelSettings, OptimSettings, load_model, make_scheduler
from shared.config import ConfigError
from shared.weights_io import save_pretrained_atomically

ZERO_STAGES = (1, 2, 3)
CHECKPOINT_TAG = "state"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_single_process() -> None:
    """Start (once per process) a one-process torch.distributed group for DeepSpeed.

    DeepSpeed reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT from the environment (its engine
    asserts LOCAL_RANK even with an init_method), so they are set here unless a launcher already did. The group
    lives as long as the process: DeepSpeed caches its process groups module-wide (deepspeed.utils.groups), so
    an engine built after the group was destroyed and re-created fails with "Group ... is not registered".
    A one-process gloo group holds a TCP store socket and nothing else.
    """
    if not torch.distributed.is_initialized() and "WORLD_SIZE" not in os.environ:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                          LOCAL_RANK="0")
    world_size = (torch.distributed.get_world_size() if torch.distributed.is_initialized()
                  else int(os.environ["WORLD_SIZE"]))
    if world_size != 1:
        raise ConfigError(f"deepspeed_train runs in one process for now (WORLD_SIZE={world_size}); "
                          "see consumer/strategy/deepspeed_strategy.py for what the multi-rank path needs")
    cuda = torch.cuda.is_available()
    if not cuda:
        # On CPU DeepSpeed JIT-compiles a shared-memory allreduce the first time a group starts (about 75 s with
        # a C++ compiler, a crash without one). It only speeds up collectives between ranks of one host, and a
        # one-process group has none, so it is marked unavailable; the probe result is a module-level dict that
        # DeepSpeed keeps for exactly this kind of override.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", verbose=False)


def ds_config(model: ModelSettings, optim: OptimSettings, zero_stage: int, micro_batch_size: int) -> dict[str, Any]:
    return {
        # Nominal: with unmanaged accumulation these only feed DeepSpeed's sample counters.
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "zero_optimization": {"stage": zero_stage},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": optim.learning_rate, "betas": list(optim.betas), "eps": optim.eps,
                       "weight_decay": optim.weight_decay, "torch_adam": True},
        },
        "gradient_clipping": optim.max_grad_norm,
        "bf16": {"enabled": model.dtype == "bf16"},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


class DeepSpeedStrategy:
    def __init__(self, model: ModelSettings, optim: OptimSettings, *, zero_stage: int = 2,
                 micro_batch_size: int = 1) -> None:
        if zero_stage not in ZERO_STAGES:
            raise ConfigError(f"actor_train.strategy_args.strategy_config.zero_stage={zero_stage!r}: must be one of "
                              f"{', '.join(map(str, ZERO_STAGES))}")
        self.zero_stage = zero_stage
        init_single_process()
        module = load_model(model)
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=module,
            model_parameters=module.parameters(),
            config=ds_config(model, optim, zero_stage, micro_batch_size),
            lr_scheduler=lambda opt: make_scheduler(opt, optim),
            dist_init_required=False,
        )
        self.model = self.engine.module
        self.device = torch.device(self.engine.device)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        out = self.engine(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return out.logits  # type: ignore[no-any-return]

    def backward(self, loss: torch.Tensor) -> None:
        # The caller already divided by the mini-batch's token count: no further scaling.
        self.engine.backward(loss, scale_wrt_gas=False)

    def optimizer_step(self) -> float:
        self.engine.step()  # clips to gradient_clipping, steps the optimizer and the lr schedule, zeroes grads
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    @property
    def lr(self) -> float:
        return float(self.engine.get_lr()[0])

    def publish_weights(self, final_dir: Path, tokenizer: Any) -> str:
        # ZeRO-1/2 keep full parameters on every rank; ZeRO-3 partitions them, so gather first (all ranks).
        gather = (deepspeed.zero.GatheredParameters(list(self.model.parameters()), modifier_rank=None)
                  if self.zero_stage == 3 else contextlib.nullcontext())
        with gather:
            return save_pretrained_atomically(self.model, final_dir, tokenizer=tokenizer)

    def save_checkpoint(self, directory: Path) -> None:
        self.engine.save_checkpoint(str(directory), tag=CHECKPOINT_TAG, save_latest=False)

    def load_checkpoint(self, directory: Path) -> None:
        path, _ = self.engine.load_checkpoint(str(directory), tag=CHECKPOINT_TAG, load_optimizer_states=True,
                                              load_lr_scheduler_states=True)
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint under {str(directory)!r} (tag {CHECKPOINT_TAG!r})")

    def close(self) -> None:
        # The engine's hooks and buffers go; the process group stays (see `init_single_process`).
        destroy = getattr(self.engine, "destroy", None)
        if destroy is not None:
            destroy()
