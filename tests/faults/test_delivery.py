"""Entries delivered but never received, and a trainer that starts late: nothing is dropped that arrived."""

from __future__ import annotations

from tests.faults.conftest import FaultRedis, ReplyDropper, audit, wait_until

NS = "rollstream:faults"


def test_entries_whose_read_reply_was_lost_are_read_again(fault_redis: FaultRedis, job_factory) -> None:
    # group_timeout_s is long: without a re-read the stranded groups would hold their slots for 10 minutes
    job = job_factory(fault_redis.url, "max_steps=4", "group_timeout_s=600",
                      "train_env_manager.max_env_num_per_worker=32")
    proxy = ReplyDropper(fault_redis.port)
    proxy.arm(b"XREADGROUP", min_reply=2000)  # the first read that delivers entries: its reply is lost
    job.start_workers()
    job.start_trainer(url=proxy.url)
    assert job.wait_trainer(90) == 0, job.log("trainer")[-3000:]
    assert proxy.dropped.is_set()
    assert "delivered to this trainer but never received" in job.log("trainer")
    result = audit(job.record)
    assert not result.twice and not result.incomplete and len(result.groups) == 4 * job.cfg.groups_per_batch
    assert int(fault_redis.client().hget(f"{NS}:counters", "timeout_dropped") or 0) == 0
    proxy.close()


def test_a_trainer_started_after_group_timeout_s_trains_the_backlog(fault_redis: FaultRedis, job_factory) -> None:
    job = job_factory(fault_redis.url, "max_steps=2", "group_timeout_s=1",
                      "train_env_manager.max_env_num_per_worker=32")
    client = fault_redis.client()
    for proc in job.start_workers("--episodes-per-group", "1"):  # burst: each group plays one episode, then exits
        assert proc.wait(timeout=60) == 0
    assert client.xlen(f"{NS}:traj") == 64  # the whole backlog: 8 complete groups

    def admitted_long_ago() -> bool:
        now = client.time()[0]
        return all(score < now - 2 for _, score in client.zrange(f"{NS}:inflight", 0, -1, withscores=True))

    wait_until(admitted_long_ago, 10, "every group older than group_timeout_s")
    job.start_trainer()
    assert job.wait_trainer(60) == 0, job.log("trainer")[-3000:]
    counters = {k.decode(): int(v) for k, v in client.hgetall(f"{NS}:counters").items()}
    assert counters.get("timeout_dropped", 0) == 0 and counters["trained"] == 8, counters
    result = audit(job.record)
    assert not result.twice and not result.incomplete and len(result.groups) == 8


