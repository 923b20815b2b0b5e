"""`rollstream debug-env`: one env's multi-turn loop in one process, every prompt, reply, action and reward shown.

The seeds' local debugging mode: no Redis, no trainer. `--policy human` reads each reply from the keyboard.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from rollstream.producer.episode import EpisodeSpec, Sampling, play_episode
from rollstream.producer.policy.base import GenerateRequest, Generation, Policy
from rollstream.producer.policy.factory import chat_template_of, make_policy
from rollstream.producer.policy.scripted import ScriptedPolicy
from rollstream.shared.config import RollstreamConfig
from rollstream.shared.envs.registry import make_env
from rollstream.shared.schema import Trajectory, Turn


class HumanPolicy:
    """Replies typed at the terminal; an empty line plays nothing (and costs the format penalty)."""

    def __init__(self, stdin: TextIO = sys.stdin) -> None:
        self.stdin = stdin

    version = 0

    async def generate(self, request: GenerateRequest) -> Generation:
        print(f"your reply (e.g. <answer>{request.action_names[0]}</answer>): ", end="", flush=True)
        line = await asyncio.to_thread(self.stdin.readline)
        return Generation(text=line.strip())

    async def load_weights(self, version: int, uri: str, digest: str) -> None:
        pass

    async def close(self) -> None:
        pass


class _Narrated:
    """Prints every prompt the policy is asked and the reply it gives."""

    def __init__(self, inner: Policy, out: TextIO) -> None:
        self.inner, self.out = inner, out

    @property
    def version(self) -> int:
        return self.inner.version

    async def generate(self, request: GenerateRequest) -> Generation:
        print(f"\n--- user ---\n{request.messages[-1]['content']}", file=self.out)
        generation = await self.inner.generate(request)
        print(f"--- reply ---\n{generation.text}", file=self.out)
        return generation

    async def load_weights(self, version: int, uri: str, digest: str) -> None:
        await self.inner.load_weights(version, uri, digest)

    async def close(self) -> None:
        await self.inner.close()


def debug_env(cfg: RollstreamConfig, tag: str, policy_name: str, seed: int, out: TextIO = sys.stdout) -> Trajectory:
    env = make_env(tag, cfg.custom_envs)
    policies: dict[str, Callable[[], Policy]] = {"scripted": ScriptedPolicy, "human": HumanPolicy,
                                                 "llm": lambda: make_policy(cfg)}
    policy = policies[policy_name]()
    print(f"=== {tag} (seed {seed}, policy {policy_name}) ===\n--- system ---\n{env.system_prompt()}", file=out)

    def show(turn: Turn) -> None:
        print(f"--- env --- action={turn.action} valid={turn.action_is_valid} reward={turn.reward:+.2f}", file=out)

    spec = EpisodeSpec("train", tag, 0, 0, 0, seed)
    render_dir = Path(cfg.render_save_dir) if cfg.render_save_dir else None
    sampling = Sampling.training(cfg.custom_envs[tag].max_tokens_per_step, cfg.actor_infer.generating_args)

    async def play() -> Trajectory:
        narrated = _Narrated(policy, out)
        try:
            return await play_episode(env, narrated, spec, sampling, render_dir, show,
                                      chat=chat_template_of(policy), sequence_length=cfg.sequence_length)
        finally:
            await narrated.close()

    traj = asyncio.run(play())
    print(f"\n=== {traj.end_reason}: score {traj.score:+.2f}, success {traj.success}, "
          f"{len(traj.turns)} turns, {traj.num_actions} valid actions ===", file=out)
    return traj

