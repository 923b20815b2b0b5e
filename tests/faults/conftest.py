"""Fault cases: a Redis of each case's own (killed, restarted, stopped at will) and the real processes.

The audit reads the trainer's record file with msgpack alone: it shares no code with the trainer, so a bug in
the trainer's decoding or bookkeeping cannot hide itself from the check "nothing lost, nothing twice".
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import pytest
import redis

from rollstream.shared.config import dump_config, load_config
from rollstream.shared.embedded import EmbeddedRedis

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "frozen_lake_scripted.yaml"
GROUP_SIZE = 8


class FaultRedis(EmbeddedRedis):
    """An embedded server that a test kills, restarts on the same port and data, or stops and continues.

    The server is always started from one long-lived thread: PR_SET_PDEATHSIG fires when the *thread* that
    started a child ends, so a restart from a short-lived thread (the proxy's) would kill the new server."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._starter = ThreadPoolExecutor(1, thread_name_prefix="redis-starter")

    def start(self, timeout_s: float = 10.0) -> FaultRedis:
        self._starter.submit(super().start, timeout_s).result()
        return self

    def restart(self) -> None:
        self.kill()
        self.start()

    def pause(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def client(self, **options: Any) -> redis.Redis:
        return redis.Redis.from_url(self.url, **({"socket_timeout": 30} | options))

    def version(self, ns: str = "rollstream:faults") -> int:
        """The published policy version of experiment `ns`; -1 while the server is down or stopped."""
        client = self.client(socket_timeout=2)
        try:
            return int(client.get(f"{ns}:version") or 0)
        except Exception:  # down or stopped: not there yet
            return -1
        finally:
            client.close()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.resume()  # a stopped server cannot act on SIGTERM
        super().stop()


@pytest.fixture
def fault_redis(tmp_path: Path) -> Iterator[FaultRedis]:
    server = FaultRedis(tmp_path / "redis")
    server.start()
    try:
        yield server
    finally:
        server.stop()


def wait_until(condition: Callable[[], Any], timeout_s: float, what: str, every_s: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(every_s)


@dataclass
class Job:
    """The scripted FrozenLake job as separate processes against one Redis: env-workers and a trainer."""

    tmp_path: Path
    url: str
    overrides: list[str]
    exp_name: str = "faults"
    config: Path = CONFIG
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.record = self.tmp_path / "trained.msgpack"
        self.logs = self.tmp_path / "logs"
        self.logs.mkdir(exist_ok=True)
        self.cfg = load_config(self.config, [
            f"exp_name={self.exp_name}", f"output_dir={self.tmp_path / 'out'}", "wandb_mode=disabled",
            f"record_to={self.record}", "redis.block_ms=200", *self.overrides])
        self.config_path = self.tmp_path / "config.yaml"
        dump_config(self.cfg, self.config_path)
        per_worker = self.cfg.train_env_manager.max_env_num_per_worker
        total = self.cfg.train_env_manager.num_env_groups * self.cfg.train_env_manager.group_size
        self.num_workers = -(-total // per_worker)

    def env(self, url: str | None = None) -> dict[str, str]:
        return os.environ | {"ROLLSTREAM_REDIS_URL": url or self.url, "PYTHONPATH": str(REPO)}

    def spawn(self, name: str, *args: str, url: str | None = None) -> subprocess.Popen[bytes]:
        with open(self.logs / f"{name}.log", "ab") as log:
            proc = subprocess.Popen([sys.executable, "-m", "rollstream", *args], env=self.env(url), stdout=log,
                                    stderr=subprocess.STDOUT)
        self.procs[name] = proc
        return proc

    def start_trainer(self, url: str | None = None) -> subprocess.Popen[bytes]:
        return self.spawn("trainer", "trainer", str(self.config_path), url=url)

    def start_ranks(self, ranks: int, *overrides: str) -> subprocess.Popen[bytes]:
        """The trainer on `ranks` ranks under torchrun, as `rollstream deploy` launches it."""
        with open(self.logs / "trainer.log", "ab") as log:
            proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
                                     "--module", "rollstream", "trainer", str(self.config_path), *overrides],
                                    env=self.env() | {"OMP_NUM_THREADS": "1"}, stdout=log, stderr=subprocess.STDOUT)
        self.procs["trainer"] = proc
        return proc

    def start_workers(self, *args: str) -> list[subprocess.Popen[bytes]]:
        return [self.spawn(f"producer-{rank}", "producer", str(self.config_path), "--worker-rank", str(rank), *args)
                for rank in range(self.num_workers)]

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def log_tails(self, chars: int = 2500) -> str:
        """The end of every process's log, for a failure message that says where each one stood."""
        return "\n".join(f"--- {name}:\n{self.log(name)[-chars:]}" for name in self.procs)

    def wait_trainer(self, timeout_s: float) -> int:
        try:
            return self.procs["trainer"].wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"trainer still running after {timeout_s} s:\n{self.log('trainer')[-3000:]}") from None

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture
def job_factory(tmp_path: Path) -> Iterator[Callable[..., Job]]:
    jobs: list[Job] = []

    def make(url: str, *overrides: str, name: str = "job", config: Path = CONFIG) -> Job:
        path = tmp_path / name
        path.mkdir()
        jobs.append(Job(path, url, list(overrides), config=config))
        return jobs[-1]

    yield make
    for job in jobs:
        job.stop()


# ---- the audit: msgpack only ----

@dataclass
class Audit:
    trained: Counter[tuple[str, int]]
    """(group id, member) -> how many times it was trained."""

    @property
    def twice(self) -> list[tuple[str, int]]:
        return [k for k, n in self.trained.items() if n > 1]

    @property
    def groups(self) -> Counter[str]:
        return Counter(g for g, _ in self.trained)

    @property
    def incomplete(self) -> list[str]:
        return [g for g, n in self.groups.items() if n != GROUP_SIZE]


def audit(record: Path) -> Audit:
    """Read the trainer's record file (a header map, then one map of stream-entry fields per trained trajectory)."""
    trained: Counter[tuple[str, int]] = Counter()
    with open(record, "rb") as f:
        unpacker = msgpack.Unpacker(f, raw=False, strict_map_key=False)
        header = next(unpacker)
        assert header.get("format") == "rollstream-trajectories", header
        for entry in unpacker:
            body = msgpack.unpackb(entry[b"payload"] if b"payload" in entry else entry["payload"], raw=False,
                                   ext_hook=lambda code, data: None)["body"]
            trained[(body["group_id"], body["member"])] += 1
    return Audit(trained)


# ---- a TCP proxy that drops one reply: a command that ran but whose answer the client never got ----

class ReplyDropper:
    """Forwards connections to Redis; once armed, the first reply to a request containing `marker` (and at
    least `min_reply` bytes long) is swallowed, `on_drop` runs, and that client connection is cut."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.marker: bytes | None = None
        self.min_reply = 0
        self.on_drop: Callable[[], None] = lambda: None
        self.dropped = threading.Event()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def arm(self, marker: bytes, *, min_reply: int = 0, on_drop: Callable[[], None] = lambda: None) -> None:
        self.marker, self.min_reply, self.on_drop = marker, min_reply, on_drop
        self.dropped.clear()

    def close(self) -> None:
        self._closed = True
        self.listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._pump, args=(client,), daemon=True).start()

    def _pump(self, client: socket.socket) -> None:
        try:
            server = socket.create_connection(("127.0.0.1", self.upstream_port))
        except OSError:
            client.close()
            return
        watching = False  # this connection sent the marked request; its next reply is the one to drop
        try:
            while True:
                ready, _, _ = select.select([client, server], [], [])
                if client in ready:
                    data = client.recv(1 << 16)
                    if not data:
                        return
                    if self.marker is not None and self.marker in data:
                        watching = True
                    server.sendall(data)
                if server in ready:
                    data = server.recv(1 << 16)
                    if not data:
                        return
                    if watching and self.marker is not None and len(data) >= self.min_reply:
                        self.marker = None  # once
                        self.on_drop()
                        self.dropped.set()
                        return
                    watching = False
                    client.sendall(data)
        except OSError:
            return
        finally:
            client.close()
            server.close()
