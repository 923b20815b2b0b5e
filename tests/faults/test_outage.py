"""Redis killed -9 and restarted (appendfsync always), gone for a while, stopped with SIGSTOP: every process
waits, reconnects with backoff and training goes on; nothing lost, nothing twice. Gone longer than
redis.max_outage_s: every process exits with one clear line."""

from __future__ import annotations

import time

import pytest

from tests.faults.conftest import FaultRedis, Job, audit, wait_until

NS = "rollstream:faults"
STEPS = 6
SLOW = ("actor_infer.strategy_args.strategy_config.delay_s=0.02", "train_env_manager.max_env_num_per_worker=32")


def _check_run(server: FaultRedis, job, steps: int = STEPS) -> None:
    assert job.wait_trainer(180) == 0, job.log("trainer")[-3000:]
    result = audit(job.record)
    assert not result.twice, result.twice[:5]
    assert not result.incomplete, result.incomplete[:5]
    assert len(result.groups) == steps * job.cfg.groups_per_batch
    for name in ("trainer", *(f"producer-{r}" for r in range(job.num_workers))):
        assert "Traceback" not in job.log(name), job.log(name)[-3000:]
    counters = {k.decode(): int(v) for k, v in server.client().hgetall(f"{NS}:counters").items()}
    assert counters["trained"] == steps * job.cfg.groups_per_batch, counters


def _recovery(server: FaultRedis, before: int, job: Job) -> float:
    """Seconds from Redis being back to the next committed step."""
    back = time.monotonic()
    try:
        wait_until(lambda: server.version() > before, 60, "a step after Redis came back", every_s=0.05)
    except AssertionError as timeout:  # say where each process stood
        raise AssertionError(f"{timeout}\n{job.log_tails()}") from None
    return time.monotonic() - back


@pytest.mark.slow
def test_redis_killed_and_restarted_three_times_during_a_run(fault_redis: FaultRedis, job_factory) -> None:
    # Each restart comes as soon as the step after the last one is seen; a backlog of complete groups lets the
    # trainer commit a step or two in the moment before that, so the run has room for three rounds of those.
    steps = 4 * STEPS
    job = job_factory(fault_redis.url, f"max_steps={steps}", *SLOW)
    job.start_workers()
    job.start_trainer()
    wait_until(lambda: fault_redis.version() >= 1, 90, "version 1")
    recoveries = []
    for _ in range(3):
        before = fault_redis.version()
        assert before < steps, f"the run ended (version {before}) before its three restarts were done"
        fault_redis.restart()  # kill -9, then the same port and data
        recoveries.append(_recovery(fault_redis, before, job))
    print(f"\nkill -9 + restart: seconds to the next step {[round(r, 2) for r in recoveries]}")
    _check_run(fault_redis, job, steps)


@pytest.mark.slow
def test_redis_gone_for_a_while_then_back(fault_redis: FaultRedis, job_factory) -> None:
    job = job_factory(fault_redis.url, f"max_steps={STEPS}", "redis.max_outage_s=60", *SLOW)
    job.start_workers()
    job.start_trainer()
    wait_until(lambda: fault_redis.version() >= 2, 90, "version 2")
    before = fault_redis.version()
    fault_redis.kill()
    time.sleep(15)  # the outage itself
    fault_redis.start()
    print(f"\ngone 15 s: seconds to the next step {_recovery(fault_redis, before, job):.2f}")
    _check_run(fault_redis, job)
    assert "reconnecting for up to 60 s" in job.log("trainer")


@pytest.mark.slow
def test_redis_stopped_for_10_s_then_continued(fault_redis: FaultRedis, job_factory) -> None:
    job = job_factory(fault_redis.url, f"max_steps={STEPS}", *SLOW)
    job.start_workers()
    job.start_trainer()
    wait_until(lambda: fault_redis.version() >= 2, 90, "version 2")
    before = fault_redis.version()
    fault_redis.pause()
    time.sleep(10)  # the stall itself
    fault_redis.resume()
    print(f"\nSIGSTOP 10 s: seconds to the next step {_recovery(fault_redis, before, job):.2f}")
    _check_run(fault_redis, job)


def test_redis_gone_longer_than_max_outage_s_ends_every_process_with_one_line(fault_redis: FaultRedis,
                                                                              job_factory) -> None:
    job = job_factory(fault_redis.url, "max_steps=1000", "redis.max_outage_s=3", *SLOW)
    workers = job.start_workers()
    trainer = job.start_trainer()
    wait_until(lambda: fault_redis.version() >= 1, 90, "version 1")
    fault_redis.kill()
    for name, proc in [("trainer", trainer), *((f"producer-{r}", p) for r, p in enumerate(workers))]:
        assert proc.wait(timeout=60) != 0
        log = job.log(name)
        assert "Traceback" not in log, log[-3000:]
        assert "more than redis.max_outage_s=3" in log.splitlines()[-1], log[-2000:]
