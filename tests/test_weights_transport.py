"""weights_transport: redis — weights copied into Redis in chunks, downloaded by producers, pruned like directories."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import redis
import redis.asyncio

from rollstream.consumer.pruning import prune_redis_versions
from rollstream.producer.policy.hf import HFPolicy
from rollstream.producer.worker import EnvWorker
from rollstream.shared.keys import Keys
from rollstream.shared.messages import WeightsAnnouncement
from rollstream.shared.weights_io import compute_digest, weights_path_from_uri
from rollstream.shared.weights_transport import SCHEME, fetch_weights, share_weights
from tests.conftest import scripted_config
from tests.policy.helpers import tiny_versions

KEYS = Keys.for_exp("transport")


def _weights_dir(root: Path) -> Path:
    d = root / "weights" / "v3"
    (d / "nested").mkdir(parents=True)
    (d / "model.safetensors").write_bytes(bytes(range(256)) * 41)  # 10,496 bytes: several chunks
    (d / "nested" / "tokenizer.json").write_text('{"a": 1}')
    (d / "empty.txt").write_bytes(b"")
    return d


def _fetch(url: str, uri: str, cache: Path) -> str:
    async def body() -> str:
        client = redis.asyncio.Redis.from_url(url)
        try:
            return await fetch_weights(client, KEYS, uri, cache)
        finally:
            await client.aclose()

    return asyncio.run(body())


def test_a_version_round_trips_through_redis_chunks_with_the_same_digest(tmp_path: Path, redis_server,
                                                                         redis_client: redis.Redis) -> None:
    src = _weights_dir(tmp_path / "trainer")
    announcement = share_weights(redis_client, KEYS, WeightsAnnouncement(3, src.as_uri(), compute_digest(src)),
                                 chunk_bytes=1000)
    assert announcement.uri == SCHEME + "v3"
    assert redis_client.keys(f"{KEYS.ns}:weights:*") == [KEYS.weights_blob("v3").encode()]  # no temp key left

    cache = tmp_path / "producer"
    local = weights_path_from_uri(_fetch(redis_server.url, announcement.uri, cache))
    assert local == (cache / "v3").resolve()
    assert compute_digest(local) == announcement.digest
    assert _fetch(redis_server.url, announcement.uri, cache) == local.as_uri()  # downloaded once
    assert _fetch(redis_server.url, src.as_uri(), cache) == src.as_uri()  # file:// passes through

    with pytest.raises(FileNotFoundError, match="Redis has no key"):
        _fetch(redis_server.url, SCHEME + "v9", cache)
    assert sorted(p.name for p in cache.iterdir()) == ["v3"]  # a failed download leaves nothing behind


def test_an_announcement_without_weights_is_not_shared(redis_client: redis.Redis) -> None:
    assert share_weights(redis_client, KEYS, WeightsAnnouncement(1), 1000) == WeightsAnnouncement(1)
    assert redis_client.dbsize() == 0


def test_redis_copies_are_pruned_once_every_live_worker_moved_past_them(redis_client: redis.Redis) -> None:
    for name in ("v1", "v1:tmp-0a1b2c3d", "v2", "v2-resumed-from-1", "v3", "v3:tmp-1234abcd"):
        redis_client.hset(KEYS.weights_blob(name), "manifest", b"x")
    assert prune_redis_versions(redis_client, KEYS, loaded=[], newest=3) == []
    # v1:tmp-... is what a trainer killed inside share_weights leaves behind.
    assert sorted(prune_redis_versions(redis_client, KEYS, loaded=[2, 3], newest=3)) == [
        KEYS.weights_blob("v1"), KEYS.weights_blob("v1:tmp-0a1b2c3d")]
    prune_redis_versions(redis_client, KEYS, loaded=[7], newest=3)
    left = sorted(k.decode().removeprefix(KEYS.weights_blob("")) for k in redis_client.keys(f"{KEYS.ns}:weights:*"))
    assert left == ["v3", "v3:tmp-1234abcd"]


def test_a_worker_loads_a_version_announced_over_redis_into_its_engine(tmp_path: Path, redis_server,
                                                                       redis_client: redis.Redis) -> None:
    """The producer's edge for real: the announcement's chunks come out of Redis, the transformers engine checks
    the digest and loads them, and older downloads are removed."""
    model = tiny_versions(tmp_path / "model", tied=False)
    announcement = share_weights(redis_client, Keys.for_exp("frozen_lake_scripted"),
                                 WeightsAnnouncement(1, model.v1.as_uri(), model.v1_digest), chunk_bytes=1 << 16)
    cfg = scripted_config(tmp_path)
    stale = tmp_path / "out" / "weights_downloaded" / "worker-0" / "v0"
    stale.mkdir(parents=True)

    async def body() -> int:
        client = redis.asyncio.Redis.from_url(redis_server.url)
        policy = HFPolicy(model.v0)
        try:
            worker = EnvWorker(cfg, 0, client, policy)
            await worker._load({k.encode(): str(v).encode() for k, v in announcement.fields().items()})
            return policy.version
        finally:
            await policy.close()
            await client.aclose()

    assert asyncio.run(body()) == 1
    assert [p.name for p in stale.parent.iterdir()] == ["v1"]
