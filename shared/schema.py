"""What travels between producers and the trainer: trajectories, their turns and group notices.

Pure data, no I/O. The wire format lives in `rollstream.shared.codec`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

VAL_GREEDY_MEMBER = 0
"""In a validation group, member 0 plays at temperature 0; members 1.. sample as training does."""


def group_prefix(mode: str, tag: str, group_index: int) -> str:
    """The part of a GRPO group id fixed by the env group; the episode index is appended."""
    return f"{mode}/{tag}/g{group_index}/e"


def make_group_id(mode: str, tag: str, group_index: int, episode: int) -> str:
    return f"{group_prefix(mode, tag, group_index)}{episode}"


def parse_group_id(group_id: str) -> tuple[str, str, int, int]:
    """Split a group id into (mode, tag, group index, episode index)."""
    try:
        mode, tag, g, e = group_id.split("/")
        if not (g.startswith("g") and e.startswith("e")):
            raise ValueError
        return mode, tag, int(g[1:]), int(e[1:])
    except ValueError:
        raise ValueError(f"not a group id: {group_id!r} (expected mode/tag/g<int>/e<int>)") from None


def make_traj_id(group_id: str, member: int) -> str:
    """Deterministic, so a duplicated XADD carries the same id and the trainer can drop the copy."""
    return f"{group_id}/m{member}"


@dataclass
class Turn:
    """One policy reply and the env's answer to it."""

    version: int
    """Policy version of the weights that generated this reply."""
    observation: str
    """The state text the policy saw before replying (GiGPO groups steps by it)."""
    reply: str
    """The policy's raw reply text."""
    action: str | None
    """The parsed action name, None when the reply had no valid action."""
    action_is_valid: bool
    reward: float
    """Env reward for this step, format penalty included."""
    response_span: tuple[int, int] = (0, 0)
    """[start, end) of this reply's tokens in the trajectory's input_ids ((0, 0) without tokens)."""
    finish_reason: str = "stop"
    """Why generation stopped: "stop", "length" (hit max_tokens_per_step), ..."""


@dataclass
class Trajectory:
    """One env's episode: the unit the producer writes and the trainer groups."""

    traj_id: str
    group_id: str
    mode: str
    tag: str
    group_index: int
    episode: int
    member: int
    seed: int
    turns: list[Turn]
    score: float
    """Sum of env rewards over the episode."""
    success: bool
    end_reason: str
    worker_rank: int = 0
    input_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    """Token ids of the whole conversation, prompts and replies (empty for policies without tokens)."""
    response_mask: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint8))
    """1 where input_ids holds a generated token, 0 on prompt tokens."""
    logprobs: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    """The engine's logprob of each generated token, 0 on prompt tokens."""
    created_at: float = 0.0
    """Unix time at which the episode finished."""

    @property
    def version(self) -> int:
        """The oldest policy version that generated any of its tokens."""
        return min((t.version for t in self.turns), default=0)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_actions(self) -> int:
        return sum(t.action_is_valid for t in self.turns)


@dataclass(frozen=True)
class GroupDropNotice:
    """A producer's word that a group it admitted will never complete (env error, shutdown)."""

    group_id: str
    reason: str
    """One of "error" or "shutdown"."""
    detail: str = ""
    worker_rank: int = 0
