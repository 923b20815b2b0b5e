"""`rollstream engine CONFIG --engine-rank K`: one inference engine server and the process that keeps it current.

This process starts vLLM's OpenAI-compatible server as a child in its own process group (vLLM's EngineCore and
workers outlive a killed API server, so the group is what gets killed, here on exit and at the next start if a
kill -9 left one behind), waits for /health, labels it with the version it loaded, then follows the weights
stream: each announced version is fetched, its digest checked (before pausing: generation goes on meanwhile),
and loaded exactly once through vLLM's RL endpoints (shared with the client in policy/vllm_server.py). Its
heartbeat hash in Redis carries its URL and the version it serves (weight pruning keeps that version).
A reload that fails kills vLLM's server, so this process then exits non-zero and its supervisor restarts it; a
restarted engine starts from the newest announced version.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import cast

import httpx
import redis.asyncio

from rollstream.producer.policy.vllm_server import EngineClient
from rollstream.shared.config import RollstreamConfig
from rollstream.shared.embedded import die_with_parent
from rollstream.shared.engines import SERVER_MODULE, EnginePlan, engine_plan, server_argv, server_options
from rollstream.shared.keys import Keys
from rollstream.shared.ledger import finished_version
from rollstream.shared.messages import EngineBeat, MessageError, parse_announcement
from rollstream.shared.redis_io import StreamEntries, cancel_and_wait, connect_async
from rollstream.shared.weights_io import verify_digest, weights_path_from_uri
from rollstream.shared.weights_transport import drop_downloads, fetch_weights

log = logging.getLogger(__name__)

HEARTBEAT_MISSES = 5
STOP_GRACE_S = 5.0
"""SIGTERM to the server's group, then SIGKILL after this long."""


class EngineServer:
    def __init__(self, cfg: RollstreamConfig, rank: int, client: redis.asyncio.Redis) -> None:
        self.cfg = cfg
        self.plan: EnginePlan = engine_plan(cfg, rank)
        self.options = server_options(cfg)
        self.client = client
        self.keys = Keys.for_exp(cfg.exp_name)
        self.run_dir = Path(cfg.output_dir) / "engines"
        self.pgid_file = self.run_dir / f"engine-{rank}.pgid"
        self.downloads = Path(cfg.output_dir) / "weights_downloaded" / f"engine-{rank}"
        self.http = httpx.AsyncClient(timeout=30.0)
        self.server = EngineClient(f"http://{_local(self.plan.host)}:{self.plan.port}", self.http)
        self.version = 0
        self.digest = ""
        self.incarnation = uuid.uuid4().hex[:12]
        self.child: subprocess.Popen[bytes] | None = None
        self.stop = asyncio.Event()
        self.reloads: list[float] = []
        """Seconds each reload paused the server (pause -> resume)."""

    async def run(self) -> None:
        kill_leftover_group(self.pgid_file)
        if (end := await finished_version(self.client, self.keys)) is not None:
            log.info("engine %d: experiment %r already finished at version %d (max_steps): nothing to serve",
                     self.plan.rank, self.cfg.exp_name, end)
            return
        last = cast(StreamEntries, await self.client.xrevrange(self.keys.weights, count=1))
        stream_id: bytes | str = last[0][0] if last else "0-0"
        model_dir = str(self.cfg.pretrain)
        if last:
            announced = await self._fetch_checked(last[0][1])
            if announced is not None:
                self.version, model_dir, self.digest = announced
        self._spawn(model_dir)
        try:
            await self._wait_healthy()
            await self.server.set_version(self.version)
            log.info("engine %d: serving version %d at %s", self.plan.rank, self.version, self.plan.url)
            await self._beat()
            tasks = [asyncio.create_task(self._follow(stream_id), name="follow-weights"),
                     asyncio.create_task(self._heartbeat(), name="heartbeat"),
                     asyncio.create_task(self._watch_child(), name="watch-server"),
                     asyncio.create_task(self._until_finished(), name="until-finished"),
                     asyncio.create_task(self.stop.wait(), name="stop")]
            done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            if stuck := await cancel_and_wait(pending, STOP_GRACE_S):
                log.warning("engine %d: tasks did not stop within %.0f s, left behind: %s", self.plan.rank,
                            STOP_GRACE_S, ", ".join(t.get_name() for t in stuck if isinstance(t, asyncio.Task)))
            for task in done:
                if not task.cancelled() and task.exception() is not None:
                    raise cast(BaseException, task.exception())
        finally:
            await self.client.delete(self.keys.engine(self.plan.rank))
            self._kill_group()
            await self.http.aclose()

    async def _until_finished(self) -> None:
        """Return once the trainer marks the experiment finished: the engine then stops its server and exits 0
        (supervisord leaves a program that exits 0 stopped, as it does the env-workers)."""
        while (end := await finished_version(self.client, self.keys)) is None:
            await asyncio.sleep(self.cfg.redis.heartbeat_s)
        log.info("engine %d: the trainer finished the experiment at version %d: stopping", self.plan.rank, end)

    def request_stop(self) -> None:
        self.stop.set()

    # ---- the server process ----

    def _spawn(self, model_dir: str) -> None:
        from vllm.platforms import current_platform

        env = os.environ | {"VLLM_SERVER_DEV_MODE": "1", "HF_HUB_OFFLINE": "1"}
        if self.plan.devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.plan.devices
        argv = server_argv(self.cfg, self.plan, model_dir, cpu=current_platform.is_cpu())
        log.info("engine %d: starting vLLM's server on %s (devices: %s)", self.plan.rank, self.plan.url,
                 self.plan.devices or "none bound: CPU")
        # Its own group (killed whole on exit), and SIGTERM when this process dies, even by kill -9
        self.child = subprocess.Popen([sys.executable, "-m", SERVER_MODULE, *argv], env=env,
                                      start_new_session=True, preexec_fn=die_with_parent)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.pgid_file.write_text(str(self.child.pid))

    def _kill_group(self) -> None:
        child, self.child = self.child, None
        if child is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGTERM)
        try:
            child.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
        # EngineCore and its workers ignore a dead API server: the whole group goes, whatever the parent did
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        self.pgid_file.unlink(missing_ok=True)

    async def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.options.startup_timeout_s
        while not await self.server.healthy():
            assert self.child is not None
            if self.child.poll() is not None:
                raise RuntimeError(f"engine {self.plan.rank}: vLLM's server exited with code "
                                   f"{self.child.returncode} before it was ready (its log is above)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"engine {self.plan.rank}: vLLM's server at {self.server.url} not healthy after "
                                   f"{self.options.startup_timeout_s:.0f} s (strategy_config.startup_timeout_s)")
            await asyncio.sleep(1.0)

    async def _watch_child(self) -> None:
        while self.child is not None and self.child.poll() is None:
            await asyncio.sleep(0.5)
        code = None if self.child is None else self.child.returncode
        raise RuntimeError(f"engine {self.plan.rank}: vLLM's server exited with code {code}")

    # ---- weights ----

    async def _fetch_checked(self, fields: dict[bytes, bytes]) -> tuple[int, str, str] | None:
        """(version, local directory, digest) of an announcement, digest checked; None (logged) if refused."""
        try:
            announced = parse_announcement(fields)
            version, digest = announced.version, announced.digest
            uri = await fetch_weights(self.client, self.keys, announced.uri, self.downloads)
            path = weights_path_from_uri(uri)
            await asyncio.to_thread(verify_digest, path, digest)
        except (asyncio.CancelledError, redis.RedisError):
            raise
        except Exception as e:  # pruned, lost or corrupt: the old weights stay, a newer version will come
            log.error("engine %d: refused weights announcement %r (%s: %s); keeping version %d", self.plan.rank,
                      {k.decode(): v.decode(errors="replace") for k, v in fields.items()}, type(e).__name__, e,
                      self.version)
            return None
        return version, str(path), digest

    async def _follow(self, stream_id: bytes | str) -> None:
        while True:
            raw = await self.client.xread({self.keys.weights: stream_id}, block=self.cfg.redis.block_ms)
            for _, entries in cast(list[tuple[bytes, StreamEntries]], raw):
                stream_id = entries[-1][0]
                fields = entries[-1][1]  # only the newest version matters
                try:
                    announced = parse_announcement(fields)
                except MessageError as e:
                    log.error("engine %d: refused a weights announcement (%s); keeping version %d", self.plan.rank,
                              e, self.version)
                    continue
                republished = announced.version == self.version and announced.digest != self.digest
                if announced.version > self.version or republished:
                    await self._reload(fields)

    async def _reload(self, fields: dict[bytes, bytes]) -> None:
        announced = await self._fetch_checked(fields)
        if announced is None:
            return
        version, path, digest = announced
        t0 = time.monotonic()
        # A failure here leaves vLLM's server dead or half-loaded: raise, so the supervisor restarts the engine
        await self.server.reload(version, path, self.options.request_timeout_s)
        self.reloads.append(time.monotonic() - t0)
        self.version, self.digest = version, digest
        await self._beat()
        drop_downloads(self.downloads, keep=Path(path).name)
        log.info("engine %d: serving version %d (reload paused it %.2f s)", self.plan.rank, version, self.reloads[-1])

    # ---- heartbeat ----

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.redis.heartbeat_s)
            if await self.server.healthy():
                await self._beat()

    async def _beat(self) -> None:
        key = self.keys.engine(self.plan.rank)
        beat = EngineBeat(
            rank=self.plan.rank, url=self.plan.url, host=socket.gethostname(), pid=os.getpid(),
            incarnation=self.incarnation, loaded_version=self.version, reloads=len(self.reloads),
            last_reload_s=round(self.reloads[-1], 3) if self.reloads else 0.0, last_seen=round(time.time(), 3),
        )
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping=beat.fields())  # type: ignore[arg-type]  # str keys
            pipe.pexpire(key, max(1, int(HEARTBEAT_MISSES * self.cfg.redis.heartbeat_s * 1000)))
            await pipe.execute()


def _local(host: str) -> str:
    """Where this process reaches its own server: a wildcard bind is reached on loopback."""
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def kill_leftover_group(pgid_file: Path) -> None:
    """SIGKILL the process group a killed predecessor left behind (vLLM's EngineCore holds the KV cache, and on a
    GPU its memory, until it dies). Only a group whose leader is gone and whose members are vLLM's processes."""
    try:
        pgid = int(pgid_file.read_text())
    except (FileNotFoundError, ValueError):
        return
    members = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _pgid_of(p) == pgid]
    names = [_cmdline(p) for p in members]
    if members and all("vllm" in n.lower() or "VLLM" in n or "multiprocessing" in n for n in names):
        log.warning("engine: killing %d processes a previous engine left behind (group %d)", len(members), pgid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
    pgid_file.unlink(missing_ok=True)


def _pgid_of(proc: Path) -> int | None:
    try:
        return int((proc / "stat").read_text().rsplit(")", 1)[1].split()[2])
    except (OSError, IndexError, ValueError):
        return None


def _cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def run_engine(cfg: RollstreamConfig, rank: int, url: str) -> None:
    asyncio.run(_main(cfg, rank, url))


async def _main(cfg: RollstreamConfig, rank: int, url: str) -> None:
    client = await connect_async(url, cfg.redis)
    engine = EngineServer(cfg, rank, client)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, engine.request_stop)
    try:
        await engine.run()
    finally:
        await client.aclose()
