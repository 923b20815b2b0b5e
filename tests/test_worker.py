"""Env-workers against a real Redis: isolation of failing envs, worker-count consistency, rendered frames."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import numpy as np
import redis
import redis.asyncio
from PIL import Image

from rollstream.consumer.data.batcher import Batcher
from rollstream.producer.episode_book import EpisodeBook
from rollstream.producer.policy.scripted import ScriptedPolicy
from rollstream.producer.worker import WRITE_SCRIPT_BYTES, EnvWorker
from rollstream.shared.codec import decode_entry
from rollstream.shared.config import RollstreamConfig
from rollstream.shared.envs.frozen_lake import FrozenLakeEnv
from rollstream.shared.keys import Keys
from rollstream.shared.layout import plan_layout
from rollstream.shared.ledger import reconciles
from rollstream.shared.schema import GroupDropNotice, Trajectory
from tests.conftest import scripted_config


class ExplodingLake(FrozenLakeEnv):
    """FrozenLake whose episodes with an even seed raise in step (a user's env with a bug)."""

    def _play(self, action: str) -> tuple[float, bool]:
        if self._seed % 2 == 0:
            raise RuntimeError("the env blew up")
        return super()._play(action)

    def _new_episode(self, seed: int) -> None:
        self._seed = seed
        super()._new_episode(seed)


def _run_workers(cfg: RollstreamConfig, url: str, episodes_per_group: int) -> list[EnvWorker]:
    async def go() -> list[EnvWorker]:
        layout = plan_layout(cfg.train_env_manager, cfg.custom_envs, "train_env_manager")
        clients = [redis.asyncio.Redis.from_url(url) for _ in range(layout.num_workers)]
        workers = [EnvWorker(cfg, rank, c, ScriptedPolicy(invalid_reply_rate=0.1),
                             episodes_per_group=episodes_per_group) for rank, c in enumerate(clients)]
        await asyncio.gather(*(w.run() for w in workers))
        for c in clients:
            await c.aclose()
        return workers

    return asyncio.run(go())


def _stream(client: redis.Redis, exp: str) -> list[Trajectory | GroupDropNotice]:
    return [decode_entry(f) for _, f in client.xrange(Keys.for_exp(exp).traj)]


def _unlimited(tmp_path: Path, exp: str, *extra: str) -> RollstreamConfig:
    # a high ratio, so burst runs never wait for a trainer
    return scripted_config(tmp_path, f"exp_name={exp}", "async_generation_ratio=1000", *extra)


def test_an_env_that_raises_drops_its_group_and_the_worker_goes_on(tmp_path, redis_server, redis_client) -> None:
    cfg = _unlimited(tmp_path, "boom", "train_env_manager.tags=[FrozenLake]",
                     "train_env_manager.num_groups_partition=null",
                     "train_env_manager.num_env_groups=2", "train_env_manager.max_env_num_per_worker=16",
                     f"custom_envs.FrozenLake.env_type={__name__}:ExplodingLake")
    [worker] = _run_workers(cfg, redis_server.url, episodes_per_group=6)
    items = _stream(redis_client, "boom")
    failed = {i.group_id for i in items if isinstance(i, GroupDropNotice)}
    played = {i.group_id for i in items if isinstance(i, Trajectory)}
    assert failed and played and not failed & played  # every member of a failed group fails the same way
    assert all(i.reason == "error" and "the env blew up" in i.detail for i in items if isinstance(i, GroupDropNotice))
    assert len(failed) <= worker.stats.errors["FrozenLake"] <= 8 * len(failed)
    assert len(failed) + len(played) == 2 * 6  # the worker kept playing after every failure

    batcher = Batcher(redis_client, cfg)
    batcher.next_batch(0, timeout_s=1.0)
    counts = batcher.ledger.counters()
    assert counts["failed_dropped"] == len(failed) and counts["returned"] == len(failed)
    assert reconciles(counts)


def _fingerprints(items: list) -> Counter:
    return Counter((t.group_id, t.member, t.seed, t.score, tuple(turn.reply for turn in t.turns))
                   for t in items if isinstance(t, Trajectory))


def test_one_worker_or_four_play_the_same_multiset_of_trajectories(tmp_path, redis_server, redis_client) -> None:
    one = _unlimited(tmp_path, "w1", "train_env_manager.max_env_num_per_worker=64")
    four = _unlimited(tmp_path, "w4", "train_env_manager.max_env_num_per_worker=16")
    assert plan_layout(one.train_env_manager, one.custom_envs, "t").num_workers == 1
    _run_workers(one, redis_server.url, episodes_per_group=3)
    _run_workers(four, redis_server.url, episodes_per_group=3)
    a, b = _fingerprints(_stream(redis_client, "w1")), _fingerprints(_stream(redis_client, "w4"))
    assert sum(a.values()) == 8 * 8 * 3
    assert a == b


def test_render_save_dir_gets_a_png_per_step(tmp_path, redis_server, redis_client) -> None:
    frames = tmp_path / "frames"
    cfg = _unlimited(tmp_path, "frames", f"render_save_dir={frames}", "train_env_manager.num_env_groups=2",
                     "train_env_manager.num_groups_partition=[1,1]", "train_env_manager.group_size=2",
                     "rollout_batch_size=4", "train_env_manager.max_env_num_per_worker=4")
    _run_workers(cfg, redis_server.url, episodes_per_group=1)
    trajs = [t for t in _stream(redis_client, "frames") if isinstance(t, Trajectory)]
    assert len(trajs) == 4
    for t in trajs:
        pngs = sorted((frames / t.group_id / f"m{t.member}").glob("step*.png"))
        assert len(pngs) == len(t.turns) + 1  # the start, then one per step
        images = [np.asarray(Image.open(p)) for p in pngs]
        assert images[0].ndim == 3 and images[0].shape[0] >= 64
        moved = [i for i, turn in enumerate(t.turns) if turn.observation != (t.turns[i + 1].observation
                                                                            if i + 1 < len(t.turns) else None)]
        assert any(not np.array_equal(images[i], images[i + 1]) for i in moved)


def test_a_member_behind_gets_an_admitted_episode_while_another_waits_for_a_slot() -> None:
    """The hang seen in a real run: fast members waited for a slot holding the group's lock, slow members queued
    behind it for an episode that was already admitted, so no group completed and no slot was ever freed."""
    from types import SimpleNamespace

    from rollstream.producer.worker import GroupRunner
    from rollstream.shared.layout import GroupSpec

    async def scenario() -> None:
        never = asyncio.Event()

        async def wait_for_slot(prefix: str):  # type: ignore[no-untyped-def]
            await never.wait()  # the cap is reached: no slot until a group completes

        worker = SimpleNamespace(cfg=SimpleNamespace(custom_envs={"FrozenLake": None}), episodes_per_group=None,
                                 wait_for_slot=wait_for_slot, layout=SimpleNamespace(group_size=4))
        runner = GroupRunner(worker, GroupSpec(0, "FrozenLake", 0))  # type: ignore[arg-type]
        runner.book.admit(10), runner.book.admit(11)
        fast = asyncio.create_task(runner.next_episode(2))  # holds the lock while it waits for a slot
        await asyncio.sleep(0)
        assert await asyncio.wait_for(runner.next_episode(1), timeout=1.0) == 11
        fast.cancel()

    asyncio.run(scenario())


def test_the_episode_book_forgets_an_episode_once_every_member_is_done() -> None:
    book = EpisodeBook(group_size=2)
    assert book.episode(0) is None
    assert (book.admit(7), book.admit(9)) == (0, 1)
    assert (book.episode(0), book.episode(1), book.last_episode) == (7, 9, 9)
    book.mark_done(0, member=0)
    assert book.episode(0) == 7 and book.unfinished() == [7, 9]  # member 1 still plays it
    book.mark_done(0, member=1)
    assert book.episode(0) is None and book.unfinished() == [9]


def test_a_failed_episode_is_reported_once_skipped_by_the_rest_and_not_abandoned_again() -> None:
    book = EpisodeBook(group_size=3)
    k = book.admit(4)
    assert book.mark_failed(k) and not book.mark_failed(k)  # the first member to fail reports it
    assert book.failed(k) and book.unfinished() == []  # already ended: a stopping worker does not report it
    for member in range(3):
        book.mark_done(k, member)
    assert not book.failed(k) and book.episode(k) is None


def test_small_and_large_writes_add_every_entry_and_count_it(tmp_path, redis_server, redis_client) -> None:
    """Concurrent publishes go out together: small ones as one script, large ones (over WRITE_SCRIPT_BYTES in
    all) as one MULTI. Either way every entry lands whole, in order per caller, and the writer's count agrees."""
    cfg = _unlimited(tmp_path, "writes")
    keys = Keys.for_exp("writes")

    async def go() -> EnvWorker:
        client = redis.asyncio.Redis.from_url(redis_server.url)
        worker = EnvWorker(cfg, 3, client, ScriptedPolicy())
        small = [{"kind": "traj", "payload": bytes([i]) * 100, "n": i} for i in range(40)]
        large = [{"kind": "traj", "payload": bytes([i]) * (WRITE_SCRIPT_BYTES // 4), "n": i} for i in range(40, 50)]
        await asyncio.gather(*(worker.publish(f) for f in small))
        await asyncio.gather(*(worker.publish(f) for f in large))
        await worker.publish({"kind": "other", "payload": b"x"}, stream=keys.dead)
        await client.aclose()
        return worker

    worker = asyncio.run(go())
    entries = [f for _, f in redis_client.xrange(keys.traj)]
    assert [int(f[b"n"]) for f in entries] == list(range(50))
    assert all(f[b"payload"] == bytes([int(f[b"n"])]) * len(f[b"payload"]) for f in entries)
    assert [f[b"kind"] for _, f in redis_client.xrange(keys.dead)] == [b"other"]
    assert int(redis_client.hget(keys.run, worker.writer)) == worker.writes == 51
