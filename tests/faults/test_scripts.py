"""A Lua script call survives a Redis restart between any two of its commands.

A restarted Redis has an empty script cache. redis-py answers NOSCRIPT with SCRIPT LOAD and then EVALSHA, so a
second restart between those two failed the call: a trainer died that way in the fault tests (Redis killed
right after each step's commit, when the trainer loads the scripts it uses after a commit). Here every EVALSHA
finds the cache empty, as if Redis restarted just before it, on a real server.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis
import redis.asyncio

from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.redis_io import register_async_script, register_script

SCRIPT = "return redis.call('INCRBY', KEYS[1], ARGV[1])"


class ForgetfulRedis(redis.Redis):
    """A client whose server loses its scripts just before every EVALSHA."""

    def evalsha(self, sha: str, numkeys: int, *keys_and_args: Any) -> Any:  # type: ignore[override]
        self.script_flush()
        return super().evalsha(sha, numkeys, *keys_and_args)


class AsyncForgetfulRedis(redis.asyncio.Redis):
    async def evalsha(self, sha: str, numkeys: int, *keys_and_args: Any) -> Any:  # type: ignore[override]
        await self.script_flush()
        return await super().evalsha(sha, numkeys, *keys_and_args)


def test_a_script_runs_when_redis_loses_its_scripts_before_every_evalsha(redis_server: EmbeddedRedis) -> None:
    client = ForgetfulRedis.from_url(redis_server.url)
    client.delete("n")
    script = register_script(client, SCRIPT)
    assert [script(keys=["n"], args=[2]) for _ in range(3)] == [2, 4, 6]  # each ran exactly once
    assert client.register_script(SCRIPT).sha == script.sha  # the same script redis-py would load
    client.close()


def test_an_async_script_runs_when_redis_loses_its_scripts_before_every_evalsha(redis_server: EmbeddedRedis) -> None:
    async def main() -> list[int]:
        client = AsyncForgetfulRedis.from_url(redis_server.url)
        await client.delete("m")
        script = register_async_script(client, SCRIPT)
        try:
            return [await script(keys=["m"], args=[3]) for _ in range(3)]
        finally:
            await client.aclose()

    assert asyncio.run(main()) == [3, 6, 9]


def test_redis_py_alone_fails_there(redis_server: EmbeddedRedis) -> None:
    """The case above is the one redis-py's own script object does not survive (so the test above can fail)."""
    client = ForgetfulRedis.from_url(redis_server.url)
    with pytest.raises(redis.exceptions.NoScriptError):
        client.register_script(SCRIPT)(keys=["k"], args=[1])
    client.close()
