"""Parallel against sequential rollout (the RAGEN seed's comparison): episodes/s of 1, 2 and 4 env-worker processes.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/parallel_rollout.py [--episodes-per-group 20] [--repeats 3]

The same layout each time, 8 groups of 4 Sokoban envs (10x10 rooms with 2 boxes: generating a room is CPU-bound
Python, ~10-15 ms), dealt to 1, 2 or 4 real env-worker processes (`python -m rollstream producer`, burst mode)
by `max_env_num_per_worker`, with the scripted policy at no latency, against a real embedded Redis and no
trainer (the version cap is set out of reach). 1 process is the sequential baseline. Admission stays paused
until every process is up; the rate is the episodes over the time from that release to the last trajectory in
the stream (by Redis's clock), so start-up, slower with more processes, counts against none; the wall time from
the first spawn to the last exit is shown too.
Every run must write the same multiset of trajectories (group, member, seed, observations, replies, score).
Baseline in the same round: the same number of Sokoban resets in 1, 2, 4 bare processes (no rollstream), what
the machine's cores give right now. Runs interleaved over `--repeats` rounds; medians with min and max.
Goal: 2 processes >= 1.8x one.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import redis

from rollstream.shared.codec import decode_entry
from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.envs.sokoban import SokobanEnv
from rollstream.shared.keys import Keys
from rollstream.shared.redis_io import URL_ENV
from rollstream.shared.schema import Trajectory

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
CONFIG = REPO / "configs" / "frozen_lake_scripted.yaml"
GROUPS, GROUP_SIZE = 8, 4
PROCESSES = (1, 2, 4)


@dataclass(frozen=True)
class Run:
    rate: float
    """Episodes/s from the release to the last trajectory in the stream."""
    wall: float
    """Seconds from the first spawn to the last exit, start-up included."""
    cpu_ms: float
    """The workers' CPU milliseconds per episode after the release (load-independent: the machine's other
    work does not show in it, so flat figures mean the processes add no work of their own)."""

    @property
    def cores(self) -> float:
        """CPU the workers got while playing, in cores: below the process count, the machine was busy elsewhere
        (or the workers waited on Redis)."""
        return self.rate * self.cpu_ms / 1000


def overrides(name: str, out: Path, processes: int, on_loop: bool) -> list[str]:
    return [
        f"exp_name={name}", f"output_dir={out / name}", "wandb_mode=disabled", "eval_steps=0",
        "async_generation_ratio=100000", f"rollout_batch_size={GROUPS * GROUP_SIZE}",
        f"train_env_manager.group_size={GROUP_SIZE}", f"train_env_manager.num_env_groups={GROUPS}",
        "train_env_manager.tags=[SimpleSokoban]", "train_env_manager.num_groups_partition=null",
        f"train_env_manager.max_env_num_per_worker={GROUPS * GROUP_SIZE // processes}",
        "custom_envs.SimpleSokoban.env_config.dim_room=[10,10]", "custom_envs.SimpleSokoban.env_config.num_boxes=2",
        "custom_envs.SimpleSokoban.env_config.search_depth=100",
        "actor_infer.strategy_args.strategy_config.invalid_reply_rate=0.0",
        *(["custom_envs.SimpleSokoban.step_timeout_s=null"] if on_loop else []),
    ]


def run_once(url: str, out: Path, processes: int, episodes: int, name: str, on_loop: bool
             ) -> tuple[Run, Counter[tuple[object, ...]]]:
    """One burst: its figures, and its trajectories' fingerprints."""
    args = overrides(name, out, processes, on_loop)
    env = os.environ | {URL_ENV: url, "PYTHONPATH": str(REPO)}
    keys = Keys.for_exp(name)
    client = redis.Redis.from_url(url)
    # Train admission paused until every process is up (as during a validation round), so that process
    # start-up, slower with more processes on 2 cores, counts against none.
    client.set(keys.paused, "0 0")
    start = time.monotonic()
    workers = [subprocess.Popen([sys.executable, "-m", "rollstream", "producer", str(CONFIG), "--worker-rank",
                                 str(rank), "--episodes-per-group", str(episodes), *args],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
               for rank in range(processes)]
    while not all(client.exists(keys.worker(rank)) for rank in range(processes)):
        if any(w.poll() is not None for w in workers):
            break  # reported below
        time.sleep(0.05)
    seconds, micros = client.time()
    released_ms = seconds * 1000 + micros / 1000
    cpu_at_release = sum(cpu_seconds(w.pid) for w in workers)
    client.delete(keys.paused)
    client.xadd(keys.control, {"kind": "resume", "round": 0})
    expected = GROUPS * GROUP_SIZE * episodes
    # CPU is read when the last trajectory is in, before the processes spend any on exiting.
    while client.xlen(keys.traj) < expected and all(w.poll() is None for w in workers):
        time.sleep(0.05)
    cpu = sum(cpu_seconds(w.pid) for w in workers if w.poll() is None) - cpu_at_release
    for w in workers:
        _, err = w.communicate(timeout=600)
        if w.returncode:
            raise RuntimeError(f"{name}: a worker exited with {w.returncode}:\n{err.decode()[-3000:]}")
    wall = time.monotonic() - start
    entries: list[tuple[bytes, dict[bytes, bytes]]] = client.xrange(keys.traj)  # type: ignore[assignment]
    client.close()
    trajs = [decode_entry(fields) for _, fields in entries]  # type: ignore[arg-type]
    if len(trajs) != expected or not all(isinstance(t, Trajectory) for t in trajs):
        raise RuntimeError(f"{name}: {len(trajs)} entries, not {expected} trajectories")
    last_ms = max(int(entry_id.split(b"-")[0]) for entry_id, _ in entries)
    rate = len(trajs) / max((last_ms - released_ms) / 1000, 1e-3)
    return Run(rate, wall, cpu / len(trajs) * 1000), fingerprints(trajs)  # type: ignore[arg-type]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a live process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bare_resets(seeds: list[int]) -> None:
    env = SokobanEnv(dim_room=(10, 10), num_boxes=2, search_depth=100)
    for seed in seeds:
        env.reset(seed=seed)


def bare_rate(processes: int, resets: int) -> float:
    """The baseline: Sokoban resets/s of `processes` bare processes (no rollstream, no Redis, no event loop),
    what this machine's cores give right now to the same CPU-bound work."""
    seeds = list(range(resets))
    with multiprocessing.get_context("fork").Pool(processes) as pool:
        pool.map(abs, range(processes))  # the pool's processes are up before the clock starts
        start = time.monotonic()
        pool.map(bare_resets, [seeds[i::processes] for i in range(processes)])
        return resets / (time.monotonic() - start)


def fingerprints(trajs: list[Trajectory]) -> Counter[tuple[object, ...]]:
    return Counter((t.group_id, t.member, t.seed, t.score, t.end_reason,
                    tuple((turn.observation, turn.reply) for turn in t.turns)) for t in trajs)


def spread(values: list[float], fmt: str) -> str:
    return f"{format(statistics.median(values), fmt)} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def loadavg() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--episodes-per-group", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--on-loop", action="store_true", help="env calls on the event loop (step_timeout_s: null)")
    args = parser.parse_args()
    load_before = loadavg()
    runs: dict[int, list[Run]] = {n: [] for n in PROCESSES}
    bare: dict[int, list[float]] = {n: [] for n in PROCESSES}
    reference: Counter[tuple[object, ...]] | None = None
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis(Path(tmp) / "redis") as server:
        for round_, n in itertools.product(range(args.repeats), PROCESSES):
            run, prints = run_once(server.url, Path(tmp), n, args.episodes_per_group, f"par-{n}-{round_}",
                                   args.on_loop)
            if reference is None:
                reference = prints
            elif prints != reference:
                raise SystemExit(f"{n} processes, round {round_}: not the same multiset of trajectories as the "
                                 "first run")
            runs[n].append(run)
            bare[n].append(bare_rate(n, GROUPS * GROUP_SIZE * args.episodes_per_group))
            print(f"round {round_}: {n} processes {run.rate:.1f} episodes/s, {run.cpu_ms:.1f} CPU ms/episode, "
                  f"{run.cores:.2f} cores, {run.wall:.1f} s wall; bare resets {bare[n][-1]:.1f}/s", flush=True)
    total = GROUPS * GROUP_SIZE * args.episodes_per_group
    where = "on the event loop" if args.on_loop else "on a thread (step_timeout_s)"
    print(f"\n{GROUPS} groups x {GROUP_SIZE} Sokoban 10x10 envs, {total} episodes per run, env calls {where}; "
          f"{os.cpu_count()} cores, load average {load_before} before, {loadavg()} after; {args.repeats} rounds, "
          "median (min-max); the same multiset of trajectories in every run: yes")
    base = statistics.median(r.rate for r in runs[1])
    bare_base = statistics.median(bare[1])
    print("| processes | episodes/s | vs 1 process | CPU ms per episode | cores used | wall s (with start-up) "
          "| bare resets/s | bare vs 1 |")
    print("|---|---|---|---|---|---|---|---|")
    for n in PROCESSES:
        print(f"| {n} | {spread([r.rate for r in runs[n]], '.1f')} | {spread([r.rate / base for r in runs[n]], '.2f')} "
              f"| {spread([r.cpu_ms for r in runs[n]], '.1f')} | {spread([r.cores for r in runs[n]], '.2f')} "
              f"| {spread([r.wall for r in runs[n]], '.1f')} | {spread(bare[n], '.1f')} "
              f"| {spread([b / bare_base for b in bare[n]], '.2f')} |")
    speedup = statistics.median(r.rate for r in runs[2]) / base
    print(f"goal: 2 processes >= 1.8x one: {'met' if speedup >= 1.8 else 'NOT met'} ({speedup:.2f}x)")
    ceiling = statistics.median(bare[2]) / bare_base
    print(f"the machine's own ceiling now (bare processes, same resets): 2 processes {ceiling:.2f}x one")
    write_results(runs, bare, where)


def write_results(runs: dict[int, list[Run]], bare: dict[int, list[float]], where: str) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    with open(RESULTS / "parallel_rollout.csv", "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["processes", "run", "episodes_per_s", "cpu_ms_per_episode", "cores_used", "wall_s",
                      "bare_resets_per_s"])
        for n in PROCESSES:
            for i, r in enumerate(runs[n]):
                out.writerow([n, i, f"{r.rate:.2f}", f"{r.cpu_ms:.2f}", f"{r.cores:.3f}", f"{r.wall:.2f}",
                              f"{bare[n][i]:.2f}"])
    rates = {n: [r.rate for r in runs[n]] for n in PROCESSES}
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    base = statistics.median(rates[1])
    medians = [statistics.median(rates[n]) for n in PROCESSES]
    ax.bar([str(n) for n in PROCESSES], medians, color="tab:blue", label="measured (median)")
    for i, n in enumerate(PROCESSES):
        ax.plot([i] * len(rates[n]), rates[n], "k.", zorder=3)
    ax.plot([str(n) for n in PROCESSES], [base * min(n, os.cpu_count() or 1) for n in PROCESSES], "r--",
            label="linear up to the core count")
    bare_base = statistics.median(bare[1])
    ax.plot([str(n) for n in PROCESSES], [base * statistics.median(bare[n]) / bare_base for n in PROCESSES], "g:",
            marker="o", label="machine now: bare processes' scaling")
    ax.set_xlabel("env-worker processes")
    ax.set_ylabel("episodes/s")
    ax.set_title(f"Sokoban rollout, {os.cpu_count()} cores, env calls {where.split(' (')[0]}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "parallel_rollout.png", dpi=100)
    print(f"wrote {RESULTS / 'parallel_rollout.csv'} and {RESULTS / 'parallel_rollout.png'}")


if __name__ == "__main__":
    main()
