"""What a slow env call costs the other envs of a worker: env code on the event loop against on a thread.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/env_step_blocking.py [--seconds 8] [--repeats 3]

One event loop, as in one env-worker: `--lakes` FrozenLake envs (cheap steps) and `--sokobans` Sokoban envs
whose reset generates a room (CPU-bound Python, ~10-15 ms at 10x10 with 2 boxes here) play episodes back to
back through the real episode loop, all with the scripted policy at a fixed latency per reply (a stand-in for
generation). A FrozenLake turn should take that latency; what it takes beyond it is what the loop made it wait.
- `lakes alone`: the FrozenLake envs without the Sokoban ones (the loop's own overhead);
- `on the loop`: with the Sokoban envs, env calls on the event loop (`step_timeout_s: null`);
- `on a thread`: the same, env calls on a thread under `step_timeout_s` (the default);
- the FrozenLake envs alone at no latency, env calls on the loop and on a thread: what the hop to a thread
  costs an env whose steps are cheap (its turn wait is then the whole reply time, not an excess).
Phases interleaved over `--repeats` rounds; the table gives medians over rounds of each round's percentiles.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import time

import numpy as np

from rollstream.producer.episode import EpisodeSpec, Sampling, play_episode
from rollstream.producer.policy.base import GenerateRequest, Generation
from rollstream.producer.policy.scripted import ScriptedPolicy
from rollstream.shared.envs.base import TextEnv
from rollstream.shared.envs.frozen_lake import FrozenLakeEnv
from rollstream.shared.envs.sokoban import SokobanEnv


class TurnMeter:
    """The scripted policy, timing each reply from request to return (the loop's lag included)."""

    def __init__(self, latency_s: float) -> None:
        self.policy = ScriptedPolicy(turn_latency_s=latency_s)
        self.latency_s = latency_s
        self.extra_ms: list[float] = []
        self.version = 0

    async def generate(self, request: GenerateRequest) -> Generation:
        start = time.perf_counter()
        reply = await self.policy.generate(request)
        self.extra_ms.append((time.perf_counter() - start - self.latency_s) * 1000)
        return reply


async def play_forever(env: TextEnv, policy: TurnMeter, tag: str, index: int, timeout_s: float | None,
                       episodes: list[int]) -> None:
    for e in itertools.count():
        spec = EpisodeSpec("train", tag, index, e, 0, seed=index * 7919 + e)
        await play_episode(env, policy, spec, Sampling(64), step_timeout_s=timeout_s)  # type: ignore[arg-type]
        episodes[0] += 1
        await asyncio.sleep(0)  # a worker yields here in its XADD; at no latency nothing else would


async def phase(args: argparse.Namespace, sokobans: int, timeout_s: float | None, latency_s: float
                ) -> dict[str, float]:
    lakes, others = TurnMeter(latency_s), TurnMeter(latency_s)
    lake_eps, soko_eps = [0], [0]
    tasks = [asyncio.create_task(play_forever(FrozenLakeEnv(max_actions_per_traj=10), lakes, "FrozenLake", i,
                                              timeout_s, lake_eps)) for i in range(args.lakes)]
    tasks += [asyncio.create_task(play_forever(SokobanEnv(dim_room=(10, 10), num_boxes=2, search_depth=100),
                                               others, "Sokoban", i, timeout_s, soko_eps)) for i in range(sokobans)]
    await asyncio.sleep(1.0)  # ramp-up
    lakes.extra_ms.clear()
    lake_start, soko_start = lake_eps[0], soko_eps[0]
    await asyncio.sleep(args.seconds)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    extra = np.array(lakes.extra_ms)
    return {"p50": float(np.percentile(extra, 50)), "p99": float(np.percentile(extra, 99)),
            "max": float(extra.max()), "lake eps/s": (lake_eps[0] - lake_start) / args.seconds,
            "sokoban eps/s": (soko_eps[0] - soko_start) / args.seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lakes", type=int, default=16)
    parser.add_argument("--sokobans", type=int, default=8)
    parser.add_argument("--latency-s", type=float, default=0.02)
    args = parser.parse_args()
    phases = {"lakes alone": (0, None, args.latency_s), "on the loop": (args.sokobans, None, args.latency_s),
              "on a thread": (args.sokobans, 300.0, args.latency_s),
              # What the thread hop costs cheap envs: FrozenLake alone at no latency, CPU-bound on the hop.
              "lakes, no latency, on the loop": (0, None, 0.0), "lakes, no latency, on a thread": (0, 300.0, 0.0)}
    results: dict[str, list[dict[str, float]]] = {name: [] for name in phases}
    for _, (name, (sokobans, timeout_s, latency_s)) in itertools.product(range(args.repeats), phases.items()):
        results[name].append(asyncio.run(phase(args, sokobans, timeout_s, latency_s)))
        print(f"{name}: " + ", ".join(f"{k} {v:.1f}" for k, v in results[name][-1].items()), flush=True)
    print(f"\n{args.lakes} FrozenLake + {args.sokobans} Sokoban 10x10 envs in one loop, {args.latency_s * 1000:.0f} ms "
          f"per reply; {args.repeats} rounds of {args.seconds:.0f} s, medians over rounds")
    keys = ["p50", "p99", "max", "lake eps/s", "sokoban eps/s"]
    print("| env calls | FrozenLake turn wait p50 ms | p99 ms | max ms | FrozenLake eps/s | Sokoban eps/s |")
    print("|---|---|---|---|---|---|")
    for name, rounds in results.items():
        cells = [statistics.median(r[k] for r in rounds) for k in keys]
        print(f"| {name} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")


if __name__ == "__main__":
    main()
