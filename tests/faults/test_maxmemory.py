"""Redis at maxmemory (noeviction): producers back off and retry, a trainer started at the limit gets its group
and drains, nobody crashes, nothing is lost or trained twice."""

from __future__ import annotations

import pytest
import redis

from tests.faults.conftest import FaultRedis, audit, wait_until

NS = "rollstream:faults"


@pytest.mark.slow
def test_producers_wait_at_maxmemory_and_a_late_trainer_drains(fault_redis: FaultRedis, job_factory) -> None:
    job = job_factory(fault_redis.url, "max_steps=6", "train_env_manager.max_env_num_per_worker=32")
    client = fault_redis.client()
    workers = job.start_workers()
    # The producers fill what the version cap lets them (two batches), then Redis is put over its limit.
    wait_until(lambda: client.xlen(f"{NS}:traj") >= 2 * job.cfg.rollout_batch_size, 90, "a full backlog")
    limit = client.info("memory")["used_memory"] - 4096
    client.set("filler", b"x" * 2**20)  # keeps Redis over its limit after the trainer frees the backlog
    client.config_set("maxmemory", limit)
    with pytest.raises(redis.OutOfMemoryError):
        client.set("probe", 1)
    job.start_trainer()  # its consumer group is created over the limit; it trains the backlog, freeing it
    wait_until(lambda: any("Redis is at maxmemory" in job.log(f"producer-{r}") for r in range(job.num_workers)),
               90, "a producer refused at maxmemory")
    assert job.procs["trainer"].poll() is None
    # Room again, as an operator makes it: the producers' retries go through. Deleting the filler alone is not
    # enough: what else Redis holds by now (the control and weights streams, client buffers, the trainer's
    # connection) can stay above a limit taken to the byte from the backlog's moment.
    client.delete("filler")
    client.config_set("maxmemory", limit + 16 * 2**20)
    assert job.wait_trainer(120) == 0, job.log("trainer")[-3000:]
    # they waited, not crashed: at the trainer's clean end every producer exits 0
    assert [p.wait(timeout=60) for p in workers] == [0] * len(workers)
    for name in ("trainer", *(f"producer-{r}" for r in range(job.num_workers))):
        assert "Traceback" not in job.log(name), job.log(name)[-3000:]
    result = audit(job.record)
    assert not result.twice and not result.incomplete and len(result.groups) == 6 * job.cfg.groups_per_batch
    counters = {k.decode(): int(v) for k, v in client.hgetall(f"{NS}:counters").items()}
    assert counters["trained"] == 6 * job.cfg.groups_per_batch
