"""Group assembly: trajectories arrive in any order, possibly twice; complete GRPO groups come out. Pure.

The assembler remembers every stream entry id it was handed for a group, duplicates included, so that
the entries can all be acknowledged when the group ends.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from enum import Enum

from rollstream.shared.schema import Trajectory


class Added(Enum):
    NEW = "new"
    DUPLICATE = "duplicate"
    COMPLETED = "completed"
    """This trajectory was the group's last missing member."""


@dataclass
class Group:
    group_id: str
    group_size: int
    first_seen: float
    members: dict[int, Trajectory] = field(default_factory=dict)
    entry_ids: list[bytes] = field(default_factory=list)
    version: int = 0
    """The oldest policy version among the members' tokens: what the staleness filter looks at (kept by `add`,
    not recomputed: the trainer checks every ready group at every poll)."""
    passed_filter: bool = False
    """The trainer's group filter kept it (or let it through at its limit): not asked again."""

    def add(self, traj: Trajectory) -> None:
        """Take `traj` as its member (the one way members are written, so `version` stays true)."""
        self.version = min(self.version, traj.version) if self.members else traj.version
        self.members[traj.member] = traj

    @property
    def complete(self) -> bool:
        return len(self.members) == self.group_size

    @property
    def trajectories(self) -> list[Trajectory]:
        return [self.members[m] for m in sorted(self.members)]


class GroupAssembler:
    def __init__(self, group_size: int) -> None:
        self.group_size = group_size
        self.partial: dict[str, Group] = {}
        self.ready: OrderedDict[str, Group] = OrderedDict()
        """Complete groups in order of completion, waiting to be taken into a batch."""

    def add(self, entry_id: bytes, traj: Trajectory, now: float) -> Added:
        if not 0 <= traj.member < self.group_size:
            raise ValueError(f"{traj.traj_id}: member {traj.member} outside group_size {self.group_size}")
        group = self.ready.get(traj.group_id) or self.partial.get(traj.group_id)
        if group is None:
            group = self.partial[traj.group_id] = Group(traj.group_id, self.group_size, now)
        group.entry_ids.append(entry_id)
        if traj.member in group.members:
            return Added.DUPLICATE
        group.add(traj)
        if group.complete:
            self.ready[group.group_id] = self.partial.pop(group.group_id)
            return Added.COMPLETED
        return Added.NEW

    def take_ready(self) -> Group | None:
        """The oldest complete group, or None."""
        if not self.ready:
            return None
        return self.ready.popitem(last=False)[1]

    def take_oldest(self, n: int) -> list[Group]:
        """The `n` oldest complete groups (at most as many as are ready)."""
        return [self.ready.popitem(last=False)[1] for _ in range(min(n, len(self.ready)))]

    def discard(self, group_id: str) -> list[bytes]:
        """Forget a group (dropped); returns its entry ids to acknowledge."""
        group = self.partial.pop(group_id, None) or self.ready.pop(group_id, None)
        return group.entry_ids if group else []

    def drain(self) -> list[bytes]:
        """Forget every group held; returns all their entry ids."""
        ids = [e for g in [*self.partial.values(), *self.ready.values()] for e in g.entry_ids]
        self.partial.clear()
        self.ready.clear()
        return ids

    def known(self, group_id: str) -> bool:
        return group_id in self.partial or group_id in self.ready

    def is_complete(self, group_id: str) -> bool:
        return group_id in self.ready
