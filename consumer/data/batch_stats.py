"""Statistics of a batch of trajectories, namespaced like `rollout/success`. Pure."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence

import numpy as np

from rollstream.shared.envs.text import opens_think
from rollstream.shared.schema import Trajectory, Turn


def rollout_stats(trajs: Sequence[Trajectory], step: int, max_staleness: int = 0) -> dict[str, float]:
    """Reward, success, actions, valid-action rate, staleness, overall and per tag, and the share of the batch's
    groups in which no member succeeded (`rollout/failed_groups`: no group-relative advantage there).

    The staleness histogram is one share per value, `staleness/0` .. `staleness/<max_staleness>` (the
    async ratio), present every step so its curves are continuous; a value beyond it still gets its key."""
    stats = per_tag_stats("rollout", trajs)
    staleness = [step - t.version for t in trajs]
    stats["rollout/staleness_mean"] = float(np.mean(staleness)) if trajs else 0.0
    stats["rollout/staleness_max"] = float(max(staleness, default=0))
    hist = dict.fromkeys(range(max_staleness + 1), 0) | Counter(staleness)
    stats |= {f"staleness/{k}": n / max(len(trajs), 1) for k, n in sorted(hist.items())}
    stats["rollout/tokens"] = float(sum(t.num_tokens for t in trajs))
    solved: dict[str, bool] = defaultdict(bool)
    for t in trajs:
        solved[t.group_id] |= t.success
    stats["rollout/failed_groups"] = float(np.mean([not s for s in solved.values()])) if solved else 0.0
    return stats


def per_tag_stats(prefix: str, trajs: Sequence[Trajectory]) -> dict[str, float]:
    """Score, success, actions, valid-action rate, the share of valid moves that change nothing, the share of
    replies that open a think and (for policies with tokens) the mean reply length in tokens under `prefix/`, and
    under `prefix/<tag>/` per tag."""
    stats = _summary(prefix, trajs)
    by_tag: dict[str, list[Trajectory]] = defaultdict(list)
    for t in trajs:
        by_tag[t.tag].append(t)
    if len(by_tag) > 1:
        for tag, members in sorted(by_tag.items()):
            stats.update(_summary(f"{prefix}/{tag}", members))
    return stats


def _summary(prefix: str, trajs: Iterable[Trajectory]) -> dict[str, float]:
    trajs = list(trajs)
    if not trajs:
        return {}
    turns = [turn for t in trajs for turn in t.turns]
    stats = {
        f"{prefix}/score": float(np.mean([t.score for t in trajs])),
        f"{prefix}/success": float(np.mean([t.success for t in trajs])),
        f"{prefix}/num_actions": float(np.mean([t.num_actions for t in trajs])),
        f"{prefix}/valid_action_rate": valid_action_rate(trajs),
        f"{prefix}/no_effect_rate": no_effect_rate(trajs),
        f"{prefix}/think_rate": float(np.mean([opens_think(turn.reply) for turn in turns])) if turns else 0.0,
    }
    spans = [turn.response_span[1] - turn.response_span[0] for turn in turns if turn.response_span != (0, 0)]
    if spans:  # scripted policies write no tokens
        stats[f"{prefix}/reply_tokens"] = float(np.mean(spans))
    return stats


def valid_action_rate(trajs: Iterable[Trajectory]) -> float:
    """The share of the replies whose action parsed (0.0 without replies)."""
    turns = [turn.action_is_valid for t in trajs for turn in t.turns]
    return float(np.mean(turns)) if turns else 0.0


def judged_moves(traj: Trajectory) -> list[tuple[Turn, Turn]]:
    """Each valid move with the turn after it, whose state says what the move did. An episode's last move is left
    out: its outcome is not in the trajectory."""
    return [(a, b) for a, b in zip(traj.turns, traj.turns[1:]) if a.action_is_valid]


def changed_nothing(move: Turn, after: Turn) -> bool:
    """The policy saw the same state again after `move` (a walk into a wall)."""
    return move.observation == after.observation


def no_effect_moves(traj: Trajectory) -> list[Turn]:
    """The valid moves that changed nothing."""
    return [a for a, b in judged_moves(traj) if changed_nothing(a, b)]


def no_effect_rate(trajs: Iterable[Trajectory]) -> float:
    """The share of valid moves that changed nothing (`no_effect_moves`)."""
    judged = [pair for t in trajs for pair in judged_moves(t)]
    return sum(changed_nothing(*pair) for pair in judged) / max(len(judged), 1)
