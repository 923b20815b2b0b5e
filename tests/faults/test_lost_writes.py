"""Redis losing writes it acknowledged (an AOF behind, as appendfsync everysec loses on a crash; a server back
empty): detected, and every process stops with one clear line instead of training twice."""

from __future__ import annotations

import shutil
import time

import pytest

from tests.faults.conftest import FaultRedis, audit, wait_until
from tests.faults.test_outage import SLOW

LOST = "lost writes|Redis lost committed steps"  # workers | trainer


@pytest.mark.slow
@pytest.mark.parametrize("how", ["aof rolled back", "restarted empty"])
def test_lost_acknowledged_writes_stop_the_run_with_one_line(fault_redis: FaultRedis, job_factory, how: str) -> None:
    job = job_factory(fault_redis.url, "max_steps=1000", *SLOW)
    workers = job.start_workers()
    trainer = job.start_trainer()
    wait_until(lambda: fault_redis.version() >= 2, 90, "version 2")
    aof = fault_redis.data_dir / "appendonlydir"
    snapshot = fault_redis.data_dir.parent / "aof-behind"
    shutil.copytree(aof, snapshot)  # what the disk holds if the last writes never reached it
    reached = fault_redis.version()
    wait_until(lambda: fault_redis.version() >= reached + 2, 90, "two more steps")
    fault_redis.kill()
    shutil.rmtree(aof)
    if how == "aof rolled back":
        shutil.copytree(snapshot, aof)
    fault_redis.start()
    back = time.monotonic()

    for name, proc in [("trainer", trainer), *((f"producer-{r}", p) for r, p in enumerate(workers))]:
        assert proc.wait(timeout=90) != 0, name
        log = job.log(name)
        assert "Traceback" not in log, log[-3000:]
        last = log.splitlines()[-1]
        assert last.startswith("rollstream: error:") and "--fresh" in last, last
        assert any(word in last for word in LOST.split("|")), last
    print(f"\n{how}: every process stopped {time.monotonic() - back:.1f} s after Redis came back")
    result = audit(job.record)
    assert not result.twice and not result.incomplete
