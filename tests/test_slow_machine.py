"""The slow-machine models for learning runs: a real cgroup CPU quota over a command and its children, and
real-time processes that slow every core."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmark_modules import BENCHMARKS, load_benchmark

slow_machine = load_benchmark("slow_machine")
SCRIPT = str(BENCHMARKS / "slow_machine.py")
# A child that spins for a second of wall clock and prints the CPU seconds it got.
SPIN = ("import time; cpu, wall = time.process_time(), time.monotonic()\n"
        "while time.monotonic() - wall < 1.0: pass\n"
        "print(time.process_time() - cpu)")


def cgroup_cpu_controller() -> bool:
    """Whether this process may make a cgroup with a CPU quota: a controller, in a hierarchy it may write (root)."""
    hierarchy = slow_machine.cpu_hierarchy()
    return hierarchy is not None and os.access(hierarchy[1], os.W_OK)


@pytest.mark.skipif(not cgroup_cpu_controller(), reason="needs a writable cgroup CPU controller (root)")
def test_the_quota_holds_the_commands_children_and_the_cgroup_is_removed_after() -> None:
    result = subprocess.run([sys.executable, SCRIPT, "--cpus", "0.1", "--", sys.executable, "-c", SPIN],
                            capture_output=True, text=True, check=True)
    lines = result.stdout.splitlines()
    cgroup = Path(lines[0].split("cgroup ")[1].split(",")[0])
    cpu_seconds = float(lines[1])
    assert cpu_seconds < 0.3  # unthrottled it would get ~1.0 s; 0.1 cores for 1 s is ~0.1 s
    assert "the quota was spent in" in lines[2]
    assert not cgroup.exists()


def test_a_quota_above_the_machines_cores_says_what_it_may_be() -> None:
    result = subprocess.run([sys.executable, SCRIPT, "--cpus", "1000", "--", "true"], capture_output=True, text=True)
    assert result.returncode == 2
    assert "--cpus must be above 0 and at most this machine's" in result.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="needs a real-time priority (root)")
def test_slower_cores_give_a_command_its_share_of_a_core_and_stop_after_it() -> None:
    result = subprocess.run([sys.executable, SCRIPT, "--core-share", "0.25", "--period-ms", "10", "--",
                             sys.executable, "-c", SPIN], capture_output=True, text=True, check=True, timeout=60)
    cpu_seconds = float(result.stdout.splitlines()[1])
    assert 0.1 < cpu_seconds < 0.45  # unslowed it would get ~1.0 s of its one core
    takers = subprocess.run(["pgrep", "-f", "slow_machine.py --core-share 0.25"], capture_output=True, text=True)
    assert takers.stdout == ""
