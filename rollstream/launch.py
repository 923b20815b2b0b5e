"""`rollstream run`: every process of an experiment on this machine, then nothing left behind.

Starts an embedded Redis when no URL is configured, the inference engine servers (strategy_name vllm_server),
one producer process per worker rank and the trainer,
waits for the trainer to finish max_steps, then stops the producers (SIGTERM: they return their slots)
and the server. Engines and producers log to files under logging_dir; the trainer owns the console. A crashed
engine or env-worker is restarted (its groups in flight are ended by the trainer through its heartbeat) up to
MAX_WORKER_RESTARTS times; then the run stops with an error naming its log.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import IO

import redis

from rollstream.shared.config import ConfigError, RollstreamConfig, dump_config
from rollstream.shared.config_checks import check_paths, engine_size, num_engines
from rollstream.shared.embedded import EmbeddedRedis, die_with_parent
from rollstream.shared.keys import Keys
from rollstream.shared.layout import visible_devices
from rollstream.shared.redis_io import URL_ENV, connect, redact, resolve_url

log = logging.getLogger(__name__)

MAX_WORKER_RESTARTS = 3
"""Restarts of one env-worker rank before `rollstream run` gives up: a worker that keeps crashing has a cause
(a bad env, a broken model) that restarting will not fix."""


def run_local(cfg: RollstreamConfig, *, fresh: bool = False) -> int:
    problems = check_paths(cfg)  # here, not as "see producer-0.log" after the processes started
    if problems:
        raise ConfigError(problems[0])
    out = Path(cfg.output_dir)
    config_path = out / "config.yaml"
    dump_config(cfg, config_path)
    ensure_pretrained(cfg)
    layout = cfg.train_layout
    logs = Path(cfg.logging_dir)
    logs.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        url = resolve_url(cfg.redis)
        if url is None:
            data = out / "redis"
            if not cfg.resume_from_checkpoint and data.exists():
                shutil.rmtree(data)  # a new run starts from an empty server; resuming keeps it
            url = stack.enter_context(EmbeddedRedis(data)).url
            log.info("embedded Redis at %s (data in %s)", url, data)
        _prepare_namespace(cfg, url, fresh)
        env = os.environ | {URL_ENV: url}
        engines = num_engines(cfg)
        for name in ([f"producer-{r}" for r in range(layout.num_workers)] + [f"engine-{r}" for r in range(engines)]
                     if not cfg.resume_from_checkpoint else ()):
            (logs / f"{name}.log").unlink(missing_ok=True)  # a new run starts new logs

        def spawn_engine(rank: int) -> subprocess.Popen[bytes]:
            # the engine binds its own devices (CUDA_VISIBLE_DEVICES of its server)
            return _spawn(["engine", str(config_path), "--engine-rank", str(rank)], env,
                          stack.enter_context(open(logs / f"engine-{rank}.log", "ab")))

        def spawn_producer(rank: int) -> subprocess.Popen[bytes]:
            # under vllm_server an env-worker holds no model, so it takes no device
            return _spawn(["producer", str(config_path), "--worker-rank", str(rank)],
                          env if engines else _devices(env, cfg, "actor_infer", rank),
                          stack.enter_context(open(logs / f"producer-{rank}.log", "ab")))

        servers = [spawn_engine(rank) for rank in range(engines)]
        if servers:
            log.info("started %d engine servers (logs in %s; about 2 minutes to start on a small CPU)", engines, logs)
        producers = [spawn_producer(rank) for rank in range(layout.num_workers)]
        log.info("started %d env-workers (logs in %s)", len(producers), logs)
        trainer = _spawn(["trainer", str(config_path)], _devices(env, cfg, "actor_train", 0), None)
        try:
            code = _wait_for_trainer(trainer, {"env-worker": (producers, spawn_producer, "producer"),
                                               "engine": (servers, spawn_engine, "engine")}, logs)
        finally:
            _stop_all([trainer, *producers, *servers])
    return code


def _devices(env: dict[str, str], cfg: RollstreamConfig, role: str, rank: int) -> dict[str, str]:
    """The role's device_mapping as CUDA_VISIBLE_DEVICES: env-worker k gets the k-th engine's GPUs, the trainer all
    of actor_train's."""
    mapping = getattr(cfg, role).device_mapping
    per_process = engine_size(cfg) if role == "actor_infer" else len(mapping or [])
    devices = visible_devices(mapping, rank, per_process)
    return env if devices is None else env | {"CUDA_VISIBLE_DEVICES": devices}


def ensure_pretrained(cfg: RollstreamConfig) -> None:
    """Build the offline tiny model at `pretrain` first, when the config asks for it and it is not there yet."""
    if not cfg.tiny_model.build or (Path(cfg.pretrain or "") / "config.json").exists():
        return
    from rollstream.tiny_model import main_tiny_model

    settings = cfg.tiny_model
    bound = f"{settings.sft_steps} steps" if settings.sft_seconds is None else \
        f"up to {settings.sft_steps} steps or {settings.sft_seconds:.0f} s"
    log.info("building the tiny model in %s (format warm start: %s)", cfg.pretrain, bound)
    main_tiny_model(str(cfg.pretrain), cfg.tiny_model, seed=cfg.seed)


def _prepare_namespace(cfg: RollstreamConfig, url: str, fresh: bool) -> None:
    client = connect(url, cfg.redis)
    keys = Keys.for_exp(cfg.exp_name)
    if fresh:
        deleted = delete_namespace(client, keys)
        if deleted:
            log.info("deleted %d keys of the previous run under %s", deleted, keys.ns)
    elif client.exists(keys.version, keys.counters, keys.traj):
        version = int(client.get(keys.version) or 0)
        log.warning("%s already holds experiment %r at version %d: continuing it (--fresh starts over)",
                    redact(url), cfg.exp_name, version)
    client.close()


def delete_namespace(client: redis.Redis, keys: Keys) -> int:
    """Delete every key under `<ns>:` and nothing else: SCAN with an escaped pattern and a prefix check, UNLINK
    in batches. No KEYS, so it neither blocks the server nor needs the @dangerous ACL category."""
    prefix, deleted, batch = f"{keys.ns}:".encode(), 0, []
    for key in client.scan_iter(match=keys.match_all, count=1000):
        if key.startswith(prefix):
            batch.append(key)
        if len(batch) >= 500:
            deleted += int(client.unlink(*batch))
            batch = []
    if batch:
        deleted += int(client.unlink(*batch))
    return deleted


def _spawn(args: list[str], env: dict[str, str], output: IO[bytes] | None) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "rollstream", *args], env=env, stdout=output,
                            stderr=subprocess.STDOUT if output else None, preexec_fn=die_with_parent)


Spawner = Callable[[int], subprocess.Popen[bytes]]


def _wait_for_trainer(trainer: subprocess.Popen[bytes],
                      roles: dict[str, tuple[list[subprocess.Popen[bytes]], Spawner, str]], logs: Path) -> int:
    """The trainer's exit code. A crashed env-worker or engine (roles: what -> (processes, spawn, log prefix)) is
    restarted (its list is updated in place) up to MAX_WORKER_RESTARTS times; one more crash ends the run with 1."""
    terminated = threading.Event()
    # Only a flag: the loop below drains. SIGINT is taken here too, as the trainer and env-workers take it: a
    # launch from a script's background job inherits SIGINT ignored, and Ctrl-C would stop them but not this.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: terminated.set())
    restarts = {what: [0] * len(processes) for what, (processes, _, _) in roles.items()}
    while trainer.poll() is None and not terminated.is_set():
        for what, (processes, spawn, prefix) in roles.items():
            for rank, p in enumerate(processes):
                if p.poll() in (None, 0):
                    continue
                process_log = logs / f"{prefix}-{rank}.log"
                if restarts[what][rank] == MAX_WORKER_RESTARTS:
                    log.error("%s %d exited with code %s after %d restarts: see %s; stopping the run", what,
                              rank, p.returncode, restarts[what][rank], process_log)
                    return 1
                restarts[what][rank] += 1
                log.warning("%s %d exited with code %s (see %s): restarting it (%d of %d)", what, rank,
                            p.returncode, process_log, restarts[what][rank], MAX_WORKER_RESTARTS)
                processes[rank] = spawn(rank)
        time.sleep(0.5)
    if terminated.is_set():  # checked after the loop too: a Ctrl-C'd trainer may drain and exit 0 before a tick
        log.warning("interrupted: stopping the trainer and env-workers")
        trainer.send_signal(signal.SIGTERM)
        trainer.wait()
        return 130
    return trainer.returncode


def _stop_all(processes: list[subprocess.Popen[bytes]], timeout_s: float = 30.0) -> None:
    for p in processes:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for p in processes:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("pid %d ignored SIGTERM for %.0f s: killing it", p.pid, timeout_s)
            p.kill()
            p.wait()
