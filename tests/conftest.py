"""Shared fixtures: a real Redis-protocol server that the tests start themselves, on a free port."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from rollstream.shared.config import RollstreamConfig, load_config
from rollstream.shared.embedded import EmbeddedRedis

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture
def redis_client(redis_server: EmbeddedRedis) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url, socket_timeout=30)
    client.flushall()  # every test starts from an empty server
    yield client
    client.close()


def scripted_config(tmp_path: Path, *overrides: str) -> RollstreamConfig:
    """A small scripted FrozenLake experiment writing under tmp_path."""
    return load_config(REPO / "configs" / "frozen_lake_scripted.yaml", [
        f"output_dir={tmp_path / 'out'}", "wandb_mode=disabled", "redis.block_ms=200", *overrides,
    ])
