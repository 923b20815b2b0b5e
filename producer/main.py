"""`rollstream producer CONFIG --worker-rank K`: one env-worker process."""

from __future__ import annotations

import asyncio
import logging
import signal

from rollstream.producer.policy.factory import make_policy
from rollstream.producer.worker import EnvWorker
from rollstream.shared.config import RollstreamConfig
from rollstream.shared.redis_io import connect_async

log = logging.getLogger(__name__)


def run_producer(cfg: RollstreamConfig, rank: int, url: str, *, episodes_per_group: int | None = None) -> None:
    asyncio.run(_main(cfg, rank, url, episodes_per_group))


async def _main(cfg: RollstreamConfig, rank: int, url: str, episodes_per_group: int | None) -> None:
    client = await connect_async(url, cfg.redis)
    policy = make_policy(cfg)
    worker = EnvWorker(cfg, rank, client, policy, episodes_per_group=episodes_per_group)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.request_stop)
    try:
        await worker.run()
    finally:
        await policy.close()
        await client.aclose()
    log.info("worker %d stopped after %d episodes", rank, sum(worker.stats.episodes.values()))
