"""The async client's command packing (`pack_with_hiredis`): hiredis takes the arguments as they are, redis-py's
own serializer what hiredis refuses; the bytes are redis-py's either way, and a real Redis reads them back."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis
import redis.asyncio
from redis.connection import HiredisRespSerializer

from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.redis_io import pack_with_hiredis


def packing_client(url: str) -> redis.asyncio.Redis:
    client = redis.asyncio.Redis.from_url(url)
    pack_with_hiredis(client)
    return client


@pytest.mark.parametrize("args", [
    ("XADD", "s", "*", "kind", "traj", "payload", b"\x00\xff\r\n", "version", 3, "score", 0.25, "tag", "é"),
    ("CLIENT SETNAME", "a-name"),  # a name of two words: redis-py splits it
    ("SET", "k", bytearray(b"ab")),  # hiredis refuses a bytearray: redis-py's serializer converts it
    ("SET", "k", memoryview(b"ab")),
])
def test_the_bytes_are_redis_pys_own(redis_server: EmbeddedRedis, args: tuple[Any, ...]) -> None:
    connection = packing_client(redis_server.url).connection_pool.make_connection()
    assert connection.pack_command(*args) == HiredisRespSerializer().pack(*args)


def test_an_argument_neither_packer_takes_is_refused_as_redis_py_refuses_it(redis_server: EmbeddedRedis) -> None:
    connection = packing_client(redis_server.url).connection_pool.make_connection()
    with pytest.raises(redis.DataError):
        connection.pack_command("SET", "k", None)


def test_entries_written_through_it_read_back_unchanged(redis_server: EmbeddedRedis) -> None:
    fields = {"payload": bytes(range(256)) * 8, "version": 7, "score": 0.5, "tag": "FrozenLake"}

    async def write() -> None:
        client = packing_client(redis_server.url)
        await client.xadd("packing", fields)  # type: ignore[arg-type]
        await client.aclose()

    asyncio.run(write())
    [(_, read)] = redis.Redis.from_url(redis_server.url).xrange("packing")
    assert read == {b"payload": fields["payload"], b"version": b"7", b"score": b"0.5", b"tag": b"FrozenLake"}
