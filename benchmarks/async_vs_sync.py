"""Asynchronous against synchronous: trainer steps/min and idle share for r = 0, 1, 2 against the ideal.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/async_vs_sync.py [--train-s 1.0] [--steps 10] [--repeats 3]

Generation takes G per batch, a train step T: the ideal is G + T per step when synchronous (r = 0: a batch is
generated only once the version it is for is published) and max(G, T) when asynchronous (r >= 1: the next batch
is generated while this one trains). Each run is the real pipeline on a real embedded Redis:
- one env-worker process (`python -m rollstream producer`) whose 4 groups of 4 FrozenLake envs play with the
  scripted policy at a fixed latency per reply; every reply is invalid, so every episode lasts exactly
  TURNS turns and G = TURNS x the latency (one batch = the 4 groups, each playing one episode);
- the trainer loop (`run_trainer`) in this process with a learner whose step sleeps T.
Steps/min are timed from the learner's step starts after WARMUP steps (start-up excluded); the trainer's idle
share is 1 - (time in train steps) / (time between them). Ratios G/T of 0.5, 1 and 2 for r = 0, 1, 2, the runs
interleaved over `--repeats` rounds so drift of this noisy machine hits all; medians with min and max.
Goals: r = 1 within 10% of the ideal; trainer idle below 5% when generation is faster than training.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from rollstream.consumer.data.batcher import Batch
from rollstream.consumer.train import run_trainer
from rollstream.shared.config import load_config
from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.messages import WeightsAnnouncement
from rollstream.shared.redis_io import URL_ENV

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
CONFIG = REPO / "configs" / "frozen_lake_scripted.yaml"
TURNS = 5
WARMUP = 2
GROUPS, GROUP_SIZE = 4, 4


class SleepingLearner:
    """A train step of fixed duration; records when each step started and how long it slept."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.starts: list[float] = []
        self.slept: list[float] = []

    def train_step(self, batch: Batch) -> dict[str, float]:
        start = time.monotonic()
        self.starts.append(start)
        time.sleep(self.step_s)
        self.slept.append(time.monotonic() - start)
        return {}

    def publish(self, version: int, suffix: str = "") -> WeightsAnnouncement:
        return WeightsAnnouncement(version)

    def save_checkpoint(self, directory: object) -> None:
        pass

    def load_checkpoint(self, directory: object) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass
class Case:
    ratio: int
    """async_generation_ratio r."""
    gen_over_train: float
    """G / T."""
    periods: list[float] = field(default_factory=list)
    idle: list[float] = field(default_factory=list)

    def ideal_period(self, train_s: float) -> float:
        gen_s = self.gen_over_train * train_s
        return gen_s + train_s if self.ratio == 0 else max(gen_s, train_s)

    def ideal_idle(self, train_s: float) -> float:
        return 1 - train_s / self.ideal_period(train_s)


def overrides(case: Case, name: str, out: Path, train_s: float, steps: int) -> list[str]:
    latency = case.gen_over_train * train_s / TURNS
    return [
        f"exp_name={name}", f"output_dir={out / name}", "wandb_mode=disabled", "eval_steps=0", "logging_steps=1000",
        f"max_steps={WARMUP + steps}", f"async_generation_ratio={case.ratio}", "redis.block_ms=200",
        f"rollout_batch_size={GROUPS * GROUP_SIZE}", f"train_env_manager.group_size={GROUP_SIZE}",
        f"train_env_manager.num_env_groups={GROUPS}", "train_env_manager.tags=[FrozenLake]",
        f"train_env_manager.num_groups_partition=[{GROUPS}]",
        f"train_env_manager.max_env_num_per_worker={GROUPS * GROUP_SIZE}",
        f"custom_envs.FrozenLake.max_actions_per_traj={TURNS}",
        "actor_infer.strategy_args.strategy_config.invalid_reply_rate=1.0",
        f"actor_infer.strategy_args.strategy_config.turn_latency_s={latency}",
    ]


def run_case(case: Case, url: str, out: Path, train_s: float, steps: int, round_: int) -> None:
    """One run: a producer process, the trainer here; appends the step period and idle share to `case`."""
    name = f"avs-r{case.ratio}-g{case.gen_over_train}-{round_}"
    args = overrides(case, name, out, train_s, steps)
    cfg = load_config(CONFIG, args)
    env = os.environ | {URL_ENV: url, "PYTHONPATH": str(REPO)}
    with open(out / f"{name}.log", "wb") as log:
        producer = subprocess.Popen([sys.executable, "-m", "rollstream", "producer", str(CONFIG), "--worker-rank",
                                     "0", *args], env=env, stdout=log, stderr=subprocess.STDOUT)
    learner = SleepingLearner(train_s)
    client = redis.Redis.from_url(url, socket_timeout=30)
    try:
        summary = run_trainer(cfg, client, learner=learner, progress=False)
    finally:
        producer.send_signal(signal.SIGTERM)
        producer.wait(60)
        client.close()
    if summary.last_version != cfg.max_steps:
        tail = (out / f"{name}.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{name}: the trainer stopped at version {summary.last_version}; producer log:\n{tail}")
    measured = learner.starts[WARMUP:]
    period = (measured[-1] - measured[0]) / (len(measured) - 1)
    case.periods.append(period)
    case.idle.append(1 - statistics.mean(learner.slept[WARMUP:-1]) / period)


def spread(values: list[float], fmt: str) -> str:
    return f"{format(statistics.median(values), fmt)} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def report(cases: list[Case], train_s: float, repeats: int, load: str) -> None:
    print(f"\nT = {train_s} s per train step, G = (G/T) x T per batch of {GROUPS} groups x {GROUP_SIZE} envs, "
          f"{TURNS} turns per episode; {repeats} interleaved runs each, median (min-max); load average {load}")
    header = ("| r | G/T | ideal s/step | steps/min | ideal steps/min | vs ideal | trainer idle | ideal idle |")
    print(header)
    print("|" + "|".join("-" * (len(c) + 1) for c in header.split("|")[1:-1]) + "|")
    rows = []
    for c in cases:
        ideal = c.ideal_period(train_s)
        per_min = [60 / p for p in c.periods]
        vs = [ideal / p for p in c.periods]
        print(f"| {c.ratio} | {c.gen_over_train} | {ideal:.2f} | {spread(per_min, '.1f')} | {60 / ideal:.1f} "
              f"| {spread(vs, '.3f')} | {spread(c.idle, '.1%')} | {c.ideal_idle(train_s):.1%} |")
        rows.append(c)
    goals = [c for c in cases if c.ratio == 1]
    worst = min(statistics.median([c.ideal_period(train_s) / p for p in c.periods]) for c in goals)
    print(f"goal: r = 1 within 10% of the ideal: {'met' if worst >= 0.9 else 'NOT met'} (worst median {worst:.3f})")
    fast = [c for c in cases if c.ratio >= 1 and c.gen_over_train < 1]
    idle = max(statistics.median(c.idle) for c in fast)
    print(f"goal: trainer idle < 5% when G < T (r >= 1): {'met' if idle < 0.05 else 'NOT met'} (worst median "
          f"{idle:.1%})")


def write_results(cases: list[Case], train_s: float) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    with open(RESULTS / "async_vs_sync.csv", "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["r", "gen_over_train", "train_s", "run", "period_s", "ideal_period_s", "steps_per_min",
                      "vs_ideal", "trainer_idle", "ideal_idle"])
        for c in cases:
            for i, (p, idle) in enumerate(zip(c.periods, c.idle)):
                ideal = c.ideal_period(train_s)
                out.writerow([c.ratio, c.gen_over_train, train_s, i, f"{p:.4f}", f"{ideal:.4f}", f"{60 / p:.2f}",
                              f"{ideal / p:.4f}", f"{idle:.4f}", f"{c.ideal_idle(train_s):.4f}"])
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ratios = sorted({c.gen_over_train for c in cases})
    width = 0.25
    for i, r in enumerate(sorted({c.ratio for c in cases})):
        mine = {c.gen_over_train: c for c in cases if c.ratio == r}
        xs = [j + (i - 1) * width for j in range(len(ratios))]
        per_min = [60 / statistics.median(mine[g].periods) for g in ratios]
        ax1.bar(xs, per_min, width, label=f"r = {r}")
        ax1.scatter(xs, [60 / mine[g].ideal_period(train_s) for g in ratios], color="black", marker="_", s=200,
                    zorder=3, label="ideal" if i == 0 else None)
        ax2.bar(xs, [statistics.median(mine[g].idle) for g in ratios], width, label=f"r = {r}")
        ax2.scatter(xs, [mine[g].ideal_idle(train_s) for g in ratios], color="black", marker="_", s=200, zorder=3,
                    label="ideal" if i == 0 else None)
    for ax, title in ((ax1, "trainer steps/min"), (ax2, "trainer idle share")):
        ax.set_xticks(range(len(ratios)), [f"G/T = {g}" for g in ratios])
        ax.set_title(title)
        ax.legend()
    fig.suptitle(f"async vs sync, T = {train_s} s (medians; ticks: ideal)")
    fig.tight_layout()
    fig.savefig(RESULTS / "async_vs_sync.png", dpi=100)
    print(f"wrote {RESULTS / 'async_vs_sync.csv'} and {RESULTS / 'async_vs_sync.png'}")


def loadavg() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--train-s", type=float, default=1.0, help="seconds per train step (T)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run, after the warm-up")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.5, 1.0, 2.0], help="G/T values")
    args = parser.parse_args()
    cases = [Case(r, g) for g, r in itertools.product(args.ratios, (0, 1, 2))]
    load = loadavg()
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis(Path(tmp) / "redis") as server:
        for round_, case in itertools.product(range(args.repeats), cases):
            run_case(case, server.url, Path(tmp), args.train_s, args.steps, round_)
            print(f"round {round_} r={case.ratio} G/T={case.gen_over_train}: {case.periods[-1]:.3f} s/step, "
                  f"idle {case.idle[-1]:.1%}", flush=True)
    report(cases, args.train_s, args.repeats, f"{load} at start, {loadavg()} at end")
    write_results(cases, args.train_s)


if __name__ == "__main__":
    main()
