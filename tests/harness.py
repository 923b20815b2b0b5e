"""Env-workers in a background thread with their own event loop, for tests that drive a trainer in-process."""

from __future__ import annotations

import asyncio
import io
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from rollstream.producer.policy.factory import make_policy
from rollstream.producer.worker import EnvWorker
from rollstream.shared.config import RollstreamConfig
from rollstream.shared.layout import plan_layout
from rollstream.shared.redis_io import connect_async


async def run_workers(cfg: RollstreamConfig, url: str, *, episodes_per_group: int | None = None,
                      started: threading.Event | None = None, stop: asyncio.Event | None = None) -> list[EnvWorker]:
    """All ranks of the layout in this event loop, until burst mode ends or `stop` is set."""
    layout = plan_layout(cfg.train_env_manager, cfg.custom_envs, "train_env_manager")
    # As the producer command connects: socket timeouts and retries, so a lost reply cannot hang a worker.
    clients = [await connect_async(url, cfg.redis) for _ in range(layout.num_workers)]
    workers = [EnvWorker(cfg, rank, client, make_policy(cfg), episodes_per_group=episodes_per_group)
               for rank, client in enumerate(clients)]
    runs = [asyncio.create_task(w.run()) for w in workers]
    if started:
        started.set()
    if stop is not None:
        await stop.wait()
        for w in workers:
            w.request_stop()
    try:
        await asyncio.gather(*runs)
    finally:
        for client in clients:
            await client.aclose()
    return workers


@contextmanager
def workers_in_thread(cfg: RollstreamConfig, url: str) -> Iterator[None]:
    """Workers play in a thread while the body runs; on exit they are stopped (SIGTERM path) and joined."""
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    started = threading.Event()
    errors: list[BaseException] = []

    def target() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(run_workers(cfg, url, started=started, stop=stop))
        except BaseException as e:  # surfaced to the test below
            errors.append(e)
        finally:
            loop.close()

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    started.wait(30)
    try:
        yield
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(180)
        if thread.is_alive():
            # What the workers are stuck in: the loop's pending tasks and where each waits (read from this
            # thread while the loop is idle in select, for the failure message only).
            stacks = io.StringIO()
            for task in list(asyncio.all_tasks(loop)):
                task.print_stack(limit=8, file=stacks)
            raise AssertionError(f"workers did not stop within 180 s; pending tasks:\n{stacks.getvalue()}")
        if errors:
            raise errors[0]
