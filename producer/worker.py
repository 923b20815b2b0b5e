"""One env-worker process: its groups' envs as independent asyncio loops, one XADD per finished trajectory
(those finished within one event-loop tick go out in one transaction).

admit (a slot under the version cap) -> play (one env's multi-turn loop) -> encode -> XADD.
No barrier anywhere: each member of a group asks its group for the next episode; the first member to get
there admits it, later members reuse it, so fast members run ahead while slow ones finish.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import os
import socket
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import redis.asyncio

from rollstream.producer.episode import EpisodeSpec, Sampling, play_episode
from rollstream.producer.episode_book import EpisodeBook
from rollstream.producer.policy.base import Policy
from rollstream.producer.policy.factory import chat_template_of
from rollstream.producer.validation import ValidationPlayer
from rollstream.shared.codec import encode_drop, encode_trajectory
from rollstream.shared.config import ConfigError, RollstreamConfig
from rollstream.shared.envs.base import TextEnv
from rollstream.shared.envs.registry import make_env
from rollstream.shared.keys import Keys
from rollstream.shared.layout import GroupSpec
from rollstream.shared.ledger import Admission, AsyncAdmissions, finished_version, owner_tag
from rollstream.shared.messages import (
    ExperimentFinished,
    MessageError,
    ValidationStarted,
    WorkerBeat,
    parse_announcement,
    parse_control,
    parse_paused,
)
from rollstream.shared.redis_io import (
    RESUME_HINT,
    RedisDataLost,
    RedisUnavailable,
    StreamEntries,
    cancel_and_wait,
    register_async_script,
    write_with_backoff,
)
from rollstream.shared.schema import GroupDropNotice, Trajectory, group_prefix
from rollstream.shared.seeding import episode_seed
from rollstream.shared.weights_io import weights_path_from_uri
from rollstream.shared.weights_transport import drop_downloads, fetch_weights

log = logging.getLogger(__name__)

HEARTBEAT_MISSES = 5
"""A worker whose heartbeat was not refreshed for this many heartbeat_s periods is gone (default 5 x 2 s = 10 s)."""

# KEYS: heartbeat hash. ARGV: ttl in ms, field/value pairs.
# Returns the incarnation, host and pid the hash held before this beat (another process's, if a twin beats).
# allow-oom: a beat overwrites a small hash; a worker waiting out a full Redis must not look dead.
HEARTBEAT_LUA = """#!lua flags=allow-oom
local before = redis.call('HMGET', KEYS[1], 'incarnation', 'host', 'pid')
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return before
"""
# KEYS: the run hash, then the streams written. ARGV: this writer's field in the run hash, then per entry: its
# stream's position among the streams (1-based), its number of field/value items, the items.
# Returns the writer's count after this write. For small entries, one script instead of MULTI and an XADD per
# entry: the client packs one command and parses one reply instead of a QUEUED reply per entry (measured: the
# client's CPU per entry 70 -> 38 µs at 2 KB in writes of 8). Sent as EVAL, so a restarted Redis needs no reload.
# No allow-oom: at maxmemory Redis refuses the whole script before it runs, and the worker backs off.
WRITE_LUA = """#!lua
local i, written = 2, 0
while i <= #ARGV do
  local n = tonumber(ARGV[i + 1])
  redis.call('XADD', KEYS[tonumber(ARGV[i]) + 1], '*', unpack(ARGV, i + 2, i + 1 + n))
  i, written = i + 2 + n, written + 1
end
return redis.call('HINCRBY', KEYS[1], ARGV[1], written)
"""
WRITE_SCRIPT_BYTES = 256 << 10
"""Writes of up to this many payload bytes go as one script; larger ones as MULTI of XADDs, since Redis copies a
script's arguments once more (measured: at 16-64 KB trajectories the script wrote 0.4-0.8x as fast)."""
Outgoing = tuple[str, dict[str, bytes | str | int | float]]
"""A stream entry waiting to be written: (stream, fields)."""
SHUTDOWN_REPORT_S = 15.0
"""How long a stopping worker spends telling the trainer which admitted episodes it abandons."""


def _payload_bytes(fields: dict[str, bytes | str | int | float]) -> int:
    """An entry's size for WRITE_SCRIPT_BYTES: its payload's (the other fields are a few dozen bytes each)."""
    payload = fields.get("payload")
    return len(payload) if isinstance(payload, bytes) else 0


@dataclass
class WorkerStats:
    """What the heartbeat reports; per-tag counts feed the metrics."""

    episodes: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    started_at: float = field(default_factory=time.time)


class EnvWorker:
    def __init__(self, cfg: RollstreamConfig, rank: int, client: redis.asyncio.Redis, policy: Policy,
                 *, episodes_per_group: int | None = None) -> None:
        self.cfg = cfg
        self.rank = rank
        self.client = client
        self.policy = policy
        self.keys = Keys.for_exp(cfg.exp_name)
        self.layout = cfg.train_layout
        self.incarnation = uuid.uuid4().hex[:12]
        """This process's identity beside its rank: a restarted worker's predecessor's groups are ended."""
        self.admissions = AsyncAdmissions(client, self.keys, cfg.groups_per_batch, cfg.async_generation_ratio,
                                          owner_tag(rank, self.incarnation))
        self.finished_at: int | None = None
        """The final version once the trainer marked the experiment finished: the worker then exits 0."""
        self.episodes_per_group = episodes_per_group
        """Burst mode: each group plays this many episodes, then the worker returns."""
        self.stats = WorkerStats()
        self.downloads = Path(cfg.output_dir) / "weights_downloaded" / f"worker-{rank}"
        """Where versions announced over weights_transport: redis are downloaded to."""
        self.stop = asyncio.Event()
        self.notified = asyncio.Event()
        """Set whenever the control or weights stream moves: a slot may be free or a version published."""
        self.version_loaded = asyncio.Condition()
        self.loaded_digest = ""
        render = cfg.render_save_dir
        self.render_dir = Path(render) if render else None
        self.chat = chat_template_of(policy)
        """Token-in/token-out for policies with a tokenizer; None for the scripted policy."""
        self.validation = ValidationPlayer(self, cfg.val_layout if cfg.eval_steps else None)
        self._val_tasks: set[asyncio.Task[None]] = set()
        self._val_rounds: set[int] = set()
        self._beats = 0
        self.twin: str | None = None
        """Set when another process beats under this rank: the run is misconfigured and this worker stops."""
        self._heartbeat_script = register_async_script(client, HEARTBEAT_LUA)
        self.writer = f"writes:worker:{rank}"
        """This worker's field in the run hash: how many entries it has written."""
        self.writes_base: int | None = None
        """This writer's count in Redis when the process started writing."""
        self.writes = 0
        """How many of this process's writes Redis has acknowledged."""
        self._outbox: list[tuple[str, dict[str, bytes | str | int | float], asyncio.Future[None]]] = []
        """Entries waiting for the next transaction, each with the future its caller awaits."""
        self._sender: asyncio.Task[None] | None = None

    # ---- the loop ----

    async def run(self) -> None:
        """Play until stopped (SIGTERM: in-flight episodes are abandoned and reported) or, in burst mode,
        until every group has played episodes_per_group episodes."""
        groups = [GroupRunner(self, spec) for spec in self.layout.groups_of(self.rank)]
        self.finished_at = await finished_version(self.client, self.keys)
        if self.finished_at is not None:
            log.info("worker %d: experiment %r already finished at version %d (max_steps): nothing to do",
                     self.rank, self.cfg.exp_name, self.finished_at)
            return
        log.info("worker %d: %d groups, %d envs", self.rank, len(groups), len(groups) * self.layout.group_size)
        stream_ids = await self._load_published_version()
        self.writes_base = int(await self.client.hget(self.keys.run, self.writer) or 0)
        await self._beat()  # before the first admission: a group must never be owned by a worker not yet beating
        background = [asyncio.create_task(self._follow_streams(stream_ids), name="follow-streams"),
                      asyncio.create_task(self._heartbeat(), name="heartbeat")]
        members = [asyncio.create_task(g.run_member(m), name=f"g{g.spec.group_index}/m{m}")
                   for g in groups for m in range(self.layout.group_size)]
        playing: asyncio.Future[Any] = asyncio.gather(*members)
        stopped: asyncio.Future[Any] = asyncio.create_task(self.stop.wait())
        failure: BaseException | None = None
        try:
            await asyncio.wait([playing, stopped, *background], return_when=asyncio.FIRST_COMPLETED)
            for task in (playing, *background):  # a member or the heartbeat failed: clean up, then re-raise
                if task.done() and not task.cancelled() and task.exception() is not None:
                    failure = task.exception()
                    break
        finally:
            # The loops end by this flag too, at their next check; cancel_and_wait ends those waiting meanwhile
            self.stop.set()
            # members too: gather cancels none of them when one fails
            tasks: list[asyncio.Future[Any]] = [playing, *members, *background, stopped, *self._val_tasks]
            stuck = await cancel_and_wait(tasks, SHUTDOWN_REPORT_S)
            for task in tasks:  # retrieved, so none is logged as never retrieved; a member's failure is re-raised
                if task.done() and not task.cancelled():
                    task.exception()
            if stuck:
                names = ", ".join(getattr(t, "get_name", lambda: "env members")() for t in stuck)
                log.warning("worker %d: %d tasks did not stop within %.0f s, left behind: %s", self.rank, len(stuck),
                            SHUTDOWN_REPORT_S, names)
            try:
                # Bounded: a stopping worker must exit even if Redis stalls; the trainer's group_timeout_s
                # returns the slots of episodes it could not report.
                await asyncio.wait_for(self._report_shutdown(groups), SHUTDOWN_REPORT_S)
            except asyncio.TimeoutError:
                log.warning("worker %d: reporting unfinished episodes took over %.0f s; leaving them to the "
                            "trainer's group_timeout_s", self.rank, SHUTDOWN_REPORT_S)
        if failure is not None:
            raise failure
        if self.twin is not None:
            raise ConfigError(self.twin)

    async def _report_shutdown(self, groups: list[GroupRunner]) -> None:
        # At the end of the experiment the trainer already ended every group in flight (unused_at_end)
        for g in groups if self.finished_at is None else ():
            if not await g.drop_unfinished("shutdown"):
                return  # Redis is gone: one failure is enough waiting
        if self.twin is None:  # a twin's key stays, so that the other process sees it and stops too
            await self.client.delete(self.keys.worker(self.rank))

    def _finish(self, version: int) -> None:
        if self.finished_at is None:
            log.info("worker %d: the trainer finished the experiment at version %d: stopping", self.rank, version)
        self.finished_at = version
        self.request_stop()

    def request_stop(self) -> None:
        """Signal-safe: only sets flags; `run` does the draining."""
        self.stop.set()
        self.notified.set()

    async def wait_for_slot(self, prefix: str) -> Admission | None:
        """Block until the group may start an episode; None once the worker is stopping."""
        while not self.stop.is_set():
            self.notified.clear()
            admission = await write_with_backoff(lambda: self.admissions.admit(prefix), "admitting an episode",
                                                 self.cfg.redis.max_outage_s)
            if admission.finished:
                self._finish(admission.version)
                return None
            if admission.episode is not None:
                await self.ensure_version(admission.version)
                return admission
            # No slot: wait for a notification instead of polling Redis. The timeout only bounds the
            # cost of a lost notification (e.g. a Redis restart).
            try:
                await asyncio.wait_for(self.notified.wait(), timeout=5.0)
            except asyncio.TimeoutError:
                pass
        return None

    async def ensure_version(self, version: int) -> None:
        """An episode may not start with weights older than the version it was admitted under."""
        wait_for_version = getattr(self.policy, "wait_for_version", None)
        if wait_for_version is not None:  # engine servers load versions themselves; the policy watches them
            await wait_for_version(version, self.stop)
            return
        async with self.version_loaded:
            await self.version_loaded.wait_for(lambda: self.policy.version >= version or self.stop.is_set())

    # ---- following the control and weights streams ----

    async def _load_published_version(self) -> dict[str, bytes | str]:
        """Load the newest announced weights; returns where to follow the streams from, so nothing is missed."""
        ids: dict[str, bytes | str] = {}
        for stream in (self.keys.control, self.keys.weights):
            last = cast(StreamEntries, await self.client.xrevrange(stream, count=1))
            ids[stream] = last[0][0] if last else "0-0"
            if last and stream == self.keys.weights:
                await self._load(last[0][1])
        round_in_progress = cast(bytes | None, await self.client.get(self.keys.paused))
        if round_in_progress:  # we started during a validation round: play our share of it
            try:
                paused = parse_paused(round_in_progress)
            except MessageError as e:
                self._refuse("the pause key", e)
            else:
                self._start_validation(paused.round, paused.version)
        return ids

    async def _follow_streams(self, ids: dict[str, bytes | str]) -> None:
        while not self.stop.is_set():
            raw = await self.client.xread(ids, block=self.cfg.redis.block_ms)  # type: ignore[arg-type]  # str ids
            replies = cast(list[tuple[bytes, StreamEntries]], raw)
            for stream, entries in replies:
                name = stream.decode()
                ids[name] = entries[-1][0]
                if name == self.keys.weights:
                    await self._load(entries[-1][1])  # only the newest version matters
                for entry_id, fields in entries if name == self.keys.control else ():
                    try:
                        message = parse_control(fields)
                    except MessageError as e:  # a malformed message must not stop the follower
                        self._refuse(f"control message {entry_id!r}", e)
                        continue
                    if isinstance(message, ValidationStarted):
                        self._start_validation(message.round, message.version)
                    elif isinstance(message, ExperimentFinished):
                        self._finish(message.version)
            if replies:
                self.notified.set()

    async def _load(self, fields: dict[bytes, bytes]) -> None:
        """Load an announced version. One that does not parse, cannot be fetched or fails its digest is refused:
        logged, counted in the heartbeat's errors, the old weights stay, and the next announcement is tried."""
        try:
            announced = parse_announcement(fields)
        except MessageError as e:
            self._refuse("a weights announcement", e)
            return
        if not getattr(self.policy, "loads_weights", True):  # engine servers load it (rollstream engine)
            return
        version, digest = announced.version, announced.digest
        # A version announced again with other weights is a resumed trainer's model: load it too.
        republished = version == self.policy.version and digest and digest != self.loaded_digest
        if version > self.policy.version or republished:
            try:
                uri = await fetch_weights(self.client, self.keys, announced.uri, self.downloads)
                await self.policy.load_weights(version, uri, digest)
            except (asyncio.CancelledError, RedisUnavailable):
                raise
            except Exception as e:  # pruned, lost, corrupt, or not weights at all: a newer version will come
                self._refuse(f"policy version {version}", e)
                return
            self.loaded_digest = digest
            if uri != announced.uri:
                drop_downloads(self.downloads, keep=weights_path_from_uri(uri).name)
            log.info("worker %d: loaded policy version %d", self.rank, version)
        async with self.version_loaded:
            self.version_loaded.notify_all()

    def _refuse(self, what: str, error: BaseException) -> None:
        log.error("worker %d: refused %s (%s: %s); keeping policy version %d", self.rank, what,
                  type(error).__name__, error, self.policy.version)
        self.stats.errors["weights_refused"] += 1

    def _start_validation(self, round_: int, version: int) -> None:
        if round_ in self._val_rounds:
            return
        self._val_rounds.add(round_)
        task = asyncio.create_task(self.validation.play_round(round_, version))
        self._val_tasks.add(task)
        task.add_done_callback(self._val_tasks.discard)

    async def _heartbeat(self) -> None:
        while not self.stop.is_set():
            await asyncio.sleep(self.cfg.redis.heartbeat_s)
            await self._beat()

    async def _beat(self) -> None:
        """Refresh this worker's heartbeat; it expires after HEARTBEAT_MISSES beats, and the trainer then ends
        the groups this incarnation admitted (a restarted worker replaces the incarnation at once)."""
        key, every = self.keys.worker(self.rank), self.cfg.redis.heartbeat_s
        total = sum(self.stats.episodes.values())
        elapsed = max(time.time() - self.stats.started_at, 1e-9)
        beat = WorkerBeat(
            rank=self.rank, host=socket.gethostname(), pid=os.getpid(), incarnation=self.incarnation,
            envs=len(self.layout.groups_of(self.rank)) * self.layout.group_size, episodes=total,
            errors=sum(self.stats.errors.values()), episodes_per_s=round(total / elapsed, 3),
            loaded_version=self.policy.version, last_seen=round(time.time(), 3),
        )
        ttl_ms = max(1, int(HEARTBEAT_MISSES * every * 1000))
        args: list[str | int | float] = [ttl_ms]
        for name, value in beat.fields().items():
            args += [name, value]
        incarnation, host, pid = await self._heartbeat_script(keys=[key], args=args)
        # Before our first beat the key may hold a dead predecessor's incarnation; after it, only a live twin
        if self._beats and incarnation is not None and incarnation.decode() != self.incarnation:
            self.twin = (f"env-worker rank {self.rank} also runs on host {host.decode()} pid {pid.decode()}: "
                         "each rank must run once (see hosts.machines.*.env_workers); stopping this one")
            log.error("worker %d: %s", self.rank, self.twin)
            self.request_stop()
        self._beats += 1
        # An idle worker (waiting for a slot) writes nothing: check here too that Redis kept our writes. The floor
        # is taken before the read: a write acknowledged while the read is in flight must not raise it.
        floor = self._writes_floor()
        self._check_writes(int(await self.client.hget(self.keys.run, self.writer) or 0), floor)

    # ---- playing and writing ----

    async def play(self, env: TextEnv, spec: EpisodeSpec, sampling: Sampling, render_dir: Path | None = None
                   ) -> Trajectory:
        return await play_episode(env, self.policy, spec, sampling, render_dir, chat=self.chat,
                                  sequence_length=self.cfg.sequence_length,
                                  step_timeout_s=self.cfg.custom_envs[spec.tag].step_timeout_s)

    async def publish(self, fields: dict[str, bytes | str | int | float], stream: str | None = None) -> None:
        """XADD, counting this writer's entries in the same script: a count lower than the last one seen means
        Redis lost writes it had acknowledged (RedisDataLost), instead of training on.

        The writes of every coroutine of this worker that publish within one event-loop tick (and while the
        previous write is in flight) go out together, added and counted atomically by one script (or, past
        WRITE_SCRIPT_BYTES, one MULTI): one round trip and one fsync for all of them. Each caller returns once its
        own entry is acknowledged."""
        acknowledged = asyncio.get_running_loop().create_future()
        self._outbox.append((stream or self.keys.traj, fields, acknowledged))
        if self._sender is None or self._sender.done():
            self._sender = asyncio.create_task(self._send_outbox(), name="send-writes")
        await acknowledged

    async def _send_outbox(self) -> None:
        """Send what is queued, one transaction at a time, until nothing is left; each caller gets its outcome."""
        while self._outbox:
            batch, self._outbox = self._outbox, []
            try:
                await self._write_batch([(stream, fields) for stream, fields, _ in batch])
            except asyncio.CancelledError:  # the worker is shutting down: nobody waits for an outcome any more
                for *_, acknowledged in [*batch, *self._outbox]:
                    acknowledged.cancel()
                self._outbox = []
                raise
            except Exception as e:  # every caller of the batch gets the error (RedisDataLost, RedisUnavailable, ...)
                for *_, acknowledged in batch:
                    if not acknowledged.done():
                        acknowledged.set_exception(e)
            else:
                for *_, acknowledged in batch:
                    if not acknowledged.done():  # a caller cancelled meanwhile: its entry was written all the same
                        acknowledged.set_result(None)

    async def _write_batch(self, entries: list[Outgoing]) -> None:
        if self.writes_base is None:  # read once, before any write of this process
            self.writes_base = int(await self.client.hget(self.keys.run, self.writer) or 0)
        small = sum(_payload_bytes(fields) for _, fields in entries) <= WRITE_SCRIPT_BYTES
        write = functools.partial(self._write_script if small else self._write_multi, entries)
        floor = self._writes_floor()  # acknowledged before this write was sent (no other write is in flight)
        written = await write_with_backoff(write, "writing a trajectory", self.cfg.redis.max_outage_s)
        self._check_writes(int(written) - len(entries), floor)  # a retried write may count twice, never less
        self.writes += len(entries)

    async def _write_script(self, entries: list[Outgoing]) -> Any:
        """XADD every entry and count them, in one script; returns the writer's count after it."""
        streams = list(dict.fromkeys(stream for stream, _ in entries))
        number = {stream: i for i, stream in enumerate(streams, start=1)}  # stream i is KEYS[i + 1]
        args: list[Any] = [self.writer]
        for stream, fields in entries:
            args += (number[stream], 2 * len(fields))
            args += itertools.chain.from_iterable(fields.items())
        return await self.client.eval(WRITE_LUA, 1 + len(streams), self.keys.run, *streams, *args)

    async def _write_multi(self, entries: list[Outgoing]) -> Any:
        """The same as `_write_script`, as MULTI of the XADDs and the count."""
        async with self.client.pipeline(transaction=True) as pipe:
            for stream, fields in entries:
                pipe.xadd(stream, fields)  # type: ignore[arg-type]  # str keys
            pipe.hincrby(self.keys.run, self.writer, len(entries))
            *_, written = await pipe.execute()
        return written

    def _writes_floor(self) -> int:
        """The least count Redis may hold for this writer: what it had at start plus what it acknowledged since."""
        return (self.writes_base or 0) + self.writes

    def _check_writes(self, counted: int, floor: int) -> None:
        if counted < floor:
            raise RedisDataLost(f"worker {self.rank}: Redis counts {counted} entries written by this worker, but "
                                f"it had acknowledged {floor}: it lost writes (a restart without its AOF, or an "
                                f"AOF behind); {RESUME_HINT}")


class GroupRunner:
    """The `group_size` envs of one env group; they play the same episodes, each at its own pace."""

    def __init__(self, worker: EnvWorker, spec: GroupSpec) -> None:
        self.worker = worker
        self.spec = spec
        self.env_cfg = worker.cfg.custom_envs[spec.tag]
        self.prefix = group_prefix("train", spec.tag, spec.group_index)
        self.book = EpisodeBook(worker.layout.group_size)
        self.lock = asyncio.Lock()

    async def next_episode(self, k: int) -> int | None:
        """The k-th episode of this group (k counts per member): admitted by whichever member needs it first."""
        if self.worker.episodes_per_group is not None and k >= self.worker.episodes_per_group:
            return None
        if (episode := self.book.episode(k)) is not None:
            # Already admitted: never queue behind a member that is waiting for a slot for a later episode,
            # or the group can deadlock (its slots free up only when the slow members finish this one).
            return episode
        async with self.lock:
            if k == self.book.num_admitted:
                admission = await self.worker.wait_for_slot(self.prefix)
                if admission is None or admission.episode is None:
                    return None
                if admission.episode <= self.book.last_episode:
                    raise RedisDataLost(
                        f"worker {self.worker.rank}: Redis admitted episode {admission.episode} of {self.prefix}* "
                        f"again (episode {self.book.last_episode} was already admitted): it lost writes (a restart "
                        f"without its AOF, or an AOF behind); {RESUME_HINT}")
                self.book.admit(admission.episode, admission.version)
            return self.book.episode(k)

    async def run_member(self, member: int) -> None:
        env = self._make_env()
        k = 0
        while (episode := await self.next_episode(k)) is not None:
            if not self.book.failed(k) and not await self._play(env, k, episode, member):
                env = self._make_env()  # the failed instance may be in any state
            self.book.mark_done(k, member)
            k += 1

    async def _play(self, env: TextEnv, k: int, episode: int, member: int) -> bool:
        """Play one episode and publish it; False if the env raised (the group is then reported failed)."""
        spec = EpisodeSpec("train", self.spec.tag, self.spec.group_index, episode, member,
                           episode_seed(self.worker.cfg.seed, "train", self.spec.group_index, episode),
                           self.worker.rank, self.book.admission_version(k))
        try:
            traj = await self.worker.play(env, spec, self._sampling(), self.worker.render_dir)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # an env (or a user's env) that raises must not take the worker down
            log.exception("worker %d: %s failed", self.worker.rank, spec.group_id)
            self.worker.stats.errors[self.spec.tag] += 1
            await self._report_failed(k, spec.group_id, f"{type(e).__name__}: {e}")
            return False
        if not self.book.failed(k):  # a member that failed meanwhile already ended the group
            await self.worker.publish(encode_trajectory(traj))
            self.worker.stats.episodes[self.spec.tag] += 1
        return True

    def _make_env(self) -> TextEnv:
        return make_env(self.spec.tag, self.worker.cfg.custom_envs)

    def _sampling(self) -> Sampling:
        return Sampling.training(self.env_cfg.max_tokens_per_step, self.worker.cfg.actor_infer.generating_args)

    async def _report_failed(self, k: int, group_id: str, detail: str) -> None:
        if not self.book.mark_failed(k):
            return
        await self.worker.publish(encode_drop(GroupDropNotice(group_id, "error", detail[:500], self.worker.rank)))

    async def drop_unfinished(self, reason: str) -> bool:
        """On shutdown: tell the trainer which admitted episodes will never complete, so their slots return.
        False when Redis could not be reached."""
        for episode in self.book.unfinished():
            group_id = f"{self.prefix}{episode}"
            try:
                await self.worker.publish(encode_drop(GroupDropNotice(group_id, reason, "", self.worker.rank)))
            except Exception:  # Redis gone at shutdown: the trainer's group timeout recovers the slots
                log.warning("worker %d: could not report unfinished episodes as %s; the trainer's group_timeout_s "
                            "will return their slots", self.worker.rank, reason)
                return False
        return True
