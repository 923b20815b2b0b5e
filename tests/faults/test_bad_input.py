"""Bad input on the wire: entries that decode but carry fields of the wrong type, fuzz, and the dead-letter cap."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack
import redis

from tests.faults.conftest import FaultRedis, audit, wait_until

TRAJ = "rollstream:faults:traj"
DEAD = "rollstream:faults:dead"
COUNTERS = "rollstream:faults:counters"


def _a_real_entry(client: redis.Redis) -> dict[bytes, bytes]:
    entries = wait_until(lambda: client.xrange(TRAJ, count=1), 60, "a first trajectory in the stream")
    return entries[0][1]


def _mutated(fields: dict[bytes, bytes], change: Any) -> dict[bytes, bytes]:
    """The entry with its payload body changed by `change(body)`; arrays stay opaque msgpack extensions."""
    message = msgpack.unpackb(fields[b"payload"], raw=False, ext_hook=msgpack.ExtType)
    change(message["body"])
    return {**fields, b"payload": msgpack.packb(message, use_bin_type=True)}


def _set(name: str, value: Any) -> Any:
    return lambda body: body.__setitem__(name, value)


def _set_turn_version(value: Any) -> Any:
    return lambda body: body["turns"][0].__setitem__(0, value)


MISTYPED = {
    "group_id null": _set("group_id", None),
    "group_id a list": _set("group_id", ["train", "FrozenLake"]),
    "member a string": _set("member", "3"),
    "turn version a string": _set_turn_version("7"),
    "episode a float": _set("episode", 2.5),
    "turns a map": _set("turns", {"a": 1}),
}


def test_mistyped_entries_are_dead_lettered_and_training_goes_on(fault_redis: FaultRedis, job_factory) -> None:
    job = job_factory(fault_redis.url, "max_steps=4", "train_env_manager.max_env_num_per_worker=32")
    client = fault_redis.client()
    job.start_workers()
    real = _a_real_entry(client)
    for change in MISTYPED.values():
        client.xadd(TRAJ, _mutated(real, change))
    job.start_trainer()
    assert job.wait_trainer(120) == 0, job.log("trainer")[-3000:]
    reasons = [f[b"reason"].decode() for _, f in client.xrange(DEAD)]
    assert len(reasons) == len(MISTYPED), reasons
    assert int(client.hget(COUNTERS, "dead_letters")) == len(MISTYPED)
    assert any("group_id is NoneType" in r for r in reasons), reasons
    assert any("member is str" in r for r in reasons), reasons
    result = audit(Path(job.record))
    assert not result.twice and not result.incomplete
    assert len(result.groups) == 4 * job.cfg.groups_per_batch
