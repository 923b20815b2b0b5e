"""Statistics of a batch of trajectories, namespaced like `rollout/success`. Pure."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence

import numpy as np

from rollstream.shared.schema import Trajectory


def rollout_stats(trajs: Sequence[Trajectory], step: int, max_staleness: int = 0) -> dict[str, float]:
    """Reward, success, actions, valid-action rate and staleness, overall and per tag.

    The staleness histogram is one share per value, `staleness/0` .. `staleness/<max_staleness>` (the
    async ratio), present every step so its curves are continuous; a value beyond it still gets its key."""
    stats = per_tag_stats("rollout", trajs)
    staleness = [step - t.version for t in trajs]
    stats["rollout/staleness_mean"] = float(np.mean(staleness)) if trajs else 0.0
    stats["rollout/staleness_max"] = float(max(staleness, default=0))
    hist = dict.fromkeys(range(max_staleness + 1), 0) | Counter(staleness)
    stats |= {f"staleness/{k}": n / max(len(trajs), 1) for k, n in sorted(hist.items())}
    stats["rollout/tokens"] = float(sum(t.num_tokens for t in trajs))
    return stats


def per_tag_stats(prefix: str, trajs: Sequence[Trajectory]) -> dict[str, float]:
    """Score, success, actions and valid-action rate under `prefix/`, and under `prefix/<tag>/` per tag."""
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
    return {
        f"{prefix}/score": float(np.mean([t.score for t in trajs])),
        f"{prefix}/success": float(np.mean([t.success for t in trajs])),
        f"{prefix}/num_actions": float(np.mean([t.num_actions for t in trajs])),
        f"{prefix}/valid_action_rate": float(np.mean([turn.action_is_valid for turn in turns])) if turns else 0.0,
    }
