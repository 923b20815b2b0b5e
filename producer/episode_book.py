"""An env group's episodes on one env-worker: which are admitted, which members are done. Pure bookkeeping."""

from __future__ import annotations

from collections import defaultdict


class EpisodeBook:
    """Which episodes one env group has admitted and which members are done with them. Pure bookkeeping.

    `k` counts a member's episodes: the group's k-th episode is admitted once, by whichever member needs it first,
    and forgotten when every member is done with it (its trajectory written, or skipped because it failed).
    """

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size
        self.num_admitted = 0
        self.last_episode = -1
        """The highest episode index admitted to this group in this process: Redis never hands out a lower one."""
        self._admitted: dict[int, int] = {}
        """k -> episode index of the group's k-th episode, until every member is done with it."""
        self._done: dict[int, set[int]] = defaultdict(set)
        """k -> members done with it."""
        self._versions: dict[int, int] = {}
        """k -> the published version it was admitted under."""
        self._failed: set[int] = set()
        """k's already reported to the trainer as failed; the members still to play them skip them."""

    def episode(self, k: int) -> int | None:
        """The episode index of the k-th episode, if admitted and not yet finished by every member."""
        return self._admitted.get(k)

    def admit(self, episode: int, version: int = 0) -> int:
        """Record the group's next episode, admitted under published version `version`; returns its k."""
        k = self.num_admitted
        self._admitted[k] = episode
        self._versions[k] = version
        self.last_episode = max(self.last_episode, episode)
        self.num_admitted += 1
        return k

    def admission_version(self, k: int) -> int:
        """The version the k-th episode was admitted under: none of its turns may come from older weights."""
        return self._versions.get(k, 0)

    def failed(self, k: int) -> bool:
        return k in self._failed

    def mark_failed(self, k: int) -> bool:
        """True the first time: the caller reports the failure, and later members skip the episode."""
        if k in self._failed:
            return False
        self._failed.add(k)
        return True

    def mark_done(self, k: int, member: int) -> None:
        self._done[k].add(member)
        if len(self._done[k]) == self.group_size:
            del self._done[k], self._admitted[k], self._versions[k]
            self._failed.discard(k)

    def unfinished(self) -> list[int]:
        """Episode indices admitted, not failed, and not finished by every member: what a stopping worker
        abandons."""
        return [episode for k, episode in sorted(self._admitted.items()) if k not in self._failed]
