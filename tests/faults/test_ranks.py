"""A trainer rank > 0 killed -9 mid-run: rank 0 and the launcher exit non-zero within about
`strategy_config.rank_timeout_s` with one line naming the dead rank; nothing uncommitted was acknowledged; the
trainer restarted with resume_from_checkpoint=true finishes the run with no group lost or trained twice."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from rollstream.tiny_model import build_tiny_model
from tests.faults.conftest import FaultRedis, audit, wait_until

NS = "rollstream:faults"
CONFIG = Path(__file__).with_name("ranks.yaml")
LOST = "rollstream: error: trainer rank 1 is gone"


def _rank_pid(launcher: subprocess.Popen[bytes], rank: int) -> int:
    """The pid of the launcher's child that runs `rank` (torchrun sets RANK in each child's environment)."""
    children = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True).stdout.split()
    [pid] = [int(c) for c in children if f"RANK={rank}\0".encode() in Path(f"/proc/{c}/environ").read_bytes()]
    return pid


@pytest.mark.slow
def test_a_trainer_rank_killed_stops_the_run_clearly_and_it_resumes(fault_redis: FaultRedis, job_factory,
                                                                     tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "model", tie_word_embeddings=True, corpus_episodes=20)
    job = job_factory(fault_redis.url, f"pretrain={model}", config=CONFIG)
    steps, per_step = job.cfg.max_steps, job.cfg.groups_per_batch
    job.start_workers()
    launcher = job.start_ranks(2)
    # the checkpoint of step 2 is saved after that step's commit: killed before it lands, the restart would
    # rightly start from the pretrained model, which is not what this test is about
    checkpoint = Path(job.cfg.output_dir) / "checkpoints" / "step_2"
    wait_until(lambda: fault_redis.version() >= 2 and checkpoint.is_dir(), 240, "version 2 and its checkpoint")
    os.kill(_rank_pid(launcher, 1), signal.SIGKILL)
    killed = time.monotonic()
    code = job.wait_trainer(120)
    stopped_s = time.monotonic() - killed
    log = job.log("trainer")
    print(f"\nrank 1 kill -9: launcher exited {code} after {stopped_s:.1f} s")
    assert code != 0
    assert log.count(LOST) == 1, log[-4000:]
    assert "resume_from_checkpoint=true" in log

    # nothing acknowledged beyond the committed steps
    client = fault_redis.client()
    version = fault_redis.version()
    counters = {k.decode(): int(v) for k, v in client.hgetall(f"{NS}:counters").items()}
    assert counters["trained"] == version * per_step, (version, counters)

    job.start_ranks(2, "resume_from_checkpoint=true")
    assert job.wait_trainer(240) == 0, job.log("trainer")[-4000:]
    assert "resumed from" in job.log("trainer")
    result = audit(job.record)
    assert not result.twice and not result.incomplete
    counters = {k.decode(): int(v) for k, v in client.hgetall(f"{NS}:counters").items()}
    assert counters["trained"] == steps * per_step, counters
    # the record is written after each commit: rank 0 stopped between the two loses a batch from the record only
    assert len(result.groups) >= (steps - 1) * per_step
