"""An admission whose reply is lost across a Redis restart takes one slot, not two."""

from __future__ import annotations

import asyncio

from rollstream.shared.config import RedisConfig
from rollstream.shared.keys import Keys
from rollstream.shared.ledger import Admission, AsyncAdmissions
from rollstream.shared.redis_io import connect_async
from tests.faults.conftest import FaultRedis, ReplyDropper

KEYS = Keys.for_exp("faults")


def test_an_admission_whose_reply_is_lost_across_a_restart_is_given_once(fault_redis: FaultRedis) -> None:
    proxy = ReplyDropper(fault_redis.port)

    async def main() -> list[Admission]:
        client = await connect_async(proxy.url, RedisConfig())
        admissions = AsyncAdmissions(client, KEYS, groups_per_batch=2, ratio=0, owner="0 abc")
        first = await admissions.admit("train/A/g0/e")
        # The admission runs, then Redis is killed -9 and restarted (appendfsync always) before its reply gets
        # back: redis-py sends the same call again on a new connection, against an empty script cache.
        proxy.arm(b"train/A/g1/e", on_drop=fault_redis.restart)
        second = await admissions.admit("train/A/g1/e")
        assert proxy.dropped.is_set()
        third = await admissions.admit("train/A/g1/e")  # a new request for a third slot
        await client.aclose()
        return [first, second, third]

    first, second, third = asyncio.run(main())
    assert (first.episode, second.episode, third.episode) == (0, 0, None)  # the cap is two
    client = fault_redis.client()
    assert sorted(client.zrange(KEYS.inflight, 0, -1)) == [b"train/A/g0/e0", b"train/A/g1/e0"]
    assert int(client.hget(KEYS.counters, "admitted")) == 2
    proxy.close()
