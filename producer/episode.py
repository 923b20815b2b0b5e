"""One env's multi-turn loop: reset, ask the policy, step the env, repeat; the result is a Trajectory."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from producer.envs.base import TextEnv
from producer.envs.render import save_frame
from producer.envs.text import turn_prompt
from producer.policy.base import GenerateRequest, Policy, SamplingParams
from shared.schema import Trajectory, Turn, make_group_id, make_traj_id
from shared.seeding import turn_seed


@dataclass(frozen=True)
class EpisodeSpec:
    mode: str
    tag: str
    group_index: int
    episode: int
    member: int
    seed: int
    worker_rank: int = 0

    @property
    def group_id(self) -> str:
        return make_group_id(self.mode, self.tag, self.group_index, self.episode)


@dataclass(frozen=True)
class Sampling:
    """Per-tag generation settings for one episode."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1


async def play_episode(env: TextEnv, policy: Policy, spec: EpisodeSpec, sampling: Sampling,
                       render_dir: Path | None = None, on_turn: Callable[[Turn], None] | None = None) -> Trajectory:
    observation, _ = env.reset(seed=spec.seed)
    messages = [{"role": "system", "content": env.system_prompt()}]
    turns: list[Turn] = []
    score, success, end_reason = 0.0, False, "max_actions"
    frames = _FrameWriter(render_dir, spec, env)
    for t in range(env.max_actions_per_traj):
        messages.append({"role": "user", "content": turn_prompt(t + 1, observation, env.actions_left,
                                                                sampling.max_tokens)})
        request = GenerateRequest(
            messages=list(messages),
            sampling=SamplingParams(sampling.max_tokens, sampling.temperature, sampling.top_p, sampling.top_k,
                                    seed=turn_seed(spec.seed, spec.member, t)),
            action_names=env.action_names,
        )
        generation = await policy.generate(request)
        messages.append({"role": "assistant", "content": generation.text})
        next_observation, reward, terminated, truncated, info = env.step(generation.text)
        turns.append(Turn(generation.version, observation, generation.text, info["action"],
                          bool(info["action_is_valid"]), float(reward), finish_reason=generation.finish_reason))
        frames.save(t + 1)
        if on_turn is not None:
            on_turn(turns[-1])
        score += reward
        success = bool(info["success"])
        observation = next_observation
        if terminated or truncated:
            end_reason = "terminated" if terminated else "truncated"
            break
    return Trajectory(
        traj_id=make_traj_id(spec.group_id, spec.member), group_id=spec.group_id, mode=spec.mode, tag=spec.tag,
        group_index=spec.group_index, episode=spec.episode, member=spec.member, seed=spec.seed, turns=turns,
        score=score, success=success, end_reason=end_reason, worker_rank=spec.worker_rank, created_at=time.time(),
    )


class _FrameWriter:
    """One PNG per step under render_dir/<group id>/m<member>/, when rendering is on."""

    def __init__(self, render_dir: Path | None, spec: EpisodeSpec, env: TextEnv) -> None:
        self.env = env
        self.dir = None if render_dir is None else Path(render_dir) / spec.group_id / f"m{spec.member}"
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)
            self.save(0)

    def save(self, step: int) -> None:
        if self.dir is not None:
            save_frame(self.env.render_rgb(), self.dir / f"step{step:03d}.png")
