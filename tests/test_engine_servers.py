"""The vllm_server shape end to end: `rollstream run` starts one engine server (vLLM's server, CPU build), two
env-workers that hold no model, and the trainer, on the tiny FrozenLake job; the engine's vLLM server is killed -9
mid-run and comes back.

One run, two engine starts (one to two minutes each on 2 cores): the run must finish, every trained trajectory's
turns come from versions within the cap, no partial group is trained, the counters reconcile, the restarted engine
serves the version published by then, and the logprobs of trajectories generated after reloads match transformers
on that version's weights (untied model; the tied one is checked in tests/policy/test_vllm_server.py).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import redis

from rollstream.shared.codec import decode_entry
from rollstream.shared.embedded import EmbeddedRedis, free_port
from rollstream.shared.keys import Keys
from rollstream.shared.ledger import read_counters, reconciles
from rollstream.shared.recording import read_records
from rollstream.tiny_model import build_tiny_model
from tests.conftest import REPO
from tests.policy.helpers import reference_logprobs

pytestmark = [pytest.mark.timeout(1200)]
MAX_STEPS = 5
RATIO = 1


def test_engine_server_run_survives_a_kill_of_its_server(tmp_path: Path, redis_server: EmbeddedRedis,
                                                         redis_client: redis.Redis) -> None:
    model = build_tiny_model(tmp_path / "model", tie_word_embeddings=False, corpus_episodes=50)
    out, record = tmp_path / "out", tmp_path / "trained.msgpack"
    port = free_port()
    overrides = [
        f"output_dir={out}", f"pretrain={model}", "tiny_model.build=false", "wandb_mode=disabled", "eval_steps=0",
        f"max_steps={MAX_STEPS}", f"record_to={record}", f"async_generation_ratio={RATIO}", "redis.block_ms=200",
        "rollout_batch_size=8", "train_env_manager.num_env_groups=2", "train_env_manager.group_size=4",
        "train_env_manager.max_env_num_per_worker=4",  # two env-workers, one group each
        "actor_train.training_args.per_device_train_batch_size=8", "logging_steps=1",
        "train_env_manager.group_filter_cls=null",  # every group trains: the kill's accounting stays exact
        "actor_infer.strategy_args.strategy_name=vllm_server",
        f"actor_infer.strategy_args.strategy_config={{gpu_memory_utilization: 0.1, enforce_eager: true, "
        f"base_port: {port}, max_model_len: 1024}}",
    ]
    env = os.environ | {"ROLLSTREAM_REDIS_URL": redis_server.url}
    log = tmp_path / "run.log"  # a file, not a pipe: nothing reads the run's output until it ends
    with log.open("w") as sink:
        run = subprocess.Popen([sys.executable, "-m", "rollstream", "run",
                                str(REPO / "configs" / "frozen_lake.yaml"), *overrides],
                               env=env, stderr=sink, text=True, start_new_session=True)
    keys = Keys.for_exp("frozen_lake")
    kept = tmp_path / "kept"  # every published version, copied as it appears: the run prunes old ones
    keeper = threading.Thread(target=_keep_versions, args=(out / "weights", kept, run), daemon=True)
    keeper.start()
    try:
        killed_at, killed_group = _kill_server_mid_run(redis_client, keys, out, run, port)
        try:
            run.wait(timeout=600)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the run did not end 600 s after the kill; where it stood:\n{_log_tails(log, out)}")
        keeper.join()
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
            with contextlib.suppress(OSError, ValueError):  # the server's own group: vLLM must not outlive the test
                os.killpg(int((out / "engines" / "engine-0.pgid").read_text()), signal.SIGKILL)
    stderr = log.read_text()
    assert run.returncode == 0, stderr[-4000:]
    assert f"trainer done: version {MAX_STEPS}" in stderr
    # The console shows the run's own progress, not a library's bar per model loaded or saved
    assert "Loading weights" not in stderr and "Writing model shards" not in stderr

    trajs = [decode_entry(r) for r in read_records(record)]
    engine_log = (out / "logs" / "engine-0.log").read_text()
    assert len(trajs) == MAX_STEPS * 8
    assert set(Counter(t.group_id for t in trajs).values()) == {4}  # no partial group was trained
    for step in range(MAX_STEPS):
        for traj in trajs[step * 8:(step + 1) * 8]:
            versions = {turn.version for turn in traj.turns}
            assert versions and min(versions) >= step - RATIO and max(versions) <= step, (step, versions)
    assert max(turn.version for t in trajs for turn in t.turns) >= 2  # versions advanced on the server
    # Parity after a reload (untied model), against transformers on that version's weights: the newest version
    # loaded by a reload (not at an engine's start) that trained replies came from, turn by turn (a trajectory's
    # turns may span versions: each turn's tokens are scored by its own version, on the whole prefix before it)
    reloaded = [int(v) for v in re.findall(r"engine 0: serving version (\d+) \(reload", engine_log)]
    turns = {v: [(t, turn) for t in trajs for turn in t.turns if turn.version == v and turn.response_span[1]]
             for v in reloaded}
    last = max((v for v in reloaded if turns[v]), default=None)
    assert last is not None, f"no trained reply came from a reloaded version ({reloaded})"
    for traj, turn in turns[last][:3]:
        span = np.arange(*turn.response_span)
        positions = span[traj.response_mask[span] == 1]
        ref = reference_logprobs(kept / f"v{last}", traj.input_ids[:turn.response_span[1]], positions)
        np.testing.assert_allclose(traj.logprobs[positions], ref, atol=1e-4, rtol=0)

    counts = read_counters(redis_client, keys)
    assert reconciles(counts), counts
    assert counts.get("failed_dropped", 0) >= 1, counts  # the episodes in flight at the kill ended as failed
    started = [int(v) for v in re.findall(r"engine 0: serving version (\d+) at", engine_log)]
    assert len(started) == 2 and started[1] >= killed_at, started  # the restart rejoined at the current version
    assert not _leftovers(out, killed_group)


def _kill_server_mid_run(client: redis.Redis, keys: Keys, out: Path, run: subprocess.Popen[str],
                         port: int) -> tuple[int, int]:
    """Once the engine serves version 2, SIGKILL its vLLM server (not the engine program: a crashed server is what
    a GPU fault or the OOM killer does) while a reply request is certainly in flight. Returns the version it served
    and its process group (its EngineCore survives it until the engine program kills the group)."""
    deadline = time.monotonic() + 600
    group = -1
    while True:
        assert run.poll() is None, "the run ended before the kill"
        assert time.monotonic() < deadline, "the engine never reached version 2 with a request in flight"
        served = int(client.hget(keys.engine(0), "loaded_version") or -1)
        if served < 2:
            time.sleep(0.05)
            continue
        # The server's processes are stopped, then killed once a reply request waits unread in its socket: a kill
        # between two requests, or while the workers wait on the version cap, would end no episode. The health
        # and version probes are GETs of a few hundred bytes; a reply request carries the prompt's token ids.
        group = int((out / "engines" / "engine-0.pgid").read_text())
        os.killpg(group, signal.SIGSTOP)
        waited = time.monotonic() + 3
        while _unread_bytes(port) < 600 and time.monotonic() < waited:
            time.sleep(0.01)
        if _unread_bytes(port) >= 600:
            os.kill(group, signal.SIGKILL)  # the server leads its process group
            os.killpg(group, signal.SIGCONT)
            return served, group
        os.killpg(group, signal.SIGCONT)
        time.sleep(0.2)


def _unread_bytes(port: int) -> int:
    """The most bytes waiting unread in one TCP connection to `port` on this machine (/proc/net/tcp)."""
    most = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local_port = int(fields[1].rsplit(":", 1)[1], 16)
        if local_port == port:
            most = max(most, int(fields[4].split(":")[1], 16))
    return most


def _log_tails(run_log: Path, out: Path, lines: int = 40) -> str:
    """The last lines of the run's own log and of each process log under its output dir: what a hung run was
    doing, in the failure report (the tmp dir is gone by the time anyone reads a CI log)."""
    tails = []
    for path in [run_log, *sorted((out / "logs").glob("*.log"))]:
        with contextlib.suppress(OSError):
            text = [line[:240] for line in path.read_text(errors="replace").splitlines()[-lines:]]
            tails.append(f"--- {path.name} (last {len(text)} lines) ---\n" + "\n".join(text))
    return "\n".join(tails)


def _keep_versions(weights: Path, kept: Path, run: subprocess.Popen[str]) -> None:
    while run.poll() is None:
        for version in weights.glob("v*") if weights.is_dir() else ():
            if not (kept / version.name).exists():
                with contextlib.suppress(OSError):  # pruned meanwhile: that version was not needed
                    shutil.copytree(version, kept / version.name)
        time.sleep(0.1)


def _leftovers(out: Path, group: int) -> list[int]:
    """Processes still running from this run's output or model dir, or of the killed server's group."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
            pgid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[2])
        except (OSError, IndexError, ValueError):
            continue
        if str(out) in cmdline or str(out.parent / "model") in cmdline or pgid == group:
            found.append(int(proc.name))
    return found


def test_an_engine_of_a_finished_experiment_exits_0_without_starting_its_server(
        tmp_path: Path, redis_server: EmbeddedRedis, redis_client: redis.Redis) -> None:
    """As an env-worker does: supervisord leaves a program that exits 0 stopped, so the run's end stays the end."""
    model = build_tiny_model(tmp_path / "model", tie_word_embeddings=False, corpus_episodes=5)
    redis_client.set(Keys.for_exp("frozen_lake").finished, 7)
    proc = subprocess.run(
        [sys.executable, "-m", "rollstream", "engine", str(REPO / "configs" / "frozen_lake.yaml"), "--engine-rank",
         "0", f"output_dir={tmp_path / 'out'}", f"pretrain={model}", "tiny_model.build=false",
         "actor_infer.strategy_args.strategy_name=vllm_server"],
        env=os.environ | {"ROLLSTREAM_REDIS_URL": redis_server.url}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "already finished at version 7" in proc.stderr and "starting vLLM's server" not in proc.stderr
