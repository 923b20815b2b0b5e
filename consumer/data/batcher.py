"""From the trajectory stream to batches of complete, fresh-enough GRPO groups.

Reads entries, routes producers' drop notices, assembles groups, drops groups that are stale at this step,
timed out or refused by the group filter, and hands out a batch once G = rollout_batch_size / group_size
complete groups are in hand.
Nothing is acknowledged here except what is dropped: a batch's entries are acknowledged by `commit`, after
the train step that used them.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field

import redis

from rollstream.consumer.data.assembler import Added, Group, GroupAssembler
from rollstream.consumer.data.group_filters import make_group_filter
from rollstream.consumer.data.reader import Entry, StreamReader
from rollstream.shared.config import RollstreamConfig
from rollstream.shared.keys import Keys
from rollstream.shared.ledger import Ledger
from rollstream.shared.messages import WeightsAnnouncement
from rollstream.shared.schema import GroupDropNotice, Trajectory
from rollstream.shared.versioning import is_stale

log = logging.getLogger(__name__)

STRANDED_CHECK_S = 2.0
"""How often an idle or caught-up trainer compares its pending count in Redis with the entries it holds."""
TIMEOUT_CHECKS_PER_TIMEOUT = 4
"""The timeout sweep runs this many times per group_timeout_s, and at least once a second: a group ends at most a
quarter of its timeout (or a second) late, and a trainer polling a busy stream does not ask Redis at every read."""


@dataclass
class Batch:
    step: int
    groups: list[Group]
    dropped: Counter[str] = field(default_factory=Counter)
    """Groups dropped while this batch was gathered, by outcome (stale_dropped, timeout_dropped, ...), the
    trajectories delivered twice (`duplicate_trajectories`, de-duplicated by trajectory id), the filtered groups
    whose every member succeeded (`filtered_all_success`), and the groups the filter would have dropped but let
    through at its limit (`filter_bypassed`)."""

    @property
    def trajectories(self) -> list[Trajectory]:
        return [t for g in self.groups for t in g.trajectories]


class Batcher:
    def __init__(self, client: redis.Redis, cfg: RollstreamConfig, consumer: str = "trainer-0") -> None:
        self.cfg = cfg
        self.keys = Keys.for_exp(cfg.exp_name)
        self.ledger = Ledger(client, self.keys)
        self.reader = StreamReader(client, self.keys, self.keys.traj, consumer,
                                   count=cfg.redis.read_count, block_ms=cfg.redis.block_ms)
        self.assembler = GroupAssembler(cfg.train_env_manager.group_size)
        self.groups_per_batch = cfg.groups_per_batch
        self.ratio = cfg.async_generation_ratio
        self._dropped: Counter[str] = Counter()
        self._next_reap = 0.0
        self._suspects: set[str] = set()
        """Groups whose worker looked gone at the last check: ended if still so at the next one."""
        self._last_stranded_check = 0.0
        self._next_timeout_check = 0.0
        self.group_filter = make_group_filter(cfg)
        self._filter_limit = cfg.train_env_manager.group_filter_max_batches * self.groups_per_batch
        self._filtered = 0
        """Groups filtered out since the last batch was handed out."""

    def next_batch(self, step: int, *, timeout_s: float | None = None) -> Batch | None:
        """Block until G usable complete groups are in hand (None if `timeout_s` passes first)."""
        start = time.monotonic()
        while True:
            self._drop_stale(step)
            self._filter_ready()
            if len(self.assembler.ready) >= self.groups_per_batch:
                groups = self.assembler.take_oldest(self.groups_per_batch)
                dropped, self._dropped = self._dropped, Counter()
                self._filtered = 0
                return Batch(step, groups, dropped)
            if timeout_s is not None and time.monotonic() - start > timeout_s:
                return None
            self.poll_once()

    def _drop_stale(self, step: int) -> None:
        for group in list(self.assembler.ready.values()):
            if is_stale(group.version, step, self.ratio):
                # Routine under async generation (counted in groups/stale_dropped): one line per group would
                # bury the console's progress view on a fast machine.
                self._drop(group.group_id, "stale_dropped", f"version {group.version} at step {step}", logging.DEBUG)

    def poll_once(self) -> None:
        """One read of the stream, then, once the backlog has been read, a check for entries delivered to us but
        never received, and the timeout sweep."""
        entries = self.reader.read()
        if self.reader.rereading:  # pending entries this process may already hold
            held = self._held_entry_ids()
            entries = [e for e in entries if e.entry_id not in held]
        self.route(entries)
        if self.reader.caught_up and not self._reread_stranded() and time.monotonic() >= self._next_timeout_check:
            every = min(1.0, self.cfg.group_timeout_s / TIMEOUT_CHECKS_PER_TIMEOUT)
            self._next_timeout_check = time.monotonic() + every
            self.expire_timed_out()
        if self.reader.drained and time.monotonic() >= self._next_reap:
            # Twice per heartbeat period: a lost worker's groups end within about one period after its heartbeat
            self._next_reap = time.monotonic() + self.cfg.redis.heartbeat_s / 2
            self.end_lost_workers_groups()

    def _held_entry_ids(self) -> set[bytes]:
        groups = [*self.assembler.partial.values(), *self.assembler.ready.values()]
        return {entry_id for g in groups for entry_id in g.entry_ids}

    def _reread_stranded(self) -> bool:
        """Entries whose XREADGROUP reply was lost (a dropped connection) are pending to us but were never seen:
        when Redis counts more pending entries than we hold, read the pending ones again (at most every
        STRANDED_CHECK_S). True when a re-read was started."""
        now = time.monotonic()
        if now - self._last_stranded_check < STRANDED_CHECK_S:
            return False
        self._last_stranded_check = now
        pending, held = self.reader.pending_count(), len(self._held_entry_ids())
        if pending <= held:
            return False
        log.warning("%d entries were delivered to this trainer but never received (a lost reply): reading them "
                    "again", pending - held)
        self.reader.reread_pending()
        return True

    def route(self, entries: list[Entry]) -> None:
        # Only this trainer ends groups, so a group it holds is in flight; Redis is asked about the others only.
        unknown = list({e.item.group_id: None for e in entries if not self.assembler.known(e.item.group_id)})
        in_flight = dict(zip(unknown, self.ledger.inflight_of(unknown)))
        ended_here: set[str] = set()  # groups this read ended: later entries of theirs are orphans too
        orphans = []
        now = time.monotonic()
        for entry in entries:
            item = entry.item
            if not in_flight.get(item.group_id, True) or item.group_id in ended_here:
                # The group already ended: a duplicate, or a late member of a dropped group.
                orphans.append(entry.entry_id)
            elif isinstance(item, GroupDropNotice):
                ids = [*self.assembler.discard(item.group_id), entry.entry_id]
                detail = f": {item.detail}" if item.detail else ""
                # A worker's stop drops its unfinished groups: expected, and counted in the step's metrics.
                self._end(item.group_id, "failed_dropped", ids, f"{item.reason} on worker {item.worker_rank}{detail}",
                          logging.DEBUG if item.reason == "shutdown" else logging.INFO)
                ended_here.add(item.group_id)
            else:
                try:
                    if self.assembler.add(entry.entry_id, item, now) is Added.DUPLICATE:
                        self._dropped["duplicate_trajectories"] += 1  # a retried XADD; acked with its group
                except ValueError as e:
                    self.reader.dead_letter(entry.entry_id, {b"traj_id": item.traj_id.encode()}, str(e))
        self.ledger.ack_orphans(orphans)

    def _filter_ready(self) -> None:
        """Run the group filter over the oldest ready groups it has not seen, until this batch's G have passed:
        groups read ahead wait, unfiltered, for the next batch (whose limit they count against)."""
        if self.group_filter is None:
            return
        passed = 0
        for group in list(self.assembler.ready.values()):  # oldest first; `_filter` may drop as it goes
            if passed >= self.groups_per_batch:
                return
            if group.passed_filter or not self._filter(group):
                group.passed_filter = True
                passed += 1

    def _filter(self, group: Group) -> bool:
        """True when the filter dropped `group` (a ready group)."""
        assert self.group_filter is not None
        try:
            drop = self.group_filter.filter(group.group_id, group.trajectories)
        except Exception as e:
            raise RuntimeError(f"train_env_manager.group_filter_cls={self.cfg.train_env_manager.group_filter_cls!r} "
                               f"raised on group {group.group_id}: {type(e).__name__}: {e} (nothing was "
                               "acknowledged: fix the filter and restart the trainer)") from e
        if not drop:
            return False
        if self._filtered >= self._filter_limit:
            if not self._dropped["filter_bypassed"]:
                log.warning("the group filter dropped %d groups while this batch was gathered "
                            "(train_env_manager.group_filter_max_batches=%d): the rest of the batch is taken "
                            "unfiltered", self._filtered, self.cfg.train_env_manager.group_filter_max_batches)
            self._dropped["filter_bypassed"] += 1
            return False
        self._filtered += 1
        # rollout/success counts trained groups only; this says how many of the filtered ones were solved
        if all(t.success for t in group.trajectories):
            self._dropped["filtered_all_success"] += 1
        self._drop(group.group_id, "filtered_dropped", "the group filter dropped it", level=logging.DEBUG)
        return True

    def expire_timed_out(self) -> None:
        """Drop in-flight groups older than group_timeout_s that are not complete (their producer died)."""
        for group_id in self.ledger.expired(self.cfg.group_timeout_s):
            if not self.assembler.is_complete(group_id):
                self._drop(group_id, "timeout_dropped", f"incomplete after {self.cfg.group_timeout_s} s")

    def end_lost_workers_groups(self) -> None:
        """End the unfinished groups of env-workers that are gone (heartbeat expired, or restarted as a new
        incarnation), so their slots return in seconds instead of after group_timeout_s. A complete group
        already read is kept: every member is in hand, so it is trained as usual.

        A group ends only if its worker is still gone at the next check, after at least one more read that
        drained the stream: a worker that stops gracefully writes its last trajectories and drop notices, then
        deletes its heartbeat, and those entries must be read first (complete groups are trained, reported ones
        end as failed_dropped)."""
        lost = self.ledger.lost_groups()
        confirmed = {g: rank for g, rank in lost.items() if g in self._suspects}
        self._suspects = set(lost)
        for group_id, rank in confirmed.items():
            if not self.assembler.is_complete(group_id):
                self._drop(group_id, "worker_lost_dropped", f"env-worker {rank} is gone (heartbeat expired or "
                           "restarted)")

    def _drop(self, group_id: str, outcome: str, reason: str, level: int = logging.INFO) -> None:
        self._end(group_id, outcome, self.assembler.discard(group_id), reason, level)

    def _end(self, group_id: str, outcome: str, entry_ids: list[bytes], reason: str, level: int = logging.INFO) -> None:
        if self.ledger.finish(group_id, outcome, entry_ids):
            self._dropped[outcome] += 1
            log.log(level, "group %s %s: %s", group_id, outcome, reason)

    def commit(self, batch: Batch, announcement: WeightsAnnouncement) -> None:
        """After the train step: the batch's groups are trained, their entries acked and deleted,
        and the announced version is published, all in one transaction.

        The next entries are read in the same round trip (pipelined, not in the transaction): under appendfsync
        always every read of new entries waits for an fsync too (it moves the consumer group), and one wait
        serves both. They are routed here, so the next batch may already be in hand. Only when it is not in hand
        yet: reading ahead of a backlog would pile up groups that every poll checks again."""
        commit = self.ledger.step_commit([(g.group_id, g.entry_ids) for g in batch.groups], announcement)
        with self.ledger.client.pipeline(transaction=False) as pipe:
            self.ledger.queue_commit(commit, pipe)
            reading = len(self.assembler.ready) < self.groups_per_batch and self.reader.read_ahead(pipe)
            replies = pipe.execute(raise_on_error=False)
        self.ledger.check_commit(commit, replies[0])
        if reading:
            self.route(self.reader.take(replies[1]))
