"""One env-worker process: its groups' envs as independent asyncio loops, one XADD per finished trajectory.

admit (a slot under the version cap) -> play (one env's multi-turn loop) -> encode -> XADD.
No barrier anywhere: each member of a group asks its group for the next episode; the first member to get
there admits it, later members reuse it, so fast members run ahead while slow ones finish.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import redis.asyncio

from rollstream.shared.envs.base import TextEnv
from rollstream.shared.envs.registry import make_env
from rollstream.producer.episode import EpisodeSpec, Sampling, play_episode
from rollstream.producer.policy.base import Policy
from rollstream.producer.policy.factory import chat_template_of
from rollstream.shared.codec import encode_drop, encode_trajectory
from rollstream.shared.config import RollstreamConfig
from rollstream.shared.keys import Keys
from rollstream.shared.layout import GroupSpec, plan_layout
from rollstream.shared.ledger import Admission, AsyncAdmissions
from rollstream.shared.redis_io import RESUME_HINT, RedisDataLost, RedisUnavailable, write_with_backoff
from rollstream.shared.schema import VAL_GREEDY_MEMBER, GroupDropNotice, Trajectory, group_prefix
from rollstream.shared.seeding import episode_seed
from rollstream.shared.weights_io import weights_path_from_uri
from rollstream.shared.weights_transport import drop_downloads, fetch_weights

log = logging.getLogger(__name__)

# KEYS: heartbeat hash. ARGV: ttl seconds, field/value pairs.
# allow-oom: a beat overwrites a small hash; a worker waiting out a full Redis must not look dead.
HEARTBEAT_LUA = """#!lua flags=allow-oom
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('EXPIRE', KEYS[1], ARGV[1])
"""

SHUTDOWN_REPORT_S = 15.0
"""How long a stopping worker spends telling the trainer which admitted episodes it abandons."""


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
        self.layout = plan_layout(cfg.train_env_manager, cfg.custom_envs, "train_env_manager")
        self.admissions = AsyncAdmissions(client, self.keys, cfg.groups_per_batch, cfg.async_generation_ratio)
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
        self.validation = ValidationPlayer(self)
        self._val_tasks: set[asyncio.Task[None]] = set()
        self._val_rounds: set[int] = set()
        self._beat = client.register_script(HEARTBEAT_LUA)
        self.writer = f"writes:worker:{rank}"
        """This worker's field in the run hash: how many entries it has written."""
        self.writes_base: int | None = None
        """This writer's count in Redis when the process started writing."""
        self.writes = 0
        """How many of this process's writes Redis has acknowledged."""

    # ---- the loop ----

    async def run(self) -> None:
        """Play until stopped (SIGTERM: in-flight episodes are abandoned and reported) or, in burst mode,
        until every group has played episodes_per_group episodes."""
        groups = [GroupRunner(self, spec) for spec in self.layout.groups_of(self.rank)]
        log.info("worker %d: %d groups, %d envs", self.rank, len(groups), len(groups) * self.layout.group_size)
        stream_ids = await self._load_published_version()
        self.writes_base = int(await self.client.hget(self.keys.run, self.writer) or 0)
        background = [asyncio.create_task(self._follow_streams(stream_ids), name="follow-streams"),
                      asyncio.create_task(self._heartbeat(), name="heartbeat")]
        members = [asyncio.create_task(g.run_member(m), name=f"g{g.spec.group_index}/m{m}")
                   for g in groups for m in range(self.layout.group_size)]
        playing = asyncio.gather(*members)
        stopped = asyncio.create_task(self.stop.wait())
        failure: BaseException | None = None
        try:
            await asyncio.wait([playing, stopped, *background], return_when=asyncio.FIRST_COMPLETED)
            for task in (playing, *background):  # a member or the heartbeat failed: clean up, then re-raise
                if task.done() and not task.cancelled() and task.exception() is not None:
                    failure = task.exception()
                    break
        finally:
            # The loops also end by this flag: redis-py can swallow a cancellation that lands inside a blocking
            # command (redis/redis-py#2028, #2579), and a `while True` loop would then never return.
            self.stop.set()
            tasks = [playing, *members, *background, stopped, *self._val_tasks]  # gather cancels none on a failure
            for task in tasks:
                task.cancel()
            done, stuck = await asyncio.wait(tasks, timeout=SHUTDOWN_REPORT_S)
            for task in done:  # retrieved, so none is logged as never retrieved; a member's failure is re-raised
                if not task.cancelled():
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

    async def _report_shutdown(self, groups: list[GroupRunner]) -> None:
        for g in groups:
            if not await g.drop_unfinished("shutdown"):
                return  # Redis is gone: one failure is enough waiting
        await self.client.delete(self.keys.worker(self.rank))

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
        async with self.version_loaded:
            await self.version_loaded.wait_for(lambda: self.policy.version >= version or self.stop.is_set())

    # ---- following the control and weights streams ----

    async def _load_published_version(self) -> dict[str, bytes | str]:
        """Load the newest announced weights; returns where to follow the streams from, so nothing is missed."""
        ids: dict[str, bytes | str] = {}
        for stream in (self.keys.control, self.keys.weights):
            last = await self.client.xrevrange(stream, count=1)
            ids[stream] = last[0][0] if last else "0-0"
            if last and stream == self.keys.weights:
                await self._load(last[0][1])
        round_in_progress = await self.client.get(self.keys.paused)
        if round_in_progress:  # we started during a validation round: play our share of it
            round_, version = map(int, round_in_progress.split())
            self._start_validation(round_, version)
        return ids

    async def _follow_streams(self, ids: dict[str, bytes | str]) -> None:
        while not self.stop.is_set():
            replies = await self.client.xread(ids, block=self.cfg.redis.block_ms)  # type: ignore[arg-type]
            for stream, entries in replies:
                name = stream.decode()
                ids[name] = entries[-1][0]
                if name == self.keys.weights:
                    await self._load(entries[-1][1])  # only the newest version matters
                for entry_id, fields in entries if name == self.keys.control else ():
                    try:
                        if fields.get(b"kind") == b"val":
                            self._start_validation(int(fields[b"round"]), int(fields[b"version"]))
                    except (KeyError, ValueError) as e:  # a malformed message must not stop the follower
                        self._refuse(f"control message {entry_id!r}", e)
            if replies:
                self.notified.set()

    async def _load(self, fields: dict[bytes, bytes]) -> None:
        """Load an announced version. One that does not parse, cannot be fetched or fails its digest is refused:
        logged, counted in the heartbeat's errors, the old weights stay, and the next announcement is tried."""
        try:
            version, digest = int(fields[b"version"]), fields.get(b"digest", b"").decode()
        except (KeyError, ValueError) as e:
            self._refuse(f"weights announcement {dict(fields)!r:.200}", e)
            return
        # A version announced again with other weights is a resumed trainer's model: load it too.
        republished = version == self.policy.version and digest and digest != self.loaded_digest
        if version > self.policy.version or republished:
            announced = fields.get(b"uri", b"").decode()
            try:
                uri = await fetch_weights(self.client, self.keys, announced, self.downloads)
                await self.policy.load_weights(version, uri, digest)
            except (asyncio.CancelledError, RedisUnavailable):
                raise
            except Exception as e:  # pruned, lost, corrupt, or not weights at all: a newer version will come
                self._refuse(f"policy version {version}", e)
                return
            self.loaded_digest = digest
            if uri != announced:
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
        key, every = self.keys.worker(self.rank), self.cfg.redis.heartbeat_s
        host, pid = socket.gethostname(), os.getpid()
        while not self.stop.is_set():
            total = sum(self.stats.episodes.values())
            elapsed = max(time.time() - self.stats.started_at, 1e-9)
            beat = {
                "rank": self.rank, "host": host, "pid": pid, "envs": len(self.layout.groups_of(self.rank))
                * self.layout.group_size, "episodes": total, "errors": sum(self.stats.errors.values()),
                "episodes_per_s": round(total / elapsed, 3), "loaded_version": self.policy.version,
                "last_seen": round(time.time(), 3),
            }
            await self._beat(keys=[key], args=[max(1, int(5 * every)), *(x for kv in beat.items() for x in kv)])
            # An idle worker (waiting for a slot) writes nothing: check here too that Redis kept our writes.
            self._check_writes(int(await self.client.hget(self.keys.run, self.writer) or 0), self._writes_floor())
            await asyncio.sleep(every)

    # ---- playing and writing ----

    async def play(self, env: TextEnv, spec: EpisodeSpec, sampling: Sampling, render_dir: Path | None = None
                   ) -> Trajectory:
        return await play_episode(env, self.policy, spec, sampling, render_dir, chat=self.chat,
                                  sequence_length=self.cfg.sequence_length)

    async def publish(self, fields: dict[str, bytes | str | int | float], stream: str | None = None) -> None:
        """XADD, counting this writer's entries in the same transaction: a count lower than the last one seen
        means Redis lost writes it had acknowledged (RedisDataLost), instead of training on."""

        async def write() -> list[object]:
            async with self.client.pipeline(transaction=True) as pipe:
                pipe.xadd(stream or self.keys.traj, fields)  # type: ignore[arg-type]
                pipe.hincrby(self.keys.run, self.writer, 1)
                return await pipe.execute()  # type: ignore[no-any-return]

        if self.writes_base is None:  # read once, before any write of this process
            self.writes_base = int(await self.client.hget(self.keys.run, self.writer) or 0)
        floor = self._writes_floor()  # acknowledged before this write was sent (others may be in flight)
        _, written = await write_with_backoff(write, "writing a trajectory", self.cfg.redis.max_outage_s)
        self._check_writes(int(written) - 1, floor)  # a retried write may count twice, never less
        self.writes += 1

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
        self.admitted: dict[int, int] = {}
        """k -> episode index of this group's k-th episode, until every member is done with it."""
        self.done: dict[int, set[int]] = defaultdict(set)
        """k -> members done with it: their trajectory is in the stream, or they skipped a failed episode."""
        self.failed: set[int] = set()
        """k's already reported to the trainer as failed; the members still to play them skip them."""
        self.num_admitted = 0
        self.last_episode = -1
        """The highest episode index admitted to this group in this process: Redis never hands out a lower one."""
        self.lock = asyncio.Lock()

    async def next_episode(self, k: int) -> int | None:
        """The k-th episode of this group (k counts per member): admitted by whichever member needs it first."""
        if self.worker.episodes_per_group is not None and k >= self.worker.episodes_per_group:
            return None
        if k < self.num_admitted:
            # Already admitted: never queue behind a member that is waiting for a slot for a later episode,
            # or the group can deadlock (its slots free up only when the slow members finish this one).
            return self.admitted[k]
        async with self.lock:
            if k == self.num_admitted:
                admission = await self.worker.wait_for_slot(self.prefix)
                if admission is None or admission.episode is None:
                    return None
                if admission.episode <= self.last_episode:
                    raise RedisDataLost(
                        f"worker {self.worker.rank}: Redis admitted episode {admission.episode} of {self.prefix}* "
                        f"again (episode {self.last_episode} was already admitted): it lost writes (a restart "
                        f"without its AOF, or an AOF behind); {RESUME_HINT}")
                self.last_episode = admission.episode
                self.admitted[k] = admission.episode
                self.num_admitted += 1
            return self.admitted[k]

    async def run_member(self, member: int) -> None:
        env = self._make_env()
        k = 0
        while (episode := await self.next_episode(k)) is not None:
            if k not in self.failed and not await self._play(env, k, episode, member):
                env = self._make_env()  # the failed instance may be in any state
            self._mark_done(k, member)
            k += 1

    async def _play(self, env: TextEnv, k: int, episode: int, member: int) -> bool:
        """Play one episode and publish it; False if the env raised (the group is then reported failed)."""
        spec = EpisodeSpec("train", self.spec.tag, self.spec.group_index, episode, member,
                           episode_seed(self.worker.cfg.seed, "train", self.spec.group_index, episode),
                           self.worker.rank)
        try:
            traj = await self.worker.play(env, spec, self._sampling(), self.worker.render_dir)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # an env (or a user's env) that raises must not take the worker down
            log.exception("worker %d: %s failed", self.worker.rank, spec.group_id)
            self.worker.stats.errors[self.spec.tag] += 1
            await self._report_failed(k, spec.group_id, f"{type(e).__name__}: {e}")
            return False
        if k not in self.failed:  # a member that failed meanwhile already ended the group
            await self.worker.publish(encode_trajectory(traj))
            self.worker.stats.episodes[self.spec.tag] += 1
        return True

    def _mark_done(self, k: int, member: int) -> None:
        self.done[k].add(member)
        if len(self.done[k]) == self.worker.layout.group_size:
            del self.done[k], self.admitted[k]
            self.failed.discard(k)

    def _make_env(self) -> TextEnv:
        return make_env(self.spec.tag, self.worker.cfg.custom_envs)

    def _sampling(self) -> Sampling:
        return Sampling.training(self.env_cfg.max_tokens_per_step, self.worker.cfg.actor_infer.generating_args)

    async def _report_failed(self, k: int, group_id: str, detail: str) -> None:
        if k in self.failed:
            return
        self.failed.add(k)
        await self.worker.publish(encode_drop(GroupDropNotice(group_id, "error", detail[:500], self.worker.rank)))

    async def drop_unfinished(self, reason: str) -> bool:
        """On shutdown: tell the trainer which admitted episodes will never complete, so their slots return.
        False when Redis could not be reached."""
        for k, episode in list(self.admitted.items()):
            if k in self.failed:
                continue
            group_id = f"{self.prefix}{episode}"
            try:
                await self.worker.publish(encode_drop(GroupDropNotice(group_id, reason, "", self.worker.rank)))
            except Exception:  # Redis gone at shutdown: the trainer's group timeout recovers the slots
                log.warning("worker %d: could not report unfinished episodes as %s; the trainer's group_timeout_s "
                            "will return their slots", self.worker.rank, reason)
                return False
        return True


class ValidationPlayer:
    """This worker's share of the val groups (dealt round-robin over the train workers), played once per round
    greedily (member 0) and `val_sampled_episodes` times at the training sampling settings (members 1..n), at
    most val_env_manager.max_env_num_per_worker episodes at once."""

    def __init__(self, worker: EnvWorker) -> None:
        self.worker = worker
        cfg = worker.cfg
        self.groups = []
        if cfg.eval_steps:
            val = plan_layout(cfg.val_env_manager, cfg.custom_envs, "val_env_manager")
            self.groups = [g for g in val.groups if g.group_index % worker.layout.num_workers == worker.rank]
        self.members = 1 + cfg.val_sampled_episodes
        self.concurrency = cfg.val_env_manager.max_env_num_per_worker

    async def play_round(self, round_: int, version: int) -> None:
        await self.worker.ensure_version(version)
        slots = asyncio.Semaphore(self.concurrency)

        async def play(spec: GroupSpec, member: int) -> None:
            async with slots:
                await self._play(spec, round_, member)

        await asyncio.gather(*(play(g, m) for g in self.groups for m in range(self.members)))

    async def _play(self, group: GroupSpec, round_: int, member: int) -> None:
        cfg, worker = self.worker.cfg, self.worker
        # Every round plays the same held-out maps: the seed ignores the round.
        spec = EpisodeSpec("val", group.tag, group.group_index, round_, member,
                           episode_seed(cfg.seed, "val", group.group_index, 0), worker.rank)
        max_tokens = cfg.custom_envs[group.tag].max_tokens_per_step
        sampling = (Sampling(max_tokens, temperature=0.0) if member == VAL_GREEDY_MEMBER
                    else Sampling.training(max_tokens, cfg.actor_infer.generating_args))
        try:
            traj = await worker.play(make_env(group.tag, cfg.custom_envs), spec, sampling)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.exception("worker %d: validation episode %s member %d failed", worker.rank, spec.group_id, member)
            notice = GroupDropNotice(spec.group_id, "error", f"{type(e).__name__}: {e}"[:500], worker.rank)
            await worker.publish(encode_drop(notice), worker.keys.val)
            return
        await worker.publish(encode_trajectory(traj), worker.keys.val)
