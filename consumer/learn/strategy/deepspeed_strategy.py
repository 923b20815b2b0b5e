"""`deepspeed_train`: the policy in a DeepSpeed ZeRO engine (stage 1, 2 or 3) with torch's AdamW.

It runs in one process or on several ranks: on CPU (CI, these machines) over gloo, on GPUs over nccl.
DeepSpeedCPUAdam would need a C++ build, so the optimizer is torch's AdamW (`torch_adam`), which also makes a step
here equal to a `torch_train` step up to float rounding (the tests check it).

Gradient accumulation is unmanaged (`managed_gradient_accumulation: false`): the PPO loop calls backward once
per micro-batch, with losses it already scaled (micro-batches are sized by a token budget, so their number
varies from step to step and DeepSpeed's fixed `gradient_accumulation_steps` cannot describe them), and step()
is the accumulation boundary.

Several ranks: under a launcher (`torchrun --nproc_per_node N`, `deepspeed --num_gpus N`), which sets RANK and
WORLD_SIZE, every rank builds the same engine; `distributed` has rank 0 read the stream and plan each update, and
every rank run its shard of it. What this strategy adds for that:
- DeepSpeed averages gradients over the ranks, but the PPO loop already divides each rank's loss by the token
  count of the whole mini-batch (all ranks), so the gradient wanted is the sum: `backward` scales by world size.
- `publish_weights` is entered by all ranks (ZeRO-3 gathers collectively) and written by rank 0 alone;
  `save_checkpoint` / `load_checkpoint` are called by all ranks on the same directory (each writes its optimizer
  partition), so with several hosts `output_dir` must be a shared filesystem.
- The reference model for the KL penalty is replicated on every rank; for large models it should itself be a
  ZeRO-3 inference engine (not done).
"""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path
from typing import Any

import deepspeed
import torch
from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address

from rollstream.consumer.learn.strategy import (
    ModelSettings,
    OptimSettings,
    causal_lm_logits,
    load_model,
    make_scheduler,
)
from rollstream.shared.config import ConfigError, ZeroStage, choices
from rollstream.shared.weights_io import save_pretrained_atomically

ZERO_STAGES = choices(ZeroStage)
CHECKPOINT_TAG = "state"

CHECKPOINT_CLASSES = [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]
"""What DeepSpeed's checkpoints name besides tensors and containers (read off their pickles, ZeRO 1-3)."""


class SafeLoadingCheckpointEngine(TorchCheckpointEngine):
    """DeepSpeed's own checkpoint files (torch.save: a pickle inside a zip), read with `weights_only=True`.

    DeepSpeed loads them with weights_only=False, which runs whatever a file names. Its state holds objects of its
    own (the ZeRO stage enum, the loss scaler, fragment addresses), so it cannot be written without pickle short of
    replacing its checkpointing; reading is restricted instead: the unpickler builds tensors, containers and the
    classes above, and refuses a file that names anything else."""

    def load(self, path: str, map_location: Any = None) -> Any:
        with torch.serialization.safe_globals(CHECKPOINT_CLASSES):
            return torch.load(path, map_location=map_location, weights_only=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_distributed() -> None:
    """Start (once per process) the torch.distributed group DeepSpeed runs in: the launcher's ranks, or one
    process of its own when nothing launched it.

    DeepSpeed reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT from the environment (its engine
    asserts LOCAL_RANK even with an init_method), so without a launcher they are set here for one process. The
    group lives as long as the process: DeepSpeed caches its process groups module-wide (deepspeed.utils.groups),
    so an engine built after the group was destroyed and re-created fails with "Group ... is not registered".
    A one-process gloo group holds a TCP store socket and nothing else.
    """
    if not torch.distributed.is_initialized() and "WORLD_SIZE" not in os.environ:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                          LOCAL_RANK="0")
    cuda = torch.cuda.is_available()
    if not cuda:
        # On CPU DeepSpeed JIT-compiles a shared-memory allreduce the first time a group starts (about 75 s with
        # a C++ compiler, a crash without one). It only speeds up collectives between ranks of one host: a
        # one-process group has none, and gloo does them correctly (if slower) for several CPU ranks. So it is
        # marked unavailable; the probe result is a module-level dict DeepSpeed keeps for this kind of override.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if cuda and "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", verbose=False)


def world_size() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def is_rank_zero() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


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
        init_distributed()
        module = load_model(model)
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=module,
            model_parameters=module.parameters(),
            config=ds_config(model, optim, zero_stage, micro_batch_size),
            lr_scheduler=lambda opt: make_scheduler(opt, optim),
            dist_init_required=False,
        )
        if type(self.engine.checkpoint_engine) is TorchCheckpointEngine:  # the default; others are left alone
            self.engine.checkpoint_engine = SafeLoadingCheckpointEngine(self.engine._config)
        self.model = self.engine.module
        self.device = torch.device(self.engine.device)
        self.world_size = world_size()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        return causal_lm_logits(self.engine, self.model.get_output_embeddings(), input_ids, attention_mask,
                                positions)

    def backward(self, loss: torch.Tensor) -> None:
        # The caller already divided by the token count of the whole mini-batch (all ranks), so the gradient
        # wanted is the sum over ranks; DeepSpeed averages, hence the factor (exact for powers of two).
        self.engine.backward(loss * self.world_size if self.world_size > 1 else loss, scale_wrt_gas=False)

    def optimizer_step(self) -> float:
        self.engine.step()  # clips to gradient_clipping, steps the optimizer and the lr schedule, zeroes grads
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def discard_gradients(self) -> None:
        # ZeRO keeps reduced gradients in its own partitioned buffers, which only its step consumes and clears.
        raise NotImplementedError("early_stop_kl needs torch_train: DeepSpeed has no supported way to drop the "
                                  "gradients of a mini-batch without stepping")

    @property
    def lr(self) -> float:
        return float(self.engine.get_lr()[0])

    def publish_weights(self, final_dir: Path, tokenizer: Any) -> str:
        """Called by every rank; rank 0 writes and returns the digest, the others return ""."""
        # ZeRO-1/2 keep full parameters on every rank; ZeRO-3 partitions them, so gather first (all ranks).
        gather = (deepspeed.zero.GatheredParameters(list(self.model.parameters()), modifier_rank=None)
                  if self.zero_stage == 3 else contextlib.nullcontext())
        with gather:
            return save_pretrained_atomically(self.model, final_dir, tokenizer=tokenizer) if is_rank_zero() else ""

    def save_checkpoint(self, directory: Path) -> None:
        self.engine.save_checkpoint(str(directory), tag=CHECKPOINT_TAG, save_latest=False)

    def load_checkpoint(self, directory: Path) -> None:
        path, _ = self.engine.load_checkpoint(str(directory), tag=CHECKPOINT_TAG, load_optimizer_states=True,
                                              load_lr_scheduler_states=True)
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint under {str(directory)!r} (tag {CHECKPOINT_TAG!r})")

    def close(self) -> None:
        # The engine's hooks and buffers go; the process group stays (see `init_distributed`).
        destroy = getattr(self.engine, "destroy", None)
        if destroy is not None:
            destroy()
