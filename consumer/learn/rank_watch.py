"""Liveness of the ranks of a multi-rank trainer: followers beat, rank 0 watches, a silent rank stops the run.

Every rank > 0 adds 1 to its counter in the launcher's key-value store (the TCPStore torch.distributed
rendezvoused on) every `period_s`. Rank 0 reads the counters: a rank whose counter has not moved for `timeout_s`
is gone (killed, crashed, frozen, its host lost). Rank 0 then stops with one line that names it, whatever it was
doing: a collective that failed because the peer closed its socket asks the watch which rank is gone and raises
`RankLost`; a collective that would wait for ever on a frozen peer (gloo's timeouts are long, the control
group's a day) is cut short by the watch's own thread, which prints the same line and ends the process.

Stopping is safe for the data: a step is acknowledged in Redis only by its commit, after every rank finished
it, so the step in progress was not acknowledged and a restarted trainer trains its groups once.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from datetime import timedelta

import torch

EXIT_RANK_LOST = 2
"""Rank 0's exit status when a rank is gone (the CLI's status for a clear error)."""


class RankLost(RuntimeError):
    """A rank of this trainer is gone; the message names it and says how to resume."""


def _key(rank: int) -> str:
    return f"rollstream/heartbeat/{rank}"


def _store(timeout_s: float) -> torch.distributed.Store:
    """A client of the store the launcher (or rank 0) serves at MASTER_ADDR:MASTER_PORT, for the watch alone:
    a connection of its own, so the beats never interleave with torch.distributed's use of the default store."""
    return torch.distributed.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                      timeout=timedelta(seconds=max(timeout_s, 30.0)), wait_for_workers=False)


def period_of(timeout_s: float) -> float:
    """Beat four times per timeout, at most once a second."""
    return min(1.0, timeout_s / 4)


def lost_message(dead: list[int], timeout_s: float) -> str:
    ranks = ", ".join(map(str, dead))
    return (f"trainer rank {ranks} is gone (no heartbeat for {timeout_s:g} s: killed, crashed or frozen; see its "
            "log); the trainer stops. Every committed step is safe in Redis and the step in progress was not "
            "acknowledged: restart the whole trainer (every rank) with resume_from_checkpoint=true to go on from "
            "the last committed step")


class Heartbeat:
    """A follower's beat: a daemon thread that adds 1 to this rank's counter every period."""

    def __init__(self, rank: int, timeout_s: float) -> None:
        self.rank = rank
        self.period_s = period_of(timeout_s)
        self.store = _store(timeout_s)
        self.store.add(_key(rank), 1)
        threading.Thread(target=self._run, name=f"heartbeat-{rank}", daemon=True).start()

    def _run(self) -> None:
        while True:
            time.sleep(self.period_s)
            try:
                self.store.add(_key(self.rank), 1)
            except Exception:  # the store (the launcher) is gone: this rank is being stopped anyway
                return


class RankWatch:
    """Rank 0's view of the followers' heartbeats, and the thread that stops it when one falls silent."""

    def __init__(self, world_size: int, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.period_s = period_of(timeout_s)
        self.store = _store(timeout_s)
        self.lock = threading.Lock()
        now = time.monotonic()
        self.seen = {rank: (self._count(rank), now) for rank in range(1, world_size)}
        """rank -> (its counter, when rank 0 last saw it move)."""
        self.paused = False
        """Set while the main thread handles a failure itself, or has stopped the followers: the thread waits."""
        self.lost: RankLost | None = None
        """What `check` found, once it found a rank gone."""
        threading.Thread(target=self._run, name="rank-watch", daemon=True).start()

    def _count(self, rank: int) -> int:
        return int(self.store.add(_key(rank), 0))  # add 0: a read that does not block on a key not yet written

    def poll(self) -> list[int]:
        """Ranks silent for timeout_s or more, as of now."""
        with self.lock:
            now = time.monotonic()
            for rank, (count, _) in self.seen.items():
                latest = self._count(rank)
                if latest != count:
                    self.seen[rank] = (latest, now)
            return [rank for rank, (_, at) in self.seen.items() if now - at >= self.timeout_s]

    def verdict(self) -> list[int]:
        """Ranks that do not beat within timeout_s from now: waits until every rank beat once, or that long."""
        start = time.monotonic()
        before = {rank: count for rank, (count, _) in self.seen.items()}
        while True:
            dead = self.poll()
            silent = [rank for rank, (count, _) in self.seen.items() if count == before[rank]]
            expired = time.monotonic() - start >= self.timeout_s
            if dead or expired or not silent:
                return sorted(set(dead).union(silent if expired else ()))
            time.sleep(self.period_s / 2)

    def check(self, cause: BaseException | None = None, *, resume: bool = True) -> None:
        """After a collective failed (or before the stop message): raise RankLost, and keep it as `lost`, if a
        rank is gone. The thread waits meanwhile, and goes on waiting with `resume=False` (the stop is going out:
        the followers stop beating once they have it)."""
        self.paused = True
        dead = self.verdict()
        if dead:
            self.lost = RankLost(lost_message(dead, self.timeout_s))
            raise self.lost from cause
        self.paused = not resume

    def _run(self) -> None:
        while True:
            time.sleep(self.period_s)
            if self.paused:
                continue
            try:
                dead = self.poll()
            except Exception:  # the store is gone: the launcher is stopping this rank
                return
            if dead and not self.paused:
                # The main thread may be inside a collective that waits for the dead rank for hours. Nothing of
                # the step in progress is acknowledged before its commit, so ending the process here loses nothing.
                print(f"rollstream: error: {lost_message(dead, self.timeout_s)}", file=sys.stderr, flush=True)
                sys.stdout.flush()
                os._exit(EXIT_RANK_LOST)
