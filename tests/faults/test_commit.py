"""A step's commit is all or nothing and applied once, even when its reply is lost across a Redis restart."""

from __future__ import annotations

import pytest
import redis

from rollstream.consumer.data.batcher import Batcher
from rollstream.shared.codec import encode_trajectory
from rollstream.shared.config import RedisConfig
from rollstream.shared.keys import TRAINER_GROUP, Keys
from rollstream.shared.ledger import Ledger
from rollstream.shared.messages import WeightsAnnouncement
from rollstream.shared.redis_io import RedisDataLost, connect
from tests.conftest import scripted_config
from tests.factories import make_traj
from tests.faults.conftest import FaultRedis, ReplyDropper

KEYS = Keys.for_exp("faults")
GROUP = "train/FrozenLake/g0/e0"


def _one_group_read_by_the_trainer(client: redis.Redis) -> list[bytes]:
    client.xgroup_create(KEYS.traj, TRAINER_GROUP, id="0", mkstream=True)
    ids = [client.xadd(KEYS.traj, {"group_id": GROUP, "member": m}) for m in range(2)]
    client.xreadgroup(TRAINER_GROUP, "trainer-0", {KEYS.traj: ">"})
    return ids


def test_a_commit_whose_reply_is_lost_across_a_restart_is_applied_once(fault_redis: FaultRedis) -> None:
    proxy = ReplyDropper(fault_redis.port)
    ledger = Ledger(connect(proxy.url, RedisConfig()), KEYS)
    ids = _one_group_read_by_the_trainer(fault_redis.client())
    ledger.register([GROUP])
    # The commit runs, then Redis is killed -9 and restarted (appendfsync always) before the reply gets back:
    # redis-py retries on a new connection, against an empty script cache.
    proxy.arm(KEYS.weights.encode(), on_drop=fault_redis.restart)
    ledger.commit_step([(GROUP, ids)], WeightsAnnouncement(1, "file:///w/v1", "sha256:x"))
    assert proxy.dropped.is_set()

    after = fault_redis.client()
    assert int(after.get(KEYS.version)) == 1
    assert [f[b"version"] for _, f in after.xrange(KEYS.weights)] == [b"1"]  # announced once
    assert int(after.hget(KEYS.counters, "trained")) == 1
    assert after.zcard(KEYS.inflight) == 0
    assert after.xlen(KEYS.traj) == 0 and after.xpending(KEYS.traj, TRAINER_GROUP)["pending"] == 0
    proxy.close()


def test_a_pipelined_commit_and_read_ahead_whose_reply_is_lost_across_a_restart(fault_redis: FaultRedis,
                                                                                 tmp_path) -> None:
    cfg = scripted_config(tmp_path, "exp_name=faults", "rollout_batch_size=4", "train_env_manager.group_size=2",
                          "train_env_manager.max_env_num_per_worker=4", "redis.read_count=4")
    proxy = ReplyDropper(fault_redis.port)
    batcher = Batcher(connect(proxy.url, RedisConfig()), cfg)
    client = fault_redis.client()
    batcher.ledger.register([make_traj(g).group_id for g in range(4)])
    for g in range(4):
        for m in range(2):
            client.xadd(KEYS.traj, encode_trajectory(make_traj(g, 0, m)))
    first = batcher.next_batch(0, timeout_s=5)
    assert first is not None
    # The commit and the read of the next entries run, then Redis is killed -9 and restarted (appendfsync always)
    # before their replies get back: redis-py sends the pipeline again on a new connection, where the commit
    # script is gone (NOSCRIPT) and the entries it read are pending to the trainer, unseen.
    proxy.arm(KEYS.weights.encode(), on_drop=fault_redis.restart)
    batcher.commit(first, WeightsAnnouncement(1, "file:///w/v1", "sha256:x"))
    assert proxy.dropped.is_set()
    second = batcher.next_batch(1, timeout_s=10)  # the stranded-entries check reads them again
    assert second is not None
    batcher.commit(second, WeightsAnnouncement(2))
    trained = sorted(g.group_id for g in first.groups + second.groups)
    assert trained == [make_traj(g).group_id for g in range(4)]  # each group once
    assert [f[b"version"] for _, f in client.xrange(KEYS.weights)] == [b"1", b"2"]  # each version announced once
    assert int(client.hget(KEYS.counters, "trained")) == 4 and client.zcard(KEYS.inflight) == 0
    assert client.xlen(KEYS.traj) == 0 and client.xpending(KEYS.traj, TRAINER_GROUP)["pending"] == 0
    proxy.close()


def test_a_commit_after_a_script_flush_still_marks_its_groups_trained(fault_redis: FaultRedis) -> None:
    client = fault_redis.client()
    ledger = Ledger(client, KEYS)
    ids = _one_group_read_by_the_trainer(client)
    ledger.register([GROUP])
    client.script_flush()
    ledger.commit_step([(GROUP, ids)], WeightsAnnouncement(1))
    assert int(client.get(KEYS.version)) == 1 and int(client.hget(KEYS.counters, "trained")) == 1


def test_a_commit_on_a_redis_whose_version_went_back_stops_with_one_clear_error(fault_redis: FaultRedis) -> None:
    client = fault_redis.client()
    ledger = Ledger(client, KEYS)
    ids = _one_group_read_by_the_trainer(client)
    ledger.register([GROUP])
    client.set(KEYS.version, 3)  # the trainer is at step 5: Redis lost steps 3 and 4
    with pytest.raises(RedisDataLost, match="Redis holds policy version 3, expected 5.*--fresh"):
        ledger.commit_step([(GROUP, ids)], WeightsAnnouncement(6))
    assert int(client.get(KEYS.version)) == 3 and client.zcard(KEYS.inflight) == 1  # nothing applied
