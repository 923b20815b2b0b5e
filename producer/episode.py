"""One env's multi-turn loop: reset, ask the policy, step the env, repeat; the result is a Trajectory."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np

from rollstream.producer.env_calls import call_env
from rollstream.producer.policy.base import GenerateRequest, Generation, Policy, SamplingParams
from rollstream.producer.policy.conversation import ChatTemplateDeltas, Conversation
from rollstream.shared.config import GeneratingArgs
from rollstream.shared.envs.base import TextEnv
from rollstream.shared.envs.render import save_frame
from rollstream.shared.schema import Trajectory, Turn, make_group_id, make_traj_id
from rollstream.shared.seeding import turn_seed


@dataclass(frozen=True)
class EpisodeSpec:
    mode: str
    tag: str
    group_index: int
    episode: int
    member: int
    seed: int
    worker_rank: int = 0
    admission_version: int = 0
    """The published version when the episode was admitted: no turn may come from older weights."""

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
    bad_words: tuple[str, ...] = ()

    @classmethod
    def training(cls, max_tokens: int, gen: GeneratingArgs) -> Sampling:
        """The settings train episodes sample with (actor_infer.generating_args); as in ROLL, max_new_tokens caps
        the tag's max_tokens_per_step."""
        if gen.max_new_tokens is not None:
            max_tokens = min(max_tokens, gen.max_new_tokens)
        return cls(max_tokens, gen.temperature, gen.top_p, gen.top_k, tuple(gen.bad_words))

    @classmethod
    def greedy(cls, max_tokens: int, gen: GeneratingArgs) -> Sampling:
        """Validation's greedy member: temperature 0, and the same banned words as training (the same policy)."""
        return cls(max_tokens, temperature=0.0, bad_words=tuple(gen.bad_words))


async def play_episode(env: TextEnv, policy: Policy, spec: EpisodeSpec, sampling: Sampling,
                       render_dir: Path | None = None, on_turn: Callable[[Turn], None] | None = None,
                       chat: ChatTemplateDeltas | None = None, sequence_length: int = 0,
                       step_timeout_s: float | None = None) -> Trajectory:
    """Play one episode. With `chat` (token-in/token-out policies) the conversation is kept as token ids,
    capped at `sequence_length`; without it (the scripted policy) as messages only. With `step_timeout_s`
    the env's reset and steps run on a thread, each within that many seconds or EnvStepTimeout is raised;
    without it they run on the event loop."""
    where = f"(limit: custom_envs.{spec.tag}.step_timeout_s)"
    observation, _ = await call_env(partial(env.reset, seed=spec.seed), step_timeout_s,
                                    f"the {spec.tag} env's reset {where}")
    transcript = _Transcript(env.system_prompt(), chat, sequence_length)
    turns: list[Turn] = []
    score, success, end_reason = 0.0, False, "max_actions"
    frames = _FrameWriter(render_dir, spec, env)
    for t in range(env.max_actions_per_traj):
        user = env.turn_message(t + 1, observation, sampling.max_tokens)
        if not transcript.add_user(user):
            end_reason = "max_length"
            break
        request = GenerateRequest(
            messages=list(transcript.messages),
            sampling=SamplingParams(transcript.reply_budget(sampling.max_tokens), sampling.temperature,
                                    sampling.top_p, sampling.top_k, seed=turn_seed(spec.seed, spec.member, t),
                                    bad_words=sampling.bad_words),
            prompt_ids=transcript.prompt_ids,
            action_names=env.action_names,
            min_version=spec.admission_version,
        )
        generation = await policy.generate(request)
        span = transcript.add_reply(generation)
        next_observation, reward, terminated, truncated, info = await call_env(
            partial(env.step, generation.text), step_timeout_s, f"the {spec.tag} env's step {t + 1} {where}")
        turns.append(Turn(generation.version, observation, generation.text, info["action"],
                          bool(info["action_is_valid"]), float(reward), span, generation.finish_reason))
        frames.save(t + 1)
        if on_turn is not None:
            on_turn(turns[-1])
        score += reward
        success = bool(info["success"])
        observation = next_observation
        if terminated or truncated:
            end_reason = "terminated" if terminated else "truncated"
            break
    input_ids, response_mask, logprobs = transcript.arrays()
    return Trajectory(
        traj_id=make_traj_id(spec.group_id, spec.member), group_id=spec.group_id, mode=spec.mode, tag=spec.tag,
        group_index=spec.group_index, episode=spec.episode, member=spec.member, seed=spec.seed, turns=turns,
        score=score, success=success, end_reason=end_reason, worker_rank=spec.worker_rank, created_at=time.time(),
        input_ids=input_ids, response_mask=response_mask, logprobs=logprobs,
    )


class _Transcript:
    """The conversation as chat messages, and as token ids when the policy is token-in/token-out."""

    def __init__(self, system: str, chat: ChatTemplateDeltas | None, sequence_length: int) -> None:
        self.messages = [{"role": "system", "content": system}]
        self.chat = chat
        self.sequence_length = sequence_length
        self.tokens: Conversation | None = None

    def add_user(self, content: str) -> bool:
        """False when the turn does not fit under sequence_length: the episode ends with max_length."""
        if self.chat is not None:
            if self.tokens is None:
                self.tokens = Conversation.start(self.chat, [*self.messages, {"role": "user", "content": content}],
                                                 self.sequence_length)
                if self.tokens.over_length:
                    return False
            elif not self.tokens.add_user(content):
                return False
        self.messages.append({"role": "user", "content": content})
        return True

    @property
    def prompt_ids(self) -> np.ndarray | None:
        return None if self.tokens is None else self.tokens.prompt_ids

    def reply_budget(self, max_tokens: int) -> int:
        return max_tokens if self.tokens is None else self.tokens.reply_budget(max_tokens)

    def add_reply(self, generation: Generation) -> tuple[int, int]:
        self.messages.append({"role": "assistant", "content": generation.text})
        if self.tokens is None:
            return (0, 0)
        self.tokens.add_response(generation)
        return self.tokens.spans[-1]

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self.tokens is None:
            return np.zeros(0, np.int32), np.zeros(0, np.uint8), np.zeros(0, np.float32)
        return self.tokens.arrays()


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
