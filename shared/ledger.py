"""The group ledger in Redis: admission under the version cap, and how every admitted group ends.

Admission and finishing are Lua scripts, so each is atomic however many producers and trainers race.
Every admitted group is in `<ns>:inflight` until it ends as exactly one of OUTCOMES (the ZREM decides who got
there first), which makes the counters reconcile: admitted = trained + stale_dropped + timeout_dropped +
failed_dropped + worker_lost_dropped + filtered_dropped + unused_at_end + in flight.
Admission records which worker process owns a group (`<ns>:owners`), so that the groups of a worker whose
heartbeat expired, or that restarted, are ended in seconds rather than after group_timeout_s.
The arithmetic is `rollstream.shared.versioning.admission_cap`, repeated in ADMIT_LUA.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import cast

import redis
import redis.asyncio

from rollstream.shared.keys import TRAINER_GROUP, Keys
from rollstream.shared.messages import (
    INCARNATION,
    ControlMessage,
    VersionPublished,
    WeightsAnnouncement,
    control_fields,
)
from rollstream.shared.redis_io import RESUME_HINT, RedisDataLost, register_async_script, register_script, text

OUTCOMES = ("trained", "stale_dropped", "timeout_dropped", "failed_dropped", "worker_lost_dropped", "filtered_dropped",
            "unused_at_end")
"""How an admitted group ends. All but trained return the group's slot, so another episode may start.
worker_lost_dropped: the env-worker that admitted it died (heartbeat expired, or it restarted);
filtered_dropped: complete, but the trainer's group filter (train_env_manager.group_filter_cls) dropped it;
unused_at_end: still in flight when the trainer reached max_steps."""

CONTROL_MAXLEN = 1000
"""About how many messages `<ns>:control` keeps (approximate MAXLEN; workers read only new ones). The Lua
scripts below write the same figure."""

# KEYS: version, counters, inflight, episodes, paused, owners, finished, last admissions
# ARGV: groups per batch G, ratio r, group prefix (the group id without its episode index), owner ("" = none),
#       request id (one per admission asked for; a retry of the same call carries the same id)
# Returns {episode, version}; episode -1 = admission paused, -2 = the cap is reached, -3 = experiment finished.
# A retried call whose first try was admitted (its reply lost to a Redis restart) gets that episode again, while it
# is in flight, instead of a second slot: the first would sit unplayed until group_timeout_s.
ADMIT_LUA = """
local version = tonumber(redis.call('GET', KEYS[1]) or '0')
if redis.call('EXISTS', KEYS[7]) == 1 then return {-3, version} end
local last = redis.call('HGET', KEYS[8], ARGV[3])
if last then
  local request, episode = string.match(last, '^(%S+) (%d+)$')
  if request == ARGV[5] and redis.call('ZSCORE', KEYS[3], ARGV[3] .. episode) then
    return {tonumber(episode), version}
  end
end
if redis.call('EXISTS', KEYS[5]) == 1 then return {-1, version} end
local admitted = tonumber(redis.call('HGET', KEYS[2], 'admitted') or '0')
local returned = tonumber(redis.call('HGET', KEYS[2], 'returned') or '0')
if admitted - returned >= (version + tonumber(ARGV[2]) + 1) * tonumber(ARGV[1]) then
  return {-2, version}
end
local episode = redis.call('HINCRBY', KEYS[4], ARGV[3], 1) - 1
redis.call('HINCRBY', KEYS[2], 'admitted', 1)
local t = redis.call('TIME')
redis.call('ZADD', KEYS[3], tonumber(t[1]) + tonumber(t[2]) / 1000000, ARGV[3] .. episode)
if ARGV[4] ~= '' then redis.call('HSET', KEYS[6], ARGV[3] .. episode, ARGV[4]) end
redis.call('HSET', KEYS[8], ARGV[3], ARGV[5] .. ' ' .. episode)
return {episode, version}
"""

# KEYS: finished, inflight, counters, control, owners
# ARGV: final version
# Marks the experiment finished and ends every group still in flight as unused_at_end, returning its slot;
# admission refuses from here on, so nothing is left in flight. Returns how many groups it ended.
# allow-oom: it frees the in-flight set and the owners hash; a trainer ending at maxmemory must not crash there.
FINISH_EXPERIMENT_LUA = """#!lua flags=allow-oom
redis.call('SET', KEYS[1], ARGV[1])
local n = redis.call('ZCARD', KEYS[2])
if n > 0 then
  redis.call('HINCRBY', KEYS[3], 'unused_at_end', n)
  redis.call('HINCRBY', KEYS[3], 'returned', n)
end
redis.call('DEL', KEYS[2], KEYS[5])
redis.call('XADD', KEYS[4], 'MAXLEN', '~', 1000, '*', 'kind', 'finished', 'version', ARGV[1])
return n
"""

# KEYS: inflight, counters, stream, control
# ARGV: group id, outcome, return slot (0/1), consumer group, entry ids...
# Returns 1 if this call ended the group, 0 if it had already ended (the entries are acked either way).
# allow-oom: ending a group frees memory (its entries are deleted), so it must run at maxmemory; without the
# flag Redis would stop the script at its first HINCRBY, after the ZREM, and the counters would not reconcile.
FINISH_LUA = """#!lua flags=allow-oom
local ended = redis.call('ZREM', KEYS[1], ARGV[1])
if ended == 1 then
  redis.call('HINCRBY', KEYS[2], ARGV[2], 1)
  if ARGV[3] == '1' then
    redis.call('HINCRBY', KEYS[2], 'returned', 1)
    redis.call('XADD', KEYS[4], 'MAXLEN', '~', 1000, '*', 'kind', 'slot', 'group_id', ARGV[1])
  end
end
if #ARGV > 4 then
  redis.call('XACK', KEYS[3], ARGV[4], unpack(ARGV, 5))
  redis.call('XDEL', KEYS[3], unpack(ARGV, 5))
end
return ended
"""


# KEYS: version, counters, inflight, stream, control, weights, run
# ARGV: new version, commit id, consumer group, number of groups,
#       then per group: group id, number of entries, entry ids..., then the announcement's field/value pairs.
# Returns {1, version} when committed, {0, version} when this commit id was already applied (a retried call),
# {-1, version} when Redis is not at new version - 1 (it lost a commit, or another trainer committed).
# One script, so a commit is all or nothing and a retry after a lost reply or a restart is a no-op.
# allow-oom: a commit deletes a batch of entries and adds two small ones, so it must run at maxmemory.
COMMIT_LUA = """#!lua flags=allow-oom
if redis.call('HGET', KEYS[7], 'last_commit') == ARGV[2] then
  return {0, tonumber(redis.call('GET', KEYS[1]) or '0')}
end
local version = tonumber(redis.call('GET', KEYS[1]) or '0')
local new = tonumber(ARGV[1])
if version ~= new - 1 then return {-1, version} end
local i = 5
for _ = 1, tonumber(ARGV[4]) do
  local n = tonumber(ARGV[i + 1])
  if redis.call('ZREM', KEYS[3], ARGV[i]) == 1 then redis.call('HINCRBY', KEYS[2], 'trained', 1) end
  if n > 0 then
    redis.call('XACK', KEYS[4], ARGV[3], unpack(ARGV, i + 2, i + 1 + n))
    redis.call('XDEL', KEYS[4], unpack(ARGV, i + 2, i + 1 + n))
  end
  i = i + 2 + n
end
redis.call('SET', KEYS[1], new)
redis.call('XADD', KEYS[6], '*', 'version', new, unpack(ARGV, i))
redis.call('XADD', KEYS[5], 'MAXLEN', '~', 1000, '*', 'kind', 'version', 'version', new)
redis.call('HSET', KEYS[7], 'last_commit', ARGV[2])
return {1, new}
"""


# KEYS: inflight, counters
# ARGV: group ids
# Admits the groups not yet in flight, outside the cap, and counts them in the same script: a retry after a lost
# reply admits nothing twice and leaves the counters reconciled.
REGISTER_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local added = 0
for i = 1, #ARGV do added = added + redis.call('ZADD', KEYS[1], 'NX', now, ARGV[i]) end
if added > 0 then redis.call('HINCRBY', KEYS[2], 'admitted', added) end
return added
"""


# KEYS: stream, counters
# ARGV: consumer group, entry ids...
# Counts the entries it deleted, so a call retried after a lost reply counts nothing twice.
# allow-oom: acking and deleting frees memory; a MULTI holding HINCRBY would be refused whole at maxmemory.
ORPHANS_LUA = """#!lua flags=allow-oom
redis.call('XACK', KEYS[1], ARGV[1], unpack(ARGV, 2))
local deleted = redis.call('XDEL', KEYS[1], unpack(ARGV, 2))
if deleted > 0 then redis.call('HINCRBY', KEYS[2], 'orphan_entries', deleted) end
"""


@dataclass(frozen=True)
class Admission:
    episode: int | None
    """The episode index this group may start, or None when no slot was given."""
    version: int
    """The published version at admission: the episode must start with weights at least this new."""
    finished: bool = False
    """The trainer reached max_steps: nothing is admitted any more."""


@dataclass(frozen=True)
class StepCommit:
    """One step's call of the commit script. Its id makes the same call, retried, a no-op."""

    keys: list[str]
    args: list[bytes | str | int | float]
    version: int
    """The version it publishes."""


class AsyncAdmissions:
    """Producer side: take a slot for a group's next episode."""

    def __init__(self, client: redis.asyncio.Redis, keys: Keys, groups_per_batch: int, ratio: int,
                 owner: str = "") -> None:
        self.keys = keys
        self.groups_per_batch = groups_per_batch
        self.ratio = ratio
        self.owner = owner
        """`owner_tag(rank, incarnation)` of the admitting worker process; "" records no owner."""
        self._admit = register_async_script(client, ADMIT_LUA)

    async def admit(self, group_prefix: str) -> Admission:
        k = self.keys
        episode, version = await self._admit(
            keys=[k.version, k.counters, k.inflight, k.episodes, k.paused, k.owners, k.finished, k.last_admission],
            args=[self.groups_per_batch, self.ratio, group_prefix, self.owner, uuid.uuid4().hex],
        )
        if episode < 0:
            return Admission(None, int(version), finished=episode == -3)
        return Admission(int(episode), int(version))


def owner_tag(rank: int, incarnation: str) -> str:
    """Who admitted a group: the worker rank and the incarnation (one per process start) that played it."""
    return f"{rank} {incarnation}"


async def finished_version(client: redis.asyncio.Redis, keys: Keys) -> int | None:
    """The final version if the trainer has marked the experiment finished, else None."""
    value = await client.get(keys.finished)
    return None if value is None else int(value)


class Ledger:
    """Trainer side: end groups, commit steps, read the counters."""

    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self.client = client
        self.keys = keys
        self._finish = register_script(client, FINISH_LUA)
        self._commit = register_script(client, COMMIT_LUA)
        self._orphans = register_script(client, ORPHANS_LUA)
        self._finish_experiment = register_script(client, FINISH_EXPERIMENT_LUA)
        self._register = register_script(client, REGISTER_LUA)

    def finish(self, group_id: str, outcome: str, entry_ids: Sequence[bytes | str], *,
               stream: str | None = None) -> bool:
        """End a group (once) and ack+delete its entries; False when it had already ended."""
        if outcome not in OUTCOMES:
            raise ValueError(f"unknown outcome {outcome!r}; expected one of {OUTCOMES}")
        k = self.keys
        return_slot = "0" if outcome == "trained" else "1"
        result = self._finish(
            keys=[k.inflight, k.counters, stream or k.traj, k.control],
            args=[group_id, outcome, return_slot, TRAINER_GROUP, *entry_ids],
        )
        return bool(result)

    def commit_step(self, trained: Iterable[tuple[str, Sequence[bytes | str]]],
                    announcement: WeightsAnnouncement) -> None:
        """Atomically: mark the step's groups trained (ack+delete their entries) and publish the version.

        Safe to retry (redis-py retries on a dropped connection and reloads the script after a restart): the
        commit carries a fresh id, and a commit whose id Redis already holds is not applied again. Raises
        RedisDataLost when Redis is not at version new_version - 1."""
        commit = self.step_commit(trained, announcement)
        self.check_commit(commit, self._commit(keys=commit.keys, args=commit.args))

    def step_commit(self, trained: Iterable[tuple[str, Sequence[bytes | str]]],
                    announcement: WeightsAnnouncement) -> StepCommit:
        """The commit of `commit_step`, to queue on a pipeline (`queue_commit`) and check there (`check_commit`)."""
        k = self.keys
        args: list[bytes | str | int | float] = [announcement.version, uuid.uuid4().hex, TRAINER_GROUP, 0]
        for group_id, entry_ids in trained:
            args += [group_id, len(entry_ids), *entry_ids]
            args[3] = int(args[3]) + 1
        for name, value in announcement.fields().items():
            if name != "version":  # the script writes the version it commits first
                args += [name, value]
        return StepCommit([k.version, k.counters, k.inflight, k.traj, k.control, k.weights, k.run], args,
                          announcement.version)

    def queue_commit(self, commit: StepCommit, pipe: redis.client.Pipeline) -> None:
        self._commit(keys=commit.keys, args=commit.args, client=pipe)

    def check_commit(self, commit: StepCommit, reply: object) -> None:
        """Raise what a commit's reply says went wrong: an error reply, or Redis not at version - 1."""
        if isinstance(reply, redis.exceptions.NoScriptError):
            # A pipeline loads its scripts once, before its first try: a Redis restarted before a retry has lost
            # them. The same call (the same commit id) again, on its own, which sends the script if Redis lacks it.
            reply = self._commit(keys=commit.keys, args=commit.args)
        if isinstance(reply, Exception):
            raise reply
        status, version = cast(list[int], reply)
        if status == -1:
            raise RedisDataLost(
                f"cannot commit step {commit.version - 1}: Redis holds policy version {version}, expected "
                f"{commit.version - 1}. Redis lost committed steps (a restart without its AOF, or an AOF behind) or "
                f"another trainer runs experiment {self.keys.ns}; {RESUME_HINT}")

    def announce(self, announcement: WeightsAnnouncement) -> None:
        """Re-announce the weights of an already published version (a resumed trainer's model)."""
        with self.client.pipeline(transaction=True) as pipe:
            pipe.xadd(self.keys.weights, announcement.fields())  # type: ignore[arg-type]  # str keys
            add_control(pipe, self.keys.control, VersionPublished(announcement.version))
            pipe.execute()

    def ack_orphans(self, entry_ids: Sequence[bytes | str], stream: str | None = None) -> None:
        """Entries of groups that already ended (duplicates, late members): ack, delete, count."""
        if not entry_ids:
            return
        self._orphans(keys=[stream or self.keys.traj, self.keys.counters], args=[TRAINER_GROUP, *entry_ids])

    def inflight_of(self, group_ids: Sequence[str]) -> list[bool]:
        if not group_ids:
            return []
        scores = self.client.zmscore(self.keys.inflight, list(group_ids))
        return [s is not None for s in scores]

    def expired(self, timeout_s: float) -> list[str]:
        """In-flight groups admitted longer than `timeout_s` ago (by the Redis server's clock)."""
        seconds, micros = self.client.time()
        cutoff = seconds + micros / 1e6 - timeout_s
        return [text(g) for g in cast(list[bytes], self.client.zrangebyscore(self.keys.inflight, "-inf", cutoff))]

    def lost_groups(self) -> dict[str, int]:
        """In-flight groups whose admitting worker process is gone -> its rank.

        Gone: its rank's heartbeat expired, or holds another incarnation (the worker restarted). Owner records
        of groups that already ended are deleted here, so the owners hash stays as small as the in-flight set.
        """
        owners = {text(g): text(v).split(" ", 1) for g, v in self.client.hgetall(self.keys.owners).items()}
        if not owners:
            return {}
        in_flight = self.inflight_of(list(owners))
        ended = {g for g, alive in zip(owners, in_flight) if not alive}
        if ended:
            self.client.hdel(self.keys.owners, *ended)
        live = {g: o for g, o in owners.items() if g not in ended}
        ranks = sorted({int(rank) for rank, _ in live.values()})
        with self.client.pipeline(transaction=False) as pipe:
            for rank in ranks:
                pipe.hget(self.keys.worker(rank), INCARNATION)
            beating = {rank: (text(v) if v else None) for rank, v in zip(ranks, pipe.execute())}
        return {g: int(rank) for g, (rank, inc) in live.items() if beating[int(rank)] != inc}

    def finish_experiment(self, version: int) -> int:
        """Mark the experiment finished at `version`; groups still in flight end as unused_at_end."""
        k = self.keys
        return int(self._finish_experiment(keys=[k.finished, k.inflight, k.counters, k.control, k.owners],
                                           args=[version]))

    def finished(self) -> int | None:
        value = self.client.get(self.keys.finished)
        return None if value is None else int(value)

    def reopen(self) -> None:
        """A trainer continuing a finished experiment to a higher max_steps: admission opens again."""
        self.client.delete(self.keys.finished)

    def version(self) -> int:
        return int(self.client.get(self.keys.version) or 0)

    def expect_version(self, step: int) -> None:
        """Raise RedisDataLost unless Redis holds version `step`, which this trainer committed (or resumed at)."""
        version = self.version()
        if version != step:
            raise RedisDataLost(
                f"the trainer is at step {step} but Redis holds policy version {version}: Redis lost committed steps "
                f"(a restart without its AOF, or an AOF behind) or another trainer runs {self.keys.ns}; {RESUME_HINT}")

    def counters(self) -> dict[str, int]:
        """The group counters and the in-flight count, read in one transaction so they reconcile."""
        return read_counters(self.client, self.keys)

    def register(self, group_ids: Sequence[str]) -> int:
        """Admit groups outside the cap (replaying a recorded file), so the trainer accepts them.

        Groups already in flight are left alone; returns how many were newly admitted."""
        if not group_ids:
            return 0
        return int(self._register(keys=[self.keys.inflight, self.keys.counters], args=list(group_ids)))


# KEYS: counters, inflight. Read in one script so they reconcile; no-writes lets it run at maxmemory, where
# Redis refuses every command queued in a MULTI, reads included.
READ_COUNTERS_LUA = """#!lua flags=no-writes
return {redis.call('HGETALL', KEYS[1]), redis.call('ZCARD', KEYS[2])}
"""


def read_counters(client: redis.Redis, keys: Keys) -> dict[str, int]:
    flat, in_flight = register_script(client, READ_COUNTERS_LUA)(keys=[keys.counters, keys.inflight])
    raw = dict(zip(flat[::2], flat[1::2]))
    counts = {k.decode(): int(v) for k, v in raw.items()}
    counts["in_flight"] = int(in_flight)
    return counts


def reconciles(counts: dict[str, int]) -> bool:
    """admitted = trained + stale + timed out + failed + worker lost + filtered + unused at end + in flight."""
    ended = sum(counts.get(o, 0) for o in OUTCOMES)
    return counts.get("admitted", 0) == ended + counts.get("in_flight", 0)


def add_control(client: redis.Redis | redis.client.Pipeline, key: str, message: ControlMessage) -> None:
    """XADD `message` to the control stream `key`, trimmed to about CONTROL_MAXLEN entries."""
    client.xadd(key, control_fields(message), maxlen=CONTROL_MAXLEN, approximate=True)  # type: ignore[arg-type]
