"""`rollstream run` restarts a crashed env-worker a bounded number of times, then stops with its log named; its
env-workers run at `env_worker_nice`, the trainer at the launcher's own priority."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from rollstream.launch import MAX_WORKER_RESTARTS
from rollstream.shared.envs.frozen_lake import FrozenLakeEnv
from tests.conftest import REPO

CONFIG = REPO / "configs" / "frozen_lake_scripted.yaml"


class EnvThatCannotStartTwice(FrozenLakeEnv):
    """A user's env that holds something exclusive: one instance per process builds (the config check's), the
    next raises, so its env-worker process crashes on start, every time."""

    built = 0

    def __init__(self, **kwargs: Any) -> None:
        type(self).built += 1
        if type(self).built > 1:
            raise RuntimeError("this env cannot start")
        super().__init__(**kwargs)


def _run(out: Path, *overrides: str) -> subprocess.Popen[str]:
    env = dict(os.environ)
    env.pop("ROLLSTREAM_REDIS_URL", None)
    return subprocess.Popen([sys.executable, "-m", "rollstream", "run", str(CONFIG), f"output_dir={out}",
                             "wandb_mode=disabled", "redis.heartbeat_s=0.5", *overrides],
                            env=env, stderr=subprocess.PIPE, text=True)


def _producer(out: Path, rank: int) -> psutil.Process | None:
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "producer" in cmd and str(out / "config.yaml") in cmd and cmd[-1] == str(rank):
            return p
    return None


def _wait_for_first_step(run: subprocess.Popen[str], out: Path) -> None:
    """Until env-worker 0 has loaded the first trained version (the run is well under way)."""
    deadline = time.monotonic() + 60
    log = out / "logs" / "producer-0.log"
    while not log.exists() or "loaded policy version 1" not in log.read_text():
        assert time.monotonic() < deadline and run.poll() is None, "no train step"
        time.sleep(0.1)


def test_an_env_worker_killed_under_run_is_restarted_and_the_run_finishes(tmp_path: Path) -> None:
    out = tmp_path / "out"
    run = _run(out, "max_steps=10", "actor_infer.strategy_args.strategy_config.delay_s=0.02")
    try:
        _wait_for_first_step(run, out)
        victim = _producer(out, 0)
        assert victim is not None
        victim.send_signal(signal.SIGKILL)
        _, stderr = run.communicate(timeout=180)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, stderr[-3000:]
    assert f"env-worker 0 exited with code -9 (see {out / 'logs' / 'producer-0.log'}): restarting it (1 of" in stderr
    assert "trainer done: version 10" in stderr


def test_an_env_worker_that_keeps_crashing_stops_the_run_with_its_log_named(tmp_path: Path) -> None:
    out = tmp_path / "out"
    run = _run(out, "custom_envs.FrozenLake.env_type=tests.test_launch:EnvThatCannotStartTwice",
               "train_env_manager.tags=[FrozenLake]", "train_env_manager.num_groups_partition=null",
               "train_env_manager.num_env_groups=4", "train_env_manager.max_env_num_per_worker=32")
    _, stderr = run.communicate(timeout=240)
    assert run.returncode == 1, stderr[-3000:]
    log = out / "logs" / "producer-0.log"
    assert f"env-worker 0 exited with code 1 after {MAX_WORKER_RESTARTS} restarts: see {log}" in stderr
    assert log.read_text().count("this env cannot start") >= MAX_WORKER_RESTARTS + 1


def test_env_workers_run_at_the_configured_niceness_and_the_trainer_does_not(tmp_path: Path) -> None:
    out = tmp_path / "out"
    run = _run(out, "max_steps=3", "env_worker_nice=7", "actor_infer.strategy_args.strategy_config.delay_s=0.02")
    try:
        _wait_for_first_step(run, out)
        worker = _producer(out, 0)
        assert worker is not None and worker.nice() == 7
        trainer = next(p for p in psutil.Process(run.pid).children() if "trainer" in p.cmdline())
        assert trainer.nice() == os.nice(0)
        _, stderr = run.communicate(timeout=180)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, stderr[-3000:]
