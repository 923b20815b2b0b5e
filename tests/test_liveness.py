"""Dead env-workers are noticed by their heartbeat, and the trainer ends the experiment cleanly at max_steps.

Real processes (`rollstream producer` / `rollstream trainer`) against the tests' own Redis.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import redis
import redis.asyncio

from rollstream.shared.codec import decode_entry
from rollstream.shared.config import RollstreamConfig, dump_config
from rollstream.shared.keys import Keys
from rollstream.shared.ledger import AsyncAdmissions, Ledger, owner_tag, read_counters, reconciles
from rollstream.shared.recording import read_records
from rollstream.shared.schema import parse_group_id
from tests.conftest import scripted_config

KEYS = Keys.for_exp("t")


def _admit(url: str, prefix: str, owner: str) -> int | None:
    async def go() -> int | None:
        client = redis.asyncio.Redis.from_url(url)
        episode = (await AsyncAdmissions(client, KEYS, groups_per_batch=4, ratio=0, owner=owner).admit(prefix)).episode
        await client.aclose()
        return episode

    return asyncio.run(go())


def test_groups_of_a_gone_or_restarted_worker_are_lost_and_end_records_are_cleaned(redis_server,
                                                                                  redis_client) -> None:
    ledger = Ledger(redis_client, KEYS)
    assert _admit(redis_server.url, "train/A/g0/e", owner_tag(0, "aaa")) == 0
    assert _admit(redis_server.url, "train/A/g1/e", owner_tag(1, "bbb")) == 0
    redis_client.hset(KEYS.worker(0), "incarnation", "aaa")
    redis_client.hset(KEYS.worker(1), "incarnation", "bbb")
    assert ledger.lost_groups() == {}
    redis_client.hset(KEYS.worker(0), "incarnation", "ccc")  # rank 0 restarted
    redis_client.delete(KEYS.worker(1))  # rank 1's heartbeat expired
    assert ledger.lost_groups() == {"train/A/g0/e0": 0, "train/A/g1/e0": 1}
    assert ledger.finish("train/A/g0/e0", "worker_lost_dropped", [])
    assert ledger.lost_groups() == {"train/A/g1/e0": 1}
    assert redis_client.hkeys(KEYS.owners) == [b"train/A/g1/e0"]  # ended groups leave the owners hash
    assert ledger.finish_experiment(3) == 1
    assert _admit(redis_server.url, "train/A/g0/e", owner_tag(0, "ccc")) is None  # finished: nothing admitted
    counts = ledger.counters()
    assert counts["worker_lost_dropped"] == 1 and counts["unused_at_end"] == 1 and counts["in_flight"] == 0
    assert reconciles(counts)


def _wait(condition: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _partial_group_of(client: redis.Redis, keys: Keys, rank: int) -> bool:
    """Some in-flight group admitted by worker `rank` has between 1 and group_size - 1 members in the stream."""
    mine = {g for g, o in client.hgetall(keys.owners).items() if o.startswith(f"{rank} ".encode())}
    members = Counter(f[b"group_id"] for _, f in client.xrange(keys.traj) if f[b"group_id"] in mine)
    return any(0 < n < 8 for n in members.values())


def _spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "rollstream", *args], env=env, stdout=out,
                                stderr=subprocess.STDOUT)


def _setup(tmp_path: Path, url: str, exp: str, *overrides: str) -> tuple[RollstreamConfig, Path, dict[str, str]]:
    cfg = scripted_config(tmp_path, f"exp_name={exp}", "async_generation_ratio=0", "group_timeout_s=600",
                          "redis.heartbeat_s=0.5", "train_env_manager.max_env_num_per_worker=32",  # 2 workers
                          f"record_to={tmp_path / 'trained.msgpack'}",
                          "actor_infer.strategy_args.strategy_config.delay_s=0.01", *overrides)
    path = tmp_path / "config.yaml"
    dump_config(cfg, path)
    return cfg, path, os.environ | {"ROLLSTREAM_REDIS_URL": url}


def test_a_killed_worker_is_noticed_in_seconds_rejoins_and_every_worker_exits_0_at_the_end(
        tmp_path, redis_server, redis_client: redis.Redis) -> None:
    # max_steps leaves room for worker 0 to restart (5-15 s of imports) while worker 1 alone drives the steps
    cfg, config, env = _setup(tmp_path, redis_server.url, "live", "max_steps=60",
                              "actor_infer.strategy_args.strategy_config.delay_s=0.04")
    keys = Keys.for_exp("live")
    version = lambda: int(redis_client.get(keys.version) or 0)  # noqa: E731
    trainer = _spawn(["trainer", str(config)], env, tmp_path / "trainer.log")
    workers = {rank: _spawn(["producer", str(config), "--worker-rank", str(rank)], env,
                            tmp_path / f"producer-{rank}.log") for rank in (0, 1)}
    try:
        _wait(lambda: version() >= 2 and _partial_group_of(redis_client, keys, rank=0), "a partial group of worker 0")
        workers[0].send_signal(signal.SIGKILL)  # r = 0: the batch needs every slot, the partial group's too
        workers[0].wait()
        killed_at, t_kill = version(), time.monotonic()
        # group_timeout_s is 600 s: only the heartbeat (expires after 5 x 0.5 s) can let training go on
        _wait(lambda: version() >= killed_at + 2, "training to go on without worker 0")
        print(f"training went on {time.monotonic() - t_kill:.1f} s after kill -9 (heartbeat_s 0.5)")
        assert read_counters(redis_client, keys).get("worker_lost_dropped", 0) >= 1

        episodes_before = {g: int(n) for g, n in redis_client.hgetall(keys.episodes).items()}
        workers[0] = _spawn(["producer", str(config), "--worker-rank", "0"], env, tmp_path / "producer-0.log")
        _wait(lambda: any(o.startswith(b"0 ") for o in redis_client.hvals(keys.owners)), "worker 0 to rejoin")
        assert version() < cfg.max_steps, "the run ended before the restarted worker rejoined: raise max_steps"
        assert trainer.wait(timeout=120) == 0
        for rank, w in workers.items():
            assert w.wait(timeout=60) == 0, f"worker {rank} exited {w.returncode}"
    finally:
        for p in [trainer, *workers.values()]:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert redis_client.get(keys.finished) == str(cfg.max_steps).encode()
    trajs = [decode_entry(r) for r in read_records(tmp_path / "trained.msgpack")]
    assert len(trajs) == cfg.max_steps * cfg.rollout_batch_size
    assert len({t.traj_id for t in trajs}) == len(trajs)  # nothing trained twice
    assert set(Counter(t.group_id for t in trajs).values()) == {8}
    # a group slot that had played no episode before the restart is not in the snapshot: all its episodes are new
    rejoined = [t for t in trajs if t.worker_rank == 0 and parse_group_id(t.group_id)[3] >=
                episodes_before.get(t.group_id.rsplit("/e", 1)[0].encode() + b"/e", 0)]
    assert rejoined, "the restarted worker 0 contributed no trained group"
    assert all(t.turns[0].version >= 1 for t in rejoined)  # it loaded the published weights, not version 0
    counts = read_counters(redis_client, keys)
    assert counts["in_flight"] == 0 and reconciles(counts), counts
    assert not redis_client.exists(keys.worker(0), keys.worker(1))
    assert f"finished the experiment at version {cfg.max_steps}" in (tmp_path / "producer-1.log").read_text()


def test_a_producer_started_after_the_end_exits_0_at_once_saying_so(tmp_path, redis_server, redis_client) -> None:
    _, config, env = _setup(tmp_path, redis_server.url, "ended")
    Ledger(redis_client, Keys.for_exp("ended")).finish_experiment(20)
    done = subprocess.run([sys.executable, "-m", "rollstream", "producer", str(config), "--worker-rank", "0"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "already finished at version 20" in done.stderr
    assert read_counters(redis_client, Keys.for_exp("ended")).get("admitted", 0) == 0


def test_two_workers_of_one_rank_both_stop_with_a_clear_error(tmp_path, redis_server, redis_client) -> None:
    _, config, env = _setup(tmp_path, redis_server.url, "twins")
    twins = [_spawn(["producer", str(config), "--worker-rank", "1"], env, tmp_path / f"twin-{i}.log") for i in (0, 1)]
    try:
        codes = [p.wait(timeout=60) for p in twins]
    finally:
        for p in twins:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert codes == [2, 2]  # a configuration error: one line, no traceback
    for i in (0, 1):
        log = (tmp_path / f"twin-{i}.log").read_text()
        assert "rollstream: error: env-worker rank 1 also runs on host" in log and "Traceback" not in log
