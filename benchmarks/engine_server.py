"""The env loop through one engine server (vllm_server) against the in-process engine (vllm) and the engine's raw
batched rate, at the same concurrency; and the weight reload latency through the server.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/engine_server.py [--envs 64] [--seconds 30] [--reloads 5]

One tiny model (untied, float32), one engine at a time on this machine:
1. vLLM's server as `rollstream engine` starts it (same module and flags), driven by VLLMServerPolicy over HTTP:
   `server: env loop` (N envs play FrozenLake through the real episode loop, every request recorded),
   `server: raw` (N clients send exactly those requests back to back), then `--reloads` reloads through the RL
   endpoints (pause wait -> reload_weights_and_retie -> relabel -> resume), timed from the client, idle;
2. the server stopped, the in-process engine (VLLMPolicy): `in-process: env loop`, and `in-process: raw` on the
   same recorded requests: the engine's raw batched rate, the baseline every row is divided by;
3. the server again (`server (again)`), so drift of this shared machine between the phases shows.
Tokens/s over a steady-state window (see env_loop_throughput.py). Goal (issue #12): server env loop >= 0.8x raw.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Coroutine
from pathlib import Path

import httpx
from env_loop_throughput import TokenMeter, env_client, first_turn_requests, raw_client, steady_rate

from rollstream.producer.policy.base import Policy
from rollstream.producer.policy.vllm import VLLMPolicy
from rollstream.producer.policy.vllm_server import EngineClient, VLLMServerPolicy
from rollstream.shared.config import load_config
from rollstream.shared.embedded import die_with_parent, free_port
from rollstream.shared.engines import SERVER_MODULE, engine_plans, server_argv
from rollstream.tiny_model import build_tiny_model

REPO = Path(__file__).resolve().parent.parent


def start_server(model_dir: Path, port: int) -> tuple[subprocess.Popen[bytes], str]:
    cfg = load_config(REPO / "configs" / "frozen_lake.yaml", [
        f"pretrain={model_dir}", "tiny_model.build=false", "actor_infer.strategy_args.strategy_name=vllm_server",
        f"actor_infer.strategy_args.strategy_config={{gpu_memory_utilization: 0.1, enforce_eager: true, "
        f"base_port: {port}, max_model_len: 2048}}"])
    [plan] = engine_plans(cfg)
    argv = server_argv(cfg, plan, str(model_dir), cpu=True)
    env = os.environ | {"VLLM_SERVER_DEV_MODE": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", SERVER_MODULE, *argv], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=die_with_parent)
    return proc, plan.url


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the whole group: EngineCore outlives the API server otherwise
    except ProcessLookupError:
        pass
    proc.wait()


async def wait_ready(client: EngineClient, proc: subprocess.Popen[bytes]) -> float:
    t0 = time.monotonic()
    while not await client.healthy():
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM's server exited with {proc.returncode}")
        await asyncio.sleep(1.0)
    return time.monotonic() - t0


async def phases(meter: TokenMeter, n: int, seconds: float, requests: list | None, prefix: str,
                 rates: dict[str, tuple[float, int]]) -> list:
    async def measure(phase: str, clients: list[Coroutine[None, None, None]]) -> None:
        replies = meter.replies
        rates[f"{prefix}: {phase}"] = await steady_rate(meter, clients, seconds), meter.replies - replies

    first_turns = first_turn_requests(meter.policy, 256)
    await steady_rate(meter, [raw_client(meter, first_turns, i, n) for i in range(n)], 3)  # warm-up
    meter.recorded = []
    await measure("env loop", [env_client(meter, i) for i in range(n)])
    recorded, meter.recorded = meter.recorded, None
    await measure("raw", [raw_client(meter, requests or recorded, i, n) for i in range(n)])
    return recorded


def perturbed_copy(src: Path, dst: Path) -> Path:
    """`src` plus noise, saved as the trainer publishes a version: what a reload loads."""
    import torch
    from transformers import AutoModelForCausalLM

    from rollstream.shared.weights_io import save_pretrained_atomically

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    save_pretrained_atomically(model, dst)
    return dst


async def server_phases(model_dir: Path, other: Path, n: int, seconds: float, requests: list | None, prefix: str,
                        rates: dict[str, tuple[float, int]], reloads: list[float], count: int) -> tuple[list, float]:
    proc, url = start_server(model_dir, free_port())
    try:
        async with httpx.AsyncClient() as http:
            client = EngineClient(url, http)
            started_s = await wait_ready(client, proc)
            await client.set_version(0)
            policy: Policy = VLLMServerPolicy(str(model_dir), [url])
            meter = TokenMeter(policy)
            try:
                recorded = await phases(meter, n, seconds, requests, prefix, rates)
            finally:
                await policy.close()
            for k in range(count):
                t0 = time.monotonic()
                await client.reload(k + 1, str(other if k % 2 == 0 else model_dir), 120.0)
                reloads.append(time.monotonic() - t0)
    finally:
        stop_server(proc)
    return recorded, started_s


async def main(args: argparse.Namespace) -> None:
    n = args.envs
    rates: dict[str, tuple[float, int]] = {}
    reloads: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "tiny", tie_word_embeddings=False)
        other = perturbed_copy(model_dir, Path(tmp) / "v1")
        # server, in-process, server again: the machine is shared, so drift between phases shows
        recorded, started_s = await server_phases(model_dir, other, n, args.seconds, None, "server", rates, reloads,
                                                  args.reloads)
        meter = TokenMeter(VLLMPolicy(model_dir, gpu_memory_utilization=0.1, enforce_eager=True, max_model_len=2048,
                                      dtype="float32"))
        try:
            await phases(meter, n, args.seconds, recorded, "in-process", rates)
        finally:
            await meter.policy.close()
        await server_phases(model_dir, other, n, args.seconds, recorded, "server (again)", rates, reloads, 0)
    raw = rates["in-process: raw"][0]
    load = os.getloadavg()[0]
    print(f"\nenvs={n} seconds={args.seconds} (steady state), load average {load:.1f}; server start {started_s:.0f} s")
    print(f"{'phase':<30}{'tokens/s':>10}{'vs in-process raw':>19}{'replies':>9}")
    for phase, (rate, replies) in rates.items():
        print(f"{phase:<30}{rate:>10.0f}{rate / raw:>19.2f}{replies:>9}")
    server_loop = (rates["server: env loop"][0] + rates["server (again): env loop"][0]) / 2
    server_raw = (rates["server: raw"][0] + rates["server (again): raw"][0]) / 2
    print(f"server env loop / server raw: {server_loop / server_raw:.2f}; server env loop / in-process raw: "
          f"{server_loop / raw:.2f} (goal >= 0.80)")
    if reloads:
        print(f"reload through the server (pause wait -> reload -> relabel -> resume), idle, {len(reloads)} times: "
              f"median {statistics.median(reloads):.3f} s (min {min(reloads):.3f}, max {max(reloads):.3f})")


if __name__ == "__main__":  # vLLM's engine runs in a spawned process: the guard is required
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--envs", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--reloads", type=int, default=5)
    asyncio.run(main(parser.parse_args()))
