"""The version cap's arithmetic, both halves. Pure: the ledger's Redis script applies the same rule.

Policy version v = number of train steps done; step s consumes a batch and publishes version s + 1.
G = rollout_batch_size / group_size groups per step, r = async_generation_ratio.
"""

from __future__ import annotations


def admission_cap(version: int, ratio: int, groups_per_batch: int) -> int:
    """Most group slots that may be in use (admitted minus returned) while version `version` is published.

    With r = 0 exactly one batch is generated per version: generation never runs ahead of training.
    """
    return (version + ratio + 1) * groups_per_batch


def oldest_usable_version(step: int, ratio: int) -> int:
    """At train step `step`, a group is used only if all its trajectory versions are at least this."""
    return step - ratio


def is_stale(group_version: int, step: int, ratio: int) -> bool:
    """`group_version` is the oldest version among the group's trajectories."""
    return group_version < oldest_usable_version(step, ratio)
