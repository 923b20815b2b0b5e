"""Tasks looping over Redis commands stop when cancelled, although redis-py can swallow a cancellation.

A cancellation that lands inside a redis-py command can vanish (redis/redis-py#2028, #2551): the task goes on
and its loop never ends. This stalled an engine whose vLLM server was killed: the engine stopped waiting for its
weights-following loop and never exited to be restarted. `cancel_and_wait` cancels again until the tasks end.
"""

from __future__ import annotations

import asyncio
import random

import redis.asyncio

from rollstream.shared.config import RedisConfig
from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.redis_io import cancel_and_wait, connect_async

ROUNDS = 100


async def _follow(client: redis.asyncio.Redis) -> None:
    while True:
        await client.xread({"weights": "$"}, block=20)


async def _poll(client: redis.asyncio.Redis) -> None:
    while (await client.get("finished")) is None:
        await asyncio.sleep(0.001)


def test_looping_tasks_end_when_cancelled_in_any_command(redis_server: EmbeddedRedis) -> None:
    async def main() -> tuple[int, int]:
        rng = random.Random(0)
        client = await connect_async(redis_server.url, RedisConfig())
        swallowed = 0
        for _ in range(ROUNDS):
            tasks = [asyncio.create_task(_follow(client)), asyncio.create_task(_poll(client))]
            await asyncio.sleep(rng.uniform(0.0, 0.03))
            for task in tasks:
                task.cancel()
            _, pending = await asyncio.wait(tasks, timeout=0.1)  # what one cancel did
            swallowed += len(pending)
            assert not await cancel_and_wait(tasks, 5.0)
            assert all(t.cancelled() for t in tasks)
        await client.aclose()
        return swallowed, ROUNDS * 2

    swallowed, tasks = asyncio.run(main())
    print(f"\n{swallowed} of {tasks} tasks went on after one cancel")
