"""The trainer killed -9 again and again in one run and restarted: it re-reads its pending entries and goes on
from the ledger's version; nothing is trained twice."""

from __future__ import annotations

import time

import pytest

from tests.faults.conftest import FaultRedis, audit, wait_until
from tests.faults.test_outage import SLOW

NS = "rollstream:faults"
STEPS = 16


@pytest.mark.slow
def test_the_trainer_killed_three_times_in_one_run(fault_redis: FaultRedis, job_factory) -> None:
    job = job_factory(fault_redis.url, f"max_steps={STEPS}", *SLOW)
    job.start_workers()
    job.start_trainer()
    # Each kill comes as soon as the restarted trainer's first step is seen; with a backlog of complete groups it
    # may commit a few more in that moment, so the run has room for three rounds of those.
    wait_until(lambda: fault_redis.version() >= 2, 120, "version 2")
    recoveries = []
    for _ in range(3):
        assert fault_redis.version() < STEPS, "the run ended before its three kills were done"
        job.procs["trainer"].kill()  # kill -9, mid-step or between steps
        job.procs["trainer"].wait()
        before, restarted = fault_redis.version(), time.monotonic()
        job.start_trainer()
        wait_until(lambda b=before: fault_redis.version() > b, 120, "a step by the restarted trainer", every_s=0.05)
        recoveries.append(time.monotonic() - restarted)
    print(f"\ntrainer kill -9: seconds from restart to its first step {[round(r, 1) for r in recoveries]}")
    assert job.wait_trainer(120) == 0, job.log("trainer")[-3000:]
    result = audit(job.record)
    assert not result.twice and not result.incomplete
    counters = {k.decode(): int(v) for k, v in fault_redis.client().hgetall(f"{NS}:counters").items()}
    assert counters["trained"] == STEPS * job.cfg.groups_per_batch, counters
    # the record is written after each commit: a kill between the two loses a batch from the record only
    assert len(result.groups) >= (STEPS - 3) * job.cfg.groups_per_batch
