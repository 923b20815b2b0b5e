"""Env-worker loop throughput against its engine's raw batched generation, at the same concurrency.

    .venv/bin/python benchmarks/env_loop_throughput.py [--backend vllm|hf_infer] [--envs 64] [--seconds 30]

One process, one engine, three phases at N requests in flight:
- `env loop`: N envs play FrozenLake episodes through the real episode loop (token-in/token-out conversations,
  env steps, reply parsing); every request it makes is recorded;
- `raw engine`: N clients send exactly the recorded requests (same prompt tokens, same seeds, so the engine
  does the same work) back to back, with nothing in between: the engine's rate on the loop's own workload;
- `env loop` again, so drift of this noisy machine shows.
Tokens/s counts generated tokens of replies finished in a steady-state window (after a ramp-up, before the
clients are cancelled), so the tail of the last, long episodes counts against neither. Goal: loop >= 0.8x raw.
The first-turn-only raw rate is printed too: later turns have longer prompts, which costs the engine itself.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import tempfile
import time
from collections.abc import Coroutine
from pathlib import Path

from rollstream.producer.episode import EpisodeSpec, Sampling, play_episode
from rollstream.producer.policy.base import GenerateRequest, Generation, Policy, SamplingParams
from rollstream.producer.policy.conversation import Conversation
from rollstream.producer.policy.factory import chat_template_of
from rollstream.shared.envs.frozen_lake import FrozenLakeEnv
from rollstream.tiny_model import build_tiny_model

MAX_TOKENS = 48


class TokenMeter:
    """Wraps the policy: counts the tokens of finished replies and, when asked, records the requests."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.tokens = 0
        self.replies = 0
        self.recorded: list[GenerateRequest] | None = None

    async def generate(self, request: GenerateRequest) -> Generation:
        if self.recorded is not None:
            self.recorded.append(request)
        reply = await self.policy.generate(request)
        self.tokens += len(reply.token_ids)
        self.replies += 1
        return reply

    def __getattr__(self, name: str) -> object:  # version, tokenizer, ...: the wrapped policy's
        return getattr(self.policy, name)


async def steady_rate(meter: TokenMeter, clients: list[Coroutine[None, None, None]], seconds: float) -> float:
    """Generated tokens/s while all clients run: the window opens after the first replies (the ramp-up)
    and closes with the clients cancelled, so neither the start nor the tail of the last episodes counts."""
    tasks = [asyncio.create_task(c) for c in clients]
    try:
        await asyncio.sleep(min(5.0, seconds / 4))  # ramp-up: every client has a request in flight
        tokens, start = meter.tokens, time.monotonic()
        await asyncio.sleep(seconds)
        return (meter.tokens - tokens) / (time.monotonic() - start)
    finally:
        for t in tasks:
            t.cancel()
        done = await asyncio.gather(*tasks, return_exceptions=True)
        failures = [e for e in done if not isinstance(e, asyncio.CancelledError)]
        if failures:
            raise failures[0]


async def raw_client(meter: TokenMeter, requests: list[GenerateRequest], i: int, n: int) -> None:
    """Every n-th of `requests` from the i-th, one after another, no work in between."""
    for k in itertools.count():
        await meter.generate(requests[(i + k * n) % len(requests)])


def first_turn_requests(policy: Policy, n: int) -> list[GenerateRequest]:
    from rollstream.shared.envs.text import turn_prompt

    chat = chat_template_of(policy)
    assert chat is not None, "the benchmark needs a token-in/token-out backend"
    requests = []
    for seed in range(n):
        env = FrozenLakeEnv(max_actions_per_traj=10)
        observation, _ = env.reset(seed=seed)
        messages = [{"role": "system", "content": env.system_prompt()},
                    {"role": "user", "content": turn_prompt(1, observation, 10, MAX_TOKENS)}]
        requests.append(GenerateRequest(messages=[], prompt_ids=Conversation.start(chat, messages, 2048).prompt_ids,
                                        sampling=SamplingParams(MAX_TOKENS, 1.0, seed=seed)))
    return requests


async def env_client(meter: TokenMeter, i: int) -> None:
    """Episodes back to back through the real episode loop."""
    env, chat = FrozenLakeEnv(max_actions_per_traj=10), chat_template_of(meter.policy)
    for e in itertools.count():
        spec = EpisodeSpec("train", "FrozenLake", i, e, 0, seed=i * 7919 + e)
        await play_episode(env, meter, spec, Sampling(MAX_TOKENS), chat=chat, sequence_length=2048)  # type: ignore[arg-type]


def make_backend(name: str, model_dir: Path) -> Policy:
    if name == "vllm":
        from rollstream.producer.policy.vllm import VLLMPolicy

        return VLLMPolicy(model_dir, gpu_memory_utilization=0.1, enforce_eager=True, max_model_len=2048)
    from rollstream.producer.policy.hf import HFPolicy

    return HFPolicy(model_dir)


async def main(args: argparse.Namespace) -> None:
    n = args.envs
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "tiny", tie_word_embeddings=False)
        meter = TokenMeter(make_backend(args.backend, model_dir))
        try:
            first_turns = first_turn_requests(meter.policy, 256)
            await steady_rate(meter, [raw_client(meter, first_turns, i, n) for i in range(n)], 3)  # warm-up
            rates: dict[str, tuple[float, int]] = {}

            async def measure(phase: str, clients: list[Coroutine[None, None, None]]) -> None:
                replies = meter.replies
                rates[phase] = await steady_rate(meter, clients, args.seconds), meter.replies - replies

            meter.recorded = []
            await measure("env loop", [env_client(meter, i) for i in range(n)])
            loop_requests, meter.recorded = meter.recorded, None
            await measure("raw engine", [raw_client(meter, loop_requests, i, n) for i in range(n)])
            await measure("env loop (again)", [env_client(meter, i) for i in range(n)])
            await measure("raw, first turns only", [raw_client(meter, first_turns, i, n) for i in range(n)])
        finally:
            await meter.policy.close()
    raw = rates["raw engine"][0]
    print(f"\nbackend={args.backend} envs={n} seconds={args.seconds} max_tokens={MAX_TOKENS} "
          "(steady state: ramp-up and tail excluded)")
    print(f"{'phase':<24}{'tokens/s':>10}{'vs raw':>9}{'replies':>9}")
    for phase, (rate, replies) in rates.items():
        print(f"{phase:<24}{rate:>10.0f}{rate / raw:>9.2f}{replies:>9}")
    ratio = (rates["env loop"][0] + rates["env loop (again)"][0]) / 2 / raw
    print(f"goal: env loop >= 0.80 x raw engine: {'met' if ratio >= 0.8 else 'NOT met'} ({ratio:.2f})")


if __name__ == "__main__":  # vLLM's engine runs in a spawned process: the guard is required
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=["vllm", "hf_infer"], default="vllm")
    parser.add_argument("--envs", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=30.0)
    asyncio.run(main(parser.parse_args()))
