"""Env-manager arithmetic: which tag each env group plays and which worker runs it. Pure.

Total envs = num_env_groups * group_size; workers = ceil(total envs / max_env_num_per_worker).
A group is never split across workers, so max_env_num_per_worker must be a multiple of group_size.
Groups are dealt to workers round-robin, so every worker gets a similar mix of tags.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rollstream.shared.config import CustomEnvConfig, EnvManagerConfig


@dataclass(frozen=True)
class GroupSpec:
    group_index: int
    tag: str
    worker_rank: int


@dataclass(frozen=True)
class Layout:
    groups: tuple[GroupSpec, ...]
    num_workers: int
    group_size: int
    max_env_num_per_worker: int

    @property
    def total_envs(self) -> int:
        return len(self.groups) * self.group_size

    def groups_of(self, rank: int) -> list[GroupSpec]:
        if not 0 <= rank < self.num_workers:
            raise ValueError(f"worker rank {rank} is out of range: this layout has ranks 0..{self.num_workers - 1}")
        return [g for g in self.groups if g.worker_rank == rank]

    def groups_per_tag(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for g in self.groups:
            counts[g.tag] = counts.get(g.tag, 0) + 1
        return counts


def plan_layout(
    em: EnvManagerConfig, custom_envs: Mapping[str, CustomEnvConfig], section: str
) -> Layout:
    """Check one env manager section and lay its groups out on workers."""
    from rollstream.shared.config import ConfigError

    for key in ("group_size", "num_env_groups", "max_env_num_per_worker"):
        if getattr(em, key) < 1:
            raise ConfigError(f"{section}.{key}={getattr(em, key)}: must be an integer >= 1")
    if em.max_env_num_per_worker % em.group_size:
        raise ConfigError(
            f"{section}.max_env_num_per_worker={em.max_env_num_per_worker} is not a multiple of "
            f"{section}.group_size={em.group_size}: a group is never split across workers; try "
            f"{max(1, em.max_env_num_per_worker // em.group_size) * em.group_size}"
        )
    tags = _check_tags(em.tags, custom_envs, section)
    partition = partition_groups(em.num_env_groups, tags, em.num_groups_partition, section)
    tag_of_group = [tag for tag, n in zip(tags, partition) for _ in range(n)]
    num_workers = math.ceil(em.num_env_groups * em.group_size / em.max_env_num_per_worker)
    groups = tuple(GroupSpec(i, tag, i % num_workers) for i, tag in enumerate(tag_of_group))
    return Layout(groups, num_workers, em.group_size, em.max_env_num_per_worker)


def _check_tags(tags: list[str], custom_envs: Mapping[str, CustomEnvConfig], section: str) -> list[str]:
    from rollstream.shared.config import ConfigError

    if not tags:
        raise ConfigError(f"{section}.tags is empty: name at least one of custom_envs ({', '.join(custom_envs)})")
    if len(set(tags)) != len(tags):
        raise ConfigError(f"{section}.tags={tags} names a tag twice; give each tag once and set its share "
                          "with num_groups_partition")
    unknown = [t for t in tags if t not in custom_envs]
    if unknown:
        raise ConfigError(
            f"{section}.tags names {', '.join(map(repr, unknown))}, which custom_envs does not define; "
            f"known tags: {', '.join(custom_envs) or '(none)'}"
        )
    return list(tags)


def partition_groups(num_env_groups: int, tags: list[str], partition: list[int] | None, section: str) -> list[int]:
    """Groups per tag: the given partition checked, or an even split of num_env_groups."""
    from rollstream.shared.config import ConfigError

    if partition is None:
        share, remainder = divmod(num_env_groups, len(tags))
        if remainder:
            suggestion = [share + (i < remainder) for i in range(len(tags))]
            raise ConfigError(
                f"{section}.num_env_groups={num_env_groups} does not split evenly over {len(tags)} tags "
                f"({remainder} left over); set {section}.num_groups_partition, e.g. {suggestion}"
            )
        return [share] * len(tags)
    if len(partition) != len(tags):
        raise ConfigError(
            f"{section}.num_groups_partition={list(partition)} has {len(partition)} entries but "
            f"{section}.tags has {len(tags)}: give one group count per tag"
        )
    if any(n < 0 for n in partition):
        raise ConfigError(f"{section}.num_groups_partition={list(partition)}: group counts must be >= 0")
    if sum(partition) != num_env_groups:
        raise ConfigError(
            f"{section}.num_groups_partition={list(partition)} sums to {sum(partition)} but "
            f"{section}.num_env_groups={num_env_groups}: make them equal"
        )
    return list(partition)


def describe_layout(layout: Layout) -> str:
    """A few readable lines for `rollstream config show`."""
    lines = [
        f"envs: {layout.total_envs} = {len(layout.groups)} groups x {layout.group_size}; "
        f"workers: {layout.num_workers} (at most {layout.max_env_num_per_worker} envs each)",
        "groups per tag: " + ", ".join(f"{t}={n}" for t, n in layout.groups_per_tag().items()),
    ]
    shown = layout.num_workers if layout.num_workers <= 16 else 8  # thousands of lines would hide the rest
    for rank in range(shown):
        mine = layout.groups_of(rank)
        listing = ", ".join(f"g{g.group_index}:{g.tag}" for g in mine)
        lines.append(f"  worker {rank}: {len(mine)} groups, {len(mine) * layout.group_size} envs [{listing}]")
    if shown < layout.num_workers:
        lines.append(f"  ... and {layout.num_workers - shown} more workers dealt the same way")
    return "\n".join(lines)


def visible_devices(mapping: list[int] | None, rank: int, per_process: int) -> str | None:
    """CUDA_VISIBLE_DEVICES of process `rank` of a role whose `device_mapping` is `mapping`: process k takes the
    k-th slice of `per_process` ids (round robin when there are more processes than slices); None leaves the
    variable alone (no mapping). The trainer is one process that takes the whole mapping (per_process = len)."""
    if not mapping:
        return None
    slices = [mapping[i:i + per_process] for i in range(0, len(mapping) - per_process + 1, per_process)]
    return ",".join(str(d) for d in slices[rank % len(slices)])
