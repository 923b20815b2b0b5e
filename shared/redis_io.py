"""Connecting to Redis: which URL, with which timeouts, and a clear error when nobody answers."""

from __future__ import annotations

import os
from urllib.parse import urlsplit, urlunsplit

import redis
import redis.asyncio
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from rollstream.shared.config import RedisConfig

URL_ENV = "ROLLSTREAM_REDIS_URL"


class RedisUnavailable(RuntimeError):
    """Redis could not be reached; the message names the URL and what to check."""


class RedisDataLost(RuntimeError):
    """Redis no longer holds writes it acknowledged (a restart that lost its AOF tail, a server that came back
    empty): the ledger cannot vouch for what was trained, so the process stops; the message says how to resume."""


RESUME_HINT = ("the ledger in Redis can no longer vouch for which groups were trained. Start over with `rollstream "
               "run --fresh` (with resume_from_checkpoint to keep the model), and run Redis with appendfsync always")


def resolve_url(cfg: RedisConfig) -> str | None:
    """ROLLSTREAM_REDIS_URL wins over redis.url; None means "start an embedded server"."""
    return os.environ.get(URL_ENV) or cfg.url


def redact(url: str) -> str:
    """The URL with its password hidden, for messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
    return urlunsplit(parts._replace(netloc=netloc))


def _options(cfg: RedisConfig) -> dict[str, object]:
    # A few bounded retries at this edge only; a retried XADD may duplicate, which the trainer
    # tolerates (it de-duplicates by trajectory id).
    return {
        "socket_timeout": cfg.socket_timeout_s,
        "socket_connect_timeout": 5.0,
        "health_check_interval": 30,
        "retry": Retry(ExponentialBackoff(cap=2.0, base=0.1), retries=5),
    }


def connect(url: str, cfg: RedisConfig) -> redis.Redis:
    client = redis.Redis.from_url(url, **_options(cfg))  # type: ignore[arg-type]
    try:
        client.ping()
    except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
        client.close()
        raise RedisUnavailable(_unreachable(url, e)) from None
    except redis.AuthenticationError as e:
        raise RedisUnavailable(f"Redis at {redact(url)} refused the credentials: {e}") from None
    return client


async def connect_async(url: str, cfg: RedisConfig) -> redis.asyncio.Redis:
    from redis.asyncio.retry import Retry as AsyncRetry

    options = _options(cfg) | {"retry": AsyncRetry(ExponentialBackoff(cap=2.0, base=0.1), retries=5)}
    client = redis.asyncio.Redis.from_url(url, **options)  # type: ignore[arg-type]
    try:
        await client.ping()
    except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
        await client.aclose()
        raise RedisUnavailable(_unreachable(url, e)) from None
    return client


def _unreachable(url: str, e: BaseException) -> str:
    return (
        f"cannot reach Redis at {redact(url)} ({type(e).__name__}: {e}). Check that the server is running "
        f"and reachable from this host, the host/port/password in the URL, and for TLS use rediss://. "
        f"The URL comes from ${URL_ENV} if set, else from redis.url in the config; "
        "leave both unset to start an embedded server."
    )
