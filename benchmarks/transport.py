"""Transport: rollstream's write, read + assembly + commit, and end-to-end paths against Redis's own ceiling.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/transport.py [--seconds 3] [--repeats 3] [--quick]

On a Redis this benchmark starts itself (free port, temporary directory), with `appendfsync always` (the
embedded default) and with `everysec`, for trajectories of 2, 16 and 64 KB of payload:
- write: rollstream's real write path, as an env-worker does it (`EnvWorker.publish` of `encode_trajectory`,
  with the write counter and `write_with_backoff`), from 64 coroutines of one process; producer CPU per
  trajectory (encoding included), against `redis-benchmark` XADD of the same entry with pipelining 64 from one
  connection (Redis's ceiling), a bare redis-py + hiredis loop (pipelines of 64 XADDs of the encoded entry)
  and the shape of PipelineRL's writer (one synchronous XADD per trajectory, approximate MAXLEN);
- read: the trainer's real read, group assembly and commit (`Batcher.next_batch` then `Batcher.commit`, the
  ledger's commit script), over a stream filled beforehand with complete groups of 8, against a bare loop
  (XREADGROUP, msgpack decode, XACK + XDEL in one pipeline);
- end to end: 1 and 2 producer processes (real `EnvWorker`s, 64 envs each: admission under the version cap at
  async_generation_ratio 1, then the write; the episode itself is a synthetic trajectory, no env, no policy)
  and the trainer loop in this process (next_batch + commit, no learning, so the version cap is what paces
  the producers): trajectories delivered per second and the latency from a trajectory's `created_at` (its
  episode's end) to the batch holding it.
Phases interleave over `--repeats` rounds; the table gives medians (min-max) and ratios to the baselines.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import csv
import functools
import itertools
import multiprocessing
import os
import random
import statistics
import string
import subprocess
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import redis
import redis.asyncio

from rollstream.consumer.data.batcher import Batcher
from rollstream.producer.episode import EpisodeSpec, Sampling
from rollstream.producer.policy.scripted import ScriptedPolicy
from rollstream.producer.worker import EnvWorker
from rollstream.shared.codec import encode_trajectory
from rollstream.shared.config import RollstreamConfig, load_config
from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.envs.base import TextEnv
from rollstream.shared.keys import Keys
from rollstream.shared.ledger import Ledger
from rollstream.shared.messages import WeightsAnnouncement
from rollstream.shared.redis_io import pack_with_hiredis
from rollstream.shared.schema import Trajectory, Turn, make_group_id, make_traj_id

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
CONFIG = REPO / "configs" / "frozen_lake_scripted.yaml"
SIZES_KB = (2, 16, 64)
FSYNCS = ("always", "everysec")
COROUTINES = 64
"""Writers in one process, as 64 envs of one env-worker; also redis-benchmark's and the bare loop's pipeline."""
GROUP_SIZE, GROUPS_PER_BATCH = 8, 8
STREAM_BYTES = 256 << 20
"""At most this much payload in Redis at a time (the machine has little memory to spare)."""


# ---- trajectories of a given size ----

def make_trajectory(kb: int, group_index: int, episode: int, member: int, version: int = 0,
                    rank: int = 0) -> Trajectory:
    """A 4-turn FrozenLake-like trajectory whose token arrays bring its payload to about `kb` KB."""
    group_id = make_group_id("train", "FrozenLake", group_index, episode)
    turns, input_ids, mask, logprobs = _parts(kb, version)
    return Trajectory(make_traj_id(group_id, member), group_id, "train", "FrozenLake", group_index, episode, member,
                      seed=episode, turns=turns, score=1.0, success=True, end_reason="done", worker_rank=rank,
                      input_ids=input_ids, response_mask=mask, logprobs=logprobs, created_at=time.time())


@functools.cache
def _parts(kb: int, version: int) -> tuple[list[Turn], np.ndarray, np.ndarray, np.ndarray]:
    """Turns and arrays, made once per size and version: a synthetic episode should cost the producer nothing
    (nobody changes them: the encoder copies them into the payload)."""
    tokens = max(8, (kb * 1024 - 700) // 9)  # int32 id + uint8 mask + float32 logprob per token
    turns = [Turn(version, "You are at (1, 2). The goal is at (3, 3). Holes: (1, 1), (2, 3).", "<answer>Right</answer>",
                  "Right", True, 0.0, (i * tokens // 4, (i + 1) * tokens // 4), "stop") for i in range(4)]
    mask = np.zeros(tokens, np.uint8)
    mask[tokens // 2:] = 1
    return turns, np.arange(tokens, dtype=np.int32) % 50_000, mask, np.full(tokens, -0.25, np.float32)


def config(name: str, out: Path, envs: int = COROUTINES, ratio: int = 1) -> RollstreamConfig:
    return load_config(CONFIG, [
        f"exp_name={name}", f"output_dir={out / name}", "wandb_mode=disabled", "eval_steps=0",
        f"rollout_batch_size={GROUP_SIZE * GROUPS_PER_BATCH}", f"async_generation_ratio={ratio}",
        f"train_env_manager.group_size={GROUP_SIZE}", f"train_env_manager.num_env_groups={envs // GROUP_SIZE}",
        "train_env_manager.tags=[FrozenLake]", "train_env_manager.num_groups_partition=null",
        f"train_env_manager.max_env_num_per_worker={COROUTINES}", "custom_envs.FrozenLake.step_timeout_s=null",
        "redis.block_ms=100", "group_timeout_s=600",
    ])


def entries_for(kb: int, seconds: float, rate_guess: float) -> int:
    """How many entries a phase writes: about `seconds` at `rate_guess`, within STREAM_BYTES, whole batches."""
    n = min(int(seconds * rate_guess), STREAM_BYTES // (kb * 1024))
    batch = GROUP_SIZE * GROUPS_PER_BATCH
    return max(batch, n // batch * batch)


# ---- write ----

def redis_benchmark(port: int, fields: dict[str, Any], n: int) -> float:
    """redis-benchmark XADD of the same fields (the payload as text of the same length), -P 64, one connection."""
    args: list[str] = []
    for name, value in fields.items():
        if isinstance(value, bytes):  # argv cannot carry NUL bytes: random text of the same length
            value = "".join(random.choices(string.ascii_letters, k=len(value)))
        args += [name, str(value)]
    out = subprocess.run(["redis-benchmark", "-p", str(port), "-c", "1", "-P", str(COROUTINES), "-n", str(n),
                          "--csv", "XADD", "bench:rb", "*", *args], capture_output=True, text=True, check=True)
    rate = float(out.stdout.strip().splitlines()[-1].split(",")[1].strip('"'))
    redis.Redis(port=port).delete("bench:rb")
    return rate


def bare_write(url: str, fields: dict[str, Any], n: int) -> tuple[float, float]:
    """A bare redis-py + hiredis loop: pipelines of 64 XADDs of the encoded entry. (entries/s, CPU µs each)"""
    client = redis.Redis.from_url(url)
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(n // COROUTINES):
        pipe = client.pipeline(transaction=False)
        for _ in range(COROUTINES):
            pipe.xadd("bench:bare", fields)
        pipe.execute()
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    client.delete("bench:bare")
    client.close()
    return n / elapsed, cpu / n * 1e6


def pipelinerl_write(url: str, fields: dict[str, Any], n: int) -> tuple[float, float]:
    """The shape of PipelineRL's Redis writer (pipelinerl/streams.py, RedisStreamWriter.write): a synchronous
    client, one XADD per trajectory with an approximate MAXLEN of 1,000,000, no pipelining. It pickles its payload;
    here the same encoded entry goes as it is, so only the write loops differ. (entries/s, CPU µs each)"""
    client = redis.Redis.from_url(url)
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(n):
        client.xadd("bench:pipelinerl", fields, maxlen=1_000_000, approximate=True)  # type: ignore[arg-type]
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    client.delete("bench:pipelinerl")
    client.close()
    return n / elapsed, cpu / n * 1e6


async def _rollstream_write(url: str, cfg: RollstreamConfig, kb: int, n: int) -> tuple[float, float]:
    client = redis.asyncio.Redis.from_url(url)
    pack_with_hiredis(client)  # as `connect_async` does
    worker = EnvWorker(cfg, 0, client, ScriptedPolicy())
    worker.writes_base = int(await client.hget(worker.keys.run, worker.writer) or 0)  # as `run` does first
    template = make_trajectory(kb, 0, 0, 0)
    per_writer = n // COROUTINES

    async def writer(index: int) -> None:
        for episode in range(per_writer):
            group_id = make_group_id("train", "FrozenLake", index, episode)
            traj = copy.copy(template)  # what play_episode would have returned
            traj.group_id, traj.traj_id, traj.group_index, traj.episode = (group_id, make_traj_id(group_id, 0),
                                                                           index, episode)
            traj.created_at = time.time()
            await worker.publish(encode_trajectory(traj))

    start, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(writer(i) for i in range(COROUTINES)))
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    await client.delete(worker.keys.traj)
    await client.aclose()
    return per_writer * COROUTINES / elapsed, cpu / (per_writer * COROUTINES) * 1e6


def rollstream_write(url: str, cfg: RollstreamConfig, kb: int, n: int) -> tuple[float, float]:
    """64 coroutines of one process, each writing trajectories one after another through EnvWorker.publish."""
    return asyncio.run(_rollstream_write(url, cfg, kb, n))


# ---- read + assembly + commit ----

def fill(url: str, cfg: RollstreamConfig, kb: int, n: int) -> None:
    """`n` trajectories in complete groups, registered in flight as admission would have done."""
    client = redis.Redis.from_url(url)
    keys = Keys.for_exp(cfg.exp_name)
    groups = n // GROUP_SIZE
    Ledger(client, keys).register([make_group_id("train", "FrozenLake", g, 0) for g in range(groups)])
    template = make_trajectory(kb, 0, 0, 0)
    pipe = client.pipeline(transaction=False)
    for g, m in itertools.product(range(groups), range(GROUP_SIZE)):
        group_id = make_group_id("train", "FrozenLake", g, 0)
        traj = Trajectory(**{**template.__dict__, "group_id": group_id, "traj_id": make_traj_id(group_id, m),
                             "group_index": g, "member": m})
        pipe.xadd(keys.traj, encode_trajectory(traj))  # type: ignore[arg-type]  # str keys
        if len(pipe) >= COROUTINES:
            pipe.execute()
    pipe.execute()
    client.close()


def rollstream_read(url: str, cfg: RollstreamConfig, n: int) -> float:
    """The trainer's loop without learning: next_batch, then commit (ack, delete, publish the version)."""
    client = redis.Redis.from_url(url)
    batcher = Batcher(client, cfg)
    start = time.perf_counter()
    for step in range(n // (GROUP_SIZE * GROUPS_PER_BATCH)):
        batch = batcher.next_batch(step, timeout_s=30)
        if batch is None:
            raise RuntimeError(f"read: no batch at step {step}")
        batcher.commit(batch, WeightsAnnouncement(step + 1, "file:///nowhere"))
    elapsed = time.perf_counter() - start
    if client.xlen(batcher.keys.traj):
        raise RuntimeError("read: entries left in the stream")
    client.close()
    return n / elapsed


def bare_read(url: str, stream: str, n: int) -> float:
    """XREADGROUP 128 at a time, msgpack-decode each payload, XACK + XDEL each 64 in one pipeline."""
    client = redis.Redis.from_url(url)
    client.xgroup_create(stream, "bare", "0", mkstream=True)
    start, done, held = time.perf_counter(), 0, []
    while done < n:
        reply = client.xreadgroup("bare", "c", {stream: ">"}, count=128, block=1000)
        for entry_id, fields in reply[0][1] if reply else []:
            msgpack.unpackb(fields[b"payload"], raw=False)
            held.append(entry_id)
        while len(held) >= GROUP_SIZE * GROUPS_PER_BATCH or (held and done + len(held) >= n):
            ids, held = held[:GROUP_SIZE * GROUPS_PER_BATCH], held[GROUP_SIZE * GROUPS_PER_BATCH:]
            pipe = client.pipeline(transaction=True)
            pipe.xack(stream, "bare", *ids)
            pipe.xdel(stream, *ids)
            pipe.execute()
            done += len(ids)
    elapsed = time.perf_counter() - start
    client.delete(stream)
    client.close()
    return n / elapsed


# ---- end to end ----

class SyntheticWorker(EnvWorker):
    """A real env-worker whose episodes are instant synthetic trajectories of a given size."""

    kb = 2

    async def play(self, env: TextEnv, spec: EpisodeSpec, sampling: Sampling, render_dir: Path | None = None
                   ) -> Trajectory:
        await asyncio.sleep(0)
        return make_trajectory(self.kb, spec.group_index, spec.episode, spec.member, self.policy.version,
                               self.rank)


def producer_process(url: str, cfg: RollstreamConfig, rank: int, kb: int) -> None:
    async def main() -> None:
        client = redis.asyncio.Redis.from_url(url)
        pack_with_hiredis(client)  # as `connect_async` does
        worker = SyntheticWorker(cfg, rank, client, ScriptedPolicy())
        worker.kb = kb
        await worker.run()
        await client.aclose()

    asyncio.run(main())


def end_to_end(url: str, cfg: RollstreamConfig, kb: int, producers: int, seconds: float
               ) -> tuple[float, float, float, float]:
    """(delivered/s, p50 ms, p99 ms, producer CPU µs per trajectory) with `producers` processes at the cap."""
    client = redis.Redis.from_url(url)
    keys = Keys.for_exp(cfg.exp_name)
    client.set(keys.paused, "0 0")  # admission held until every producer is up: start-up is not timed
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=producer_process, args=(url, cfg, rank, kb), daemon=True) for rank in range(producers)]
    for p in procs:
        p.start()
    batcher = Batcher(client, cfg)
    while not all(client.exists(keys.worker(rank)) for rank in range(producers)):
        if any(not p.is_alive() for p in procs):
            raise RuntimeError("end to end: a producer died at start")
        time.sleep(0.05)
    cpu0 = sum(cpu_seconds(p.pid) for p in procs if p.pid)
    client.delete(keys.paused)
    client.xadd(keys.control, {"kind": "resume", "round": 0})
    latencies: list[float] = []
    warmup, step, delivered = 2, 0, 0
    start = time.perf_counter()
    while True:
        batch = batcher.next_batch(step, timeout_s=30)
        if batch is None:
            raise RuntimeError(f"end to end: no batch at step {step}")
        now = time.time()
        batcher.commit(batch, WeightsAnnouncement(step + 1, "file:///nowhere"))
        step += 1
        if step == warmup:
            start, cpu0 = time.perf_counter(), sum(cpu_seconds(p.pid) for p in procs if p.pid)
        elif step > warmup:
            latencies += [(now - t.created_at) * 1000 for t in batch.trajectories]
            delivered += len(batch.trajectories)
            if time.perf_counter() - start > seconds:
                break
    elapsed = time.perf_counter() - start
    cpu = sum(cpu_seconds(p.pid) for p in procs if p.pid) - cpu0
    Ledger(client, keys).finish_experiment(step)
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.terminate()
    client.close()
    return (delivered / elapsed, float(np.percentile(latencies, 50)), float(np.percentile(latencies, 99)),
            cpu / delivered * 1e6)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---- the run ----

def spread(values: list[float], fmt: str) -> str:
    return f"{format(statistics.median(values), fmt)} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def med(values: list[float]) -> float:
    return statistics.median(values)


def loadavg() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def one_round(server: EmbeddedRedis, tmp: Path, round_: int, args: argparse.Namespace,
              results: dict[tuple[str, int, str], list[float]]) -> None:
    url, fsync = server.url, server.extra_args[1]
    for kb in args.sizes:
        tag = f"{fsync}-{kb}-{round_}"
        cfg = config(f"w-{tag}", tmp)
        fields = encode_trajectory(make_trajectory(kb, 0, 0, 0))
        n = entries_for(kb, args.seconds, 20_000)

        def put(name: str, value: float, kb: int = kb) -> None:
            results[(fsync, kb, name)].append(value)

        put("redis-benchmark write/s", redis_benchmark(server.port, fields, n))
        rate, cpu = bare_write(url, fields, n)
        put("bare write/s", rate)
        put("bare write CPU µs", cpu)
        rate, _ = pipelinerl_write(url, fields, entries_for(kb, args.seconds, 2_000))
        put("PipelineRL writer write/s", rate)
        rate, cpu = rollstream_write(url, cfg, kb, entries_for(kb, args.seconds, 6_000))
        put("rollstream write/s", rate)
        put("rollstream write CPU µs", cpu)
        n = entries_for(kb, args.seconds, 8_000)
        read_cfg = config(f"r-{tag}", tmp, ratio=1_000_000)  # filled at version 0: never stale
        fill(url, read_cfg, kb, n)
        put("rollstream read/s", rollstream_read(url, read_cfg, n))
        fill(url, config(f"b-{tag}", tmp), kb, n)
        put("bare read/s", bare_read(url, Keys.for_exp(f"b-{tag}").traj, n))
        for producers in args.producers:
            rate, p50, p99, cpu = end_to_end(url, config(f"e{producers}-{tag}", tmp, envs=COROUTINES * producers),
                                             kb, producers, args.seconds)
            put(f"e2e {producers}p delivered/s", rate)
            put(f"e2e {producers}p p50 ms", p50)
            put(f"e2e {producers}p p99 ms", p99)
            put(f"e2e {producers}p producer CPU µs", cpu)
        print(f"round {round_} {fsync} {kb} KB: " + ", ".join(
            f"{name} {values[-1]:.0f}" for (f, k, name), values in results.items() if f == fsync and k == kb),
            flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="about how long each phase runs")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="1 round of ~1 s phases, appendfsync always only")
    args = parser.parse_args()
    args.sizes, args.fsyncs, args.producers = SIZES_KB, FSYNCS, (1, 2)
    if args.quick:
        args.seconds, args.repeats, args.fsyncs = 1.0, 1, ("always",)
    load_before = loadavg()
    results: dict[tuple[str, int, str], list[float]] = defaultdict(list)
    with tempfile.TemporaryDirectory() as tmp:
        for round_, fsync in itertools.product(range(args.repeats), args.fsyncs):
            with EmbeddedRedis(Path(tmp) / f"redis-{fsync}-{round_}", extra_args=("--appendfsync", fsync)) as server:
                one_round(server, Path(tmp), round_, args, results)
    report(results, args, load_before)


def report(results: dict[tuple[str, int, str], list[float]], args: argparse.Namespace, load_before: str) -> None:
    print(f"\n{os.cpu_count()} cores, load average {load_before} before, {loadavg()} after; {args.repeats} rounds "
          f"of ~{args.seconds:g} s phases, median (min-max); {COROUTINES} writers per producer, groups of "
          f"{GROUP_SIZE}, batches of {GROUP_SIZE * GROUPS_PER_BATCH}")
    rows = []
    for fsync, kb in itertools.product(args.fsyncs, args.sizes):
        r = {name: values for (f, k, name), values in results.items() if f == fsync and k == kb}
        ceiling, bare_w, ours_w = (med(r[x]) for x in ("redis-benchmark write/s", "bare write/s",
                                                          "rollstream write/s"))
        rows.append((fsync, kb, r))
        print(f"\n### appendfsync {fsync}, {kb} KB trajectories\n")
        print("| path | rollstream | baseline | ratio |")
        print("|---|---|---|---|")
        print(f"| write/s vs redis-benchmark XADD -P {COROUTINES} | {spread(r['rollstream write/s'], '.0f')} | "
              f"{ceiling:.0f} | **{ours_w / ceiling:.2f}** |")
        print(f"| write/s vs bare redis-py pipeline | | {spread(r['bare write/s'], '.0f')} | {ours_w / bare_w:.2f} |")
        pipelinerl = med(r["PipelineRL writer write/s"])
        print(f"| write/s vs PipelineRL's writer (one sync XADD each) | | "
              f"{spread(r['PipelineRL writer write/s'], '.0f')} | **{ours_w / pipelinerl:.2f}** |")
        print(f"| producer CPU µs per write (bare: {med(r['bare write CPU µs']):.0f}) | "
              f"{spread(r['rollstream write CPU µs'], '.0f')} | | |")
        read = med(r["rollstream read/s"])
        print(f"| read + assembly + commit /s vs bare | {spread(r['rollstream read/s'], '.0f')} | "
              f"{spread(r['bare read/s'], '.0f')} | {read / med(r['bare read/s']):.2f} |")
        print(f"| read + assembly + commit vs rollstream write | | | **{read / ours_w:.2f}** |")
        for p in args.producers:
            print(f"| end to end, {p} producer(s): delivered/s | {spread(r[f'e2e {p}p delivered/s'], '.0f')} | | |")
            print(f"| end to end, {p} producer(s): latency p50 / p99 ms | {med(r[f'e2e {p}p p50 ms']):.1f} / "
                  f"**{spread(r[f'e2e {p}p p99 ms'], '.1f')}** | | |")
            print(f"| end to end, {p} producer(s): producer CPU µs per trajectory | "
                  f"{spread(r[f'e2e {p}p producer CPU µs'], '.0f')} | | |")
    write_results(results, rows, args)


def write_results(results: dict[tuple[str, int, str], list[float]], rows: list[Any], args: argparse.Namespace
                  ) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    suffix = "_quick" if args.quick else ""
    with open(RESULTS / f"transport{suffix}.csv", "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["appendfsync", "payload_kb", "measure", "round", "value"])
        for (fsync, kb, name), values in sorted(results.items()):
            for i, v in enumerate(values):
                out.writerow([fsync, kb, name, i, f"{v:.2f}"])
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measures = ["redis-benchmark write/s", "bare write/s", "PipelineRL writer write/s", "rollstream write/s",
                "bare read/s", "rollstream read/s",
                *(f"e2e {p}p delivered/s" for p in args.producers)]
    fig, axes = plt.subplots(1, len(args.fsyncs), figsize=(6 * len(args.fsyncs), 4.5), squeeze=False)
    for ax, fsync in zip(axes[0], args.fsyncs):
        width = 0.8 / len(measures)
        for i, name in enumerate(measures):
            values = [med(r[name]) for f, _, r in rows if f == fsync]
            ax.bar(np.arange(len(args.sizes)) + i * width, values, width, label=name)
        ax.set_xticks(np.arange(len(args.sizes)) + 0.4 - width / 2, [f"{kb} KB" for kb in args.sizes])
        ax.set_yscale("log")
        ax.set_ylabel("entries/s (median)")
        ax.set_title(f"appendfsync {fsync}, {os.cpu_count()} cores")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / f"transport{suffix}.png", dpi=100)
    print(f"\nwrote {RESULTS / f'transport{suffix}.csv'} and {RESULTS / f'transport{suffix}.png'}")


if __name__ == "__main__":
    main()
