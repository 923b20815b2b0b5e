"""Env-worker loop throughput against its engine's raw batched generation, at the same concurrency.

    .venv/bin/python benchmarks/env_loop_throughput.py [--backend vllm|hf_infer] [--envs 64] [--seconds 30]

Both phases run in one process on one engine: `raw` keeps N generate calls in flight on fixed first-turn prompts;
`loop` runs N envs through the real episode loop (FrozenLake, token-in/token-out conversations, env steps).
Tokens/s counts generated tokens only. Goal: loop / raw >= 0.8.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import numpy as np

from producer.envs.frozen_lake import FrozenLakeEnv
from producer.episode import EpisodeSpec, Sampling, play_episode
from producer.policy.base import GenerateRequest, Policy, SamplingParams
from producer.policy.conversation import Conversation
from producer.policy.factory import chat_template_of
from producer.policy.tiny_model import build_tiny_model

MAX_TOKENS = 48


async def raw_rate(policy: Policy, prompts: list[np.ndarray], concurrency: int, seconds: float) -> float:
    """Generated tokens/s with `concurrency` requests always in flight, no env work in between."""
    generated = 0
    deadline = time.monotonic() + seconds

    async def client(i: int) -> None:
        nonlocal generated
        k = 0
        while time.monotonic() < deadline:
            request = GenerateRequest(messages=[], prompt_ids=prompts[(i + k) % len(prompts)],
                                      sampling=SamplingParams(MAX_TOKENS, 1.0, seed=i * 1000 + k))
            generated += len((await policy.generate(request)).token_ids)
            k += 1

    start = time.monotonic()
    await asyncio.gather(*(client(i) for i in range(concurrency)))
    return generated / (time.monotonic() - start)


async def loop_rate(policy: Policy, envs: int, seconds: float) -> tuple[float, int]:
    """Generated tokens/s of `envs` env loops playing episodes back to back; also the episodes played."""
    chat = chat_template_of(policy)
    generated, episodes = 0, 0
    deadline = time.monotonic() + seconds

    async def env_loop(i: int) -> None:
        nonlocal generated, episodes
        env, e = FrozenLakeEnv(max_actions_per_traj=10), 0
        while time.monotonic() < deadline:
            spec = EpisodeSpec("train", "FrozenLake", i, e, 0, seed=i * 7919 + e)
            traj = await play_episode(env, policy, spec, Sampling(MAX_TOKENS), chat=chat, sequence_length=2048)
            generated += int(traj.response_mask.sum())
            episodes += 1
            e += 1

    start = time.monotonic()
    await asyncio.gather(*(env_loop(i) for i in range(envs)))
    return generated / (time.monotonic() - start), episodes


def first_turn_prompts(policy: Policy, n: int) -> list[np.ndarray]:
    from producer.envs.text import turn_prompt

    chat = chat_template_of(policy)
    assert chat is not None, "the benchmark needs a token-in/token-out backend"
    prompts = []
    for seed in range(n):
        env = FrozenLakeEnv(max_actions_per_traj=10)
        observation, _ = env.reset(seed=seed)
        messages = [{"role": "system", "content": env.system_prompt()},
                    {"role": "user", "content": turn_prompt(1, observation, 10, MAX_TOKENS)}]
        prompts.append(Conversation.start(chat, messages, 2048).prompt_ids)
    return prompts


def make_backend(name: str, model_dir: Path) -> Policy:
    if name == "vllm":
        from producer.policy.vllm import VLLMPolicy

        return VLLMPolicy(model_dir, gpu_memory_utilization=0.1, enforce_eager=True, max_model_len=2048)
    from producer.policy.hf import HFPolicy

    return HFPolicy(model_dir)


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "tiny", tie_word_embeddings=False)
        policy = make_backend(args.backend, model_dir)
        try:
            prompts = first_turn_prompts(policy, 256)
            await raw_rate(policy, prompts, args.envs, 3)  # warm-up
            raw = await raw_rate(policy, prompts, args.envs, args.seconds)
            loop, episodes = await loop_rate(policy, args.envs, args.seconds)
            raw_again = await raw_rate(policy, prompts, args.envs, args.seconds)  # brackets the loop: drift shows
        finally:
            await policy.close()
    baseline = (raw + raw_again) / 2
    print(f"\nbackend={args.backend} envs={args.envs} seconds={args.seconds} max_tokens={MAX_TOKENS}")
    print(f"{'phase':<22}{'tokens/s':>10}{'vs raw':>9}")
    print(f"{'raw engine (before)':<22}{raw:>10.0f}{raw / baseline:>9.2f}")
    print(f"{'env loop':<22}{loop:>10.0f}{loop / baseline:>9.2f}   ({episodes} episodes)")
    print(f"{'raw engine (after)':<22}{raw_again:>10.0f}{raw_again / baseline:>9.2f}")
    print(f"goal: env loop >= 0.80 x raw: {'met' if loop / baseline >= 0.8 else 'NOT met'}")


if __name__ == "__main__":  # vLLM's engine runs in a spawned process: the guard is required
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=["vllm", "hf_infer"], default="vllm")
    parser.add_argument("--envs", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=30.0)
    asyncio.run(main(parser.parse_args()))
