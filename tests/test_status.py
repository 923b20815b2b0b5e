"""`rollstream status` reads the heartbeats as typed messages: workers and engines listed, garbage counted."""

import redis

from rollstream.shared.keys import Keys
from rollstream.shared.messages import EngineBeat, WorkerBeat
from rollstream.shared.status import format_status, read_status

KEYS = Keys.for_exp("st")


def test_status_lists_workers_and_engines_and_counts_unreadable_beats(redis_client: redis.Redis) -> None:
    worker = WorkerBeat(rank=0, host="h1", pid=11, incarnation="a", envs=16, episodes=40, errors=0,
                        episodes_per_s=2.5, loaded_version=3, last_seen=0.0)
    engine = EngineBeat(rank=0, url="http://h2:8000", host="h2", pid=12, incarnation="b", loaded_version=3,
                        reloads=3, last_reload_s=0.08, last_seen=0.0)
    redis_client.hset(KEYS.worker(0), mapping=worker.fields())
    redis_client.hset(KEYS.engine(0), mapping=engine.fields())
    redis_client.hset(KEYS.worker(1), mapping={"rank": "one"})
    status = read_status(redis_client, KEYS)
    assert status.workers == [worker] and status.engines == [engine] and status.unreadable_beats == 1
    text = format_status(status, KEYS.ns)
    assert "http://h2:8000" in text and "h1" in text and "unreadable heartbeats" in text
