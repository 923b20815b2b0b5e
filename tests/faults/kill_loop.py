"""Redis killed -9 and restarted right after each of many steps' commits, in one run of the real processes.

The outage test does this three times per run; a restart between two commands of one call shows up once in tens
of kills, so this loop is how such races are found (it found one: a restart between redis-py's SCRIPT LOAD and
its EVALSHA killed the trainer). Not part of `make test` (a few minutes per 100 kills on 2 cores):

    .venv/bin/python -m tests.faults.kill_loop 150
    .venv/bin/python -m tests.faults.kill_loop 150 --within-s 1.0   # at random moments of the step
    .venv/bin/python -m tests.faults.kill_loop 50 --within-s 1.0 --pause-s 2   # SIGSTOP 2 s instead of a kill

It prints the seconds from Redis being back to the next committed step, stops at the first stall (30 s) with
where the logs are, and ends with the audit: nothing lost, nothing trained twice, no group timed out.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from tests.faults.conftest import FaultRedis, Job, audit
from tests.faults.test_outage import NS, SLOW

STALL_S = 30.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kills", type=int, nargs="?", default=100)
    parser.add_argument("--within-s", type=float, default=0.0,
                        help="kill at a uniformly random moment up to this long after the commit (default: at once)")
    parser.add_argument("--pause-s", type=float, default=0.0,
                        help="instead of kill -9 + restart, SIGSTOP Redis for this long, then SIGCONT")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="rollstream-kill-loop-"))
    server = FaultRedis(tmp / "redis").start()
    (tmp / "job").mkdir()
    # A kill waits for a new version; a few steps commit before the next one (~2 steps/s here)
    steps = int(args.kills * (2 + 3 * args.within_s)) + 5
    job = Job(tmp / "job", server.url, [f"max_steps={steps}", *SLOW])
    job.start_workers()
    job.start_trainer()
    recoveries = []
    try:
        before = 0
        for kill in range(1, args.kills + 1):
            while (now := server.version()) <= before:
                time.sleep(0.02)
            before = now
            time.sleep(rng.uniform(0.0, args.within_s))  # 0: right after the commit, as the outage test does
            before = max(before, server.version())
            if args.pause_s:
                server.pause()
                time.sleep(args.pause_s)
                server.resume()
            else:
                server.restart()
            back = time.monotonic()
            while server.version() <= before:  # `before` stays the version killed at
                if time.monotonic() - back > STALL_S:
                    print(f"kill {kill}: no step {STALL_S:.0f} s after Redis came back; logs in {job.logs}")
                    return 1
                time.sleep(0.02)
            recoveries.append(time.monotonic() - back)
        code = job.wait_trainer(900)
        result = audit(job.record)
        counters = {k.decode(): int(v) for k, v in server.client().hgetall(f"{NS}:counters").items()}
    finally:
        job.stop()
        server.stop()
    faults = "pauses" if args.pause_s else "kills"
    print(f"{len(recoveries)} {faults}: next step {min(recoveries):.2f} / {statistics.median(recoveries):.2f} / "
          f"{max(recoveries):.2f} s (min / median / max) after Redis was back; trainer exit {code}")
    print(f"trained twice: {len(result.twice)}, incomplete groups: {len(result.incomplete)}, counters: {counters}")
    ok = (code == 0 and not result.twice and not result.incomplete and not counters.get("timeout_dropped")
          and len(result.groups) == steps * job.cfg.groups_per_batch)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
