"""Trajectories sampled from a real tiny model, and the configs and batches the learner tests share."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollstream.consumer.data.assembler import Group
from rollstream.consumer.data.batcher import Batch
from rollstream.shared.config import RollstreamConfig, load_config
from rollstream.shared.schema import Trajectory, Turn, make_group_id, make_traj_id

Reward = Callable[[list[int]], float]
"""Reward of one reply from its token ids."""


def learner_config(tmp_path: Path, model_dir: Path, strategy: str, *overrides: str) -> RollstreamConfig:
    """A config training `model_dir` with `strategy` on CPU, writing under tmp_path."""
    device = ["actor_train.strategy_args.strategy_config={device: cpu}"] if strategy == "torch_train" else []
    return load_config(None, [
        f"output_dir={tmp_path / 'out'}", f"pretrain={model_dir}", "wandb_mode=disabled",
        f"actor_train.strategy_args.strategy_name={strategy}", *device,
        "rollout_batch_size=8", "train_env_manager.group_size=4", "train_env_manager.num_env_groups=2",
        "train_env_manager.max_env_num_per_worker=8",
        "actor_train.training_args.learning_rate=1e-3", "actor_train.training_args.per_device_train_batch_size=4",
        *overrides,
    ])


def even_first_token(reply: list[int]) -> float:
    """The rule the learner tests reward: a reply that starts with an even token id."""
    return 1.0 if reply and reply[0] % 2 == 0 else 0.0


class TinySampler:
    """Samples replies from a tiny model at temperature 1 and records their raw logprobs, as an engine does."""

    def __init__(self, model_dir: Path, seed: int = 0) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.generator = torch.Generator().manual_seed(seed)
        self.eos = self.tokenizer.eos_token_id

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def first_prompt(self, observation: str) -> list[int]:
        messages = [{"role": "system", "content": "You walk on a frozen lake."},
                    {"role": "user", "content": observation}]
        return self.encode(self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))

    def user_turn(self, observation: str) -> list[int]:
        return self.encode(f"\n<|im_start|>user\n{observation}<|im_end|>\n<|im_start|>assistant\n")

    @torch.no_grad()
    def sample(self, prefixes: Sequence[list[int]], max_tokens: int) -> list[tuple[list[int], list[float]]]:
        """One reply per prefix (all prefixes the same length): its token ids (up to and with eos) and logprobs."""
        ids = torch.tensor([list(p) for p in prefixes])
        tokens, logprobs = [], []
        for _ in range(max_tokens):
            logp = self.model(ids).logits[:, -1].float().log_softmax(-1)
            chosen = torch.multinomial(logp.exp(), 1, generator=self.generator)
            tokens.append(chosen[:, 0])
            logprobs.append(logp.gather(1, chosen)[:, 0])
            ids = torch.cat([ids, chosen], dim=1)
        out = []
        for row in range(len(prefixes)):
            toks = [int(t[row]) for t in tokens]
            end = toks.index(self.eos) + 1 if self.eos in toks else len(toks)
            out.append((toks[:end], [float(lp[row]) for lp in logprobs[:end]]))
        return out

    @torch.no_grad()
    def reply_logprob(self, traj: Trajectory, model: torch.nn.Module | None = None) -> float:
        """Sum of the logprobs of every generated token of `traj` under `model` (default: the sampler's)."""
        model = model or self.model
        ids = torch.from_numpy(np.array(traj.input_ids, dtype=np.int64))[None]  # a copy: decoded arrays are read-only
        logp = model(ids).logits[0, :-1].float().log_softmax(-1).gather(1, ids[0, 1:, None])[:, 0]
        return float((logp * torch.from_numpy(np.array(traj.response_mask[1:], dtype=np.float32))).sum())


def make_trajectory(group_index: int, member: int, input_ids: list[int], spans: list[tuple[int, int]],
                    logprobs: dict[int, float], turns: list[tuple[str, float]], version: int = 0) -> Trajectory:
    """A Trajectory from token ids, reply spans, each generated token's logprob and (observation, reward) per turn."""
    group_id = make_group_id("train", "FrozenLake", group_index, 0)
    mask = np.zeros(len(input_ids), np.uint8)
    lps = np.zeros(len(input_ids), np.float32)
    for start, end in spans:
        mask[start:end] = 1
    for pos, lp in logprobs.items():
        lps[pos] = lp
    turn_objs = [Turn(version, obs, "", None, True, reward, span) for (obs, reward), span in zip(turns, spans)]
    score = sum(r for _, r in turns)
    return Trajectory(
        traj_id=make_traj_id(group_id, member), group_id=group_id, mode="train", tag="FrozenLake",
        group_index=group_index, episode=0, member=member, seed=0, turns=turn_objs, score=score,
        success=score > 0, end_reason="terminated", input_ids=np.asarray(input_ids, np.int32), response_mask=mask,
        logprobs=lps,
    )


def sample_single_turn_groups(sampler: TinySampler, groups: int, group_size: int, reward: Reward,
                              max_tokens: int = 6) -> list[list[Trajectory]]:
    """`groups` GRPO groups of one-turn episodes; each group shares its prompt, replies are sampled."""
    out = []
    for g in range(groups):
        observation = f"Turn 1\nState:\nP_{'_' * g}\n_G"
        prompt = sampler.first_prompt(observation)
        group = []
        for member, (reply, lps) in enumerate(sampler.sample([prompt] * group_size, max_tokens)):
            start = len(prompt)
            logprobs = {start + i: lp for i, lp in enumerate(lps)}
            group.append(make_trajectory(g, member, prompt + reply, [(start, start + len(reply))], logprobs,
                                         [(observation, reward(reply))]))
        out.append(group)
    return out


def sample_two_turn_group(sampler: TinySampler, group_index: int, group_size: int, observations: Sequence[str],
                          reward: Reward, max_tokens: int = 4) -> list[Trajectory]:
    """A group of two-turn episodes: member m sees observations[m % len] at turn 2 (so anchor states repeat)."""
    first = "Turn 1\nState:\nP_\n_G"
    prompt = sampler.first_prompt(first)
    replies1 = sampler.sample([prompt] * group_size, max_tokens)
    group = []
    for member, (reply1, lps1) in enumerate(replies1):
        second = observations[member % len(observations)]
        prefix2 = prompt + reply1 + sampler.user_turn(second)
        (reply2, lps2), = sampler.sample([prefix2], max_tokens)
        s1, s2 = len(prompt), len(prefix2)
        logprobs = {s1 + i: lp for i, lp in enumerate(lps1)} | {s2 + i: lp for i, lp in enumerate(lps2)}
        group.append(make_trajectory(group_index, member, prefix2 + reply2,
                                     [(s1, s1 + len(reply1)), (s2, s2 + len(reply2))], logprobs,
                                     [(first, reward(reply1)), (second, reward(reply2))]))
    return group


def make_batch(groups: Sequence[Sequence[Trajectory]], step: int = 0) -> Batch:
    out = []
    for trajs in groups:
        group = Group(trajs[0].group_id, len(trajs), 0.0)
        for t in trajs:
            group.add(t)
        out.append(group)
    return Batch(step, out)


def draw_until_mixed(draw: Callable[[], list[list[Trajectory]]], attempts: int = 20) -> list[list[Trajectory]]:
    """Groups from `draw` in which every group has members of different scores (else all advantages are 0).

    An untrained model's first token is near uniform, so a rule like "even first token" leaves a group of 4
    unmixed about one draw in eight; drawing again from the same generator stays deterministic for a given model
    and seed without depending on which tokenizer the env corpus happened to produce.
    """
    for _ in range(attempts):
        groups = draw()
        if all(len({t.score for t in group}) > 1 for group in groups):
            return groups
    raise AssertionError(f"{attempts} draws never gave every group mixed rewards: is the tiny model degenerate?")
