"""Connecting to Redis: which URL, with which timeouts, how long to wait through an outage, and a clear error
when nobody answers.

Two budgets. At start a process probes the server once, briefly: a wrong URL, password or TLS setting, or a
server that is not there, is one clear line within seconds. Once running, every command rides out an outage
(a Redis restarted, stopped, or at maxmemory) by reconnecting with backoff for up to `redis.max_outage_s`,
then gives up with one clear line; a retried write may duplicate, which the trainer tolerates (it
de-duplicates by trajectory id).
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import redis
import redis.asyncio
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.commands.core import AsyncScript, Script
from redis.connection import HiredisRespSerializer
from redis.exceptions import NoScriptError
from redis.retry import Retry
from redis.utils import HIREDIS_AVAILABLE

if HIREDIS_AVAILABLE:
    import hiredis

from rollstream.shared.config import RedisConfig

log = logging.getLogger(__name__)
T = TypeVar("T")

URL_ENV = "ROLLSTREAM_REDIS_URL"
PROBE_TIMEOUT_S = 5.0
"""How long the start-up probe waits for a connection or an answer."""
CANCEL_AGAIN_S = 0.2
"""How often `cancel_and_wait` cancels a task again that is still running."""


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


# ---- riding out an outage ----

class _Outage:
    """When the current outage began, shared by the sync and async retry policies."""

    def __init__(self, url: str, limit_s: float) -> None:
        self.url = redact(url)
        self.limit_s = limit_s
        self.since: float | None = None

    def failed(self, error: BaseException) -> None:
        if isinstance(error, redis.AuthenticationError):
            raise error  # a refused password does not heal with time
        now = time.monotonic()
        if self.since is None:
            self.since = now
            log.warning("lost Redis at %s (%s: %s); reconnecting for up to %.0f s (redis.max_outage_s)",
                        self.url, type(error).__name__, error, self.limit_s)
        elif now - self.since > self.limit_s:
            raise RedisUnavailable(
                f"Redis at {self.url} unreachable for {now - self.since:.0f} s, more than redis.max_outage_s="
                f"{self.limit_s:g} ({type(error).__name__}: {error}); giving up. Nothing acknowledged is lost: "
                "start the process again once Redis is back") from None

    def succeeded(self) -> None:
        if self.since is not None:
            log.warning("Redis at %s is back after %.1f s", self.url, time.monotonic() - self.since)
            self.since = None


def _backoff() -> ExponentialBackoff:
    return ExponentialBackoff(cap=2.0, base=0.1)  # Redis back -> working again within ~2 s


class OutageRetry(Retry):
    """redis-py's retry with a time budget instead of a count: reconnect with backoff until max_outage_s."""

    def __init__(self, outage: _Outage) -> None:
        super().__init__(_backoff(), -1)
        self.outage = outage

    def call_with_retry(self, do: Callable[[], T], fail: Callable[..., Any], is_retryable: Any = None,
                        with_failure_count: bool = False) -> T:
        failures = 0
        while True:
            try:
                result = do()
            except self._supported_errors as error:
                if is_retryable and not is_retryable(error):
                    raise
                failures += 1
                fail(error, failures) if with_failure_count else fail(error)
                self.outage.failed(error)
                time.sleep(self._backoff.compute(failures))
            else:
                self.outage.succeeded()
                return result


class AsyncOutageRetry(AsyncRetry):
    def __init__(self, outage: _Outage) -> None:
        super().__init__(_backoff(), -1)
        self.outage = outage

    async def call_with_retry(self, do: Callable[[], Awaitable[T]], fail: Callable[..., Any],
                              is_retryable: Any = None, with_failure_count: bool = False) -> T:
        failures = 0
        while True:
            try:
                result = await do()
            except self._supported_errors as error:
                if is_retryable and not is_retryable(error):
                    raise
                failures += 1
                await (fail(error, failures) if with_failure_count else fail(error))
                self.outage.failed(error)
                await asyncio.sleep(self._backoff.compute(failures))
            else:
                self.outage.succeeded()
                return result


def _options(cfg: RedisConfig) -> dict[str, object]:
    return {
        "socket_timeout": cfg.socket_timeout_s,
        "socket_connect_timeout": PROBE_TIMEOUT_S,
        "health_check_interval": 30,
    }


# ---- Lua scripts across restarts ----

class RestartSafeScript(Script):
    """A registered Lua script that survives a Redis restart at any moment.

    redis-py answers NOSCRIPT (a restarted Redis has no scripts) with SCRIPT LOAD, then EVALSHA; a second restart
    between the two fails the call with NOSCRIPT again, which killed a trainer in the fault tests. EVAL carries
    the script's text and loads it in the same command, so nothing can come between. A pipeline's scripts are
    loaded by the pipeline before it runs, as redis-py does."""

    def __call__(self, keys: Any = None, args: Any = None, client: Any = None) -> Any:
        client = self.registered_client if client is None else client
        if isinstance(client, redis.client.Pipeline):
            return super().__call__(keys, args, client)
        keys, args = list(keys or []), list(args or [])
        try:
            return client.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            return client.eval(self.script, len(keys), *keys, *args)


class AsyncRestartSafeScript(AsyncScript):
    """`RestartSafeScript` for an asyncio client."""

    async def __call__(self, keys: Any = None, args: Any = None, client: Any = None) -> Any:
        client = self.registered_client if client is None else client
        if isinstance(client, redis.asyncio.client.Pipeline):
            return await super().__call__(keys, args, client)
        keys, args = list(keys or []), list(args or [])
        try:
            return await client.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            return await client.eval(self.script, len(keys), *keys, *args)


def register_script(client: redis.Redis, script: str) -> RestartSafeScript:
    return RestartSafeScript(client, script)


def register_async_script(client: redis.asyncio.Redis, script: str) -> AsyncRestartSafeScript:
    return AsyncRestartSafeScript(client, script)


# ---- connecting ----

def connect(url: str, cfg: RedisConfig) -> redis.Redis:
    """A client that rides out outages up to redis.max_outage_s, after a quick probe that the URL works."""
    _probe(url)
    retry = OutageRetry(_Outage(url, cfg.max_outage_s))
    return redis.Redis.from_url(url, retry=retry, **_options(cfg))


async def connect_async(url: str, cfg: RedisConfig) -> redis.asyncio.Redis:
    await asyncio.to_thread(_probe, url)
    retry = AsyncOutageRetry(_Outage(url, cfg.max_outage_s))
    # redis-py types an async client's retry as its sync Retry; AsyncOutageRetry is the async policy it expects
    client = redis.asyncio.Redis.from_url(url, retry=retry, **_options(cfg))  # type: ignore[arg-type]
    pack_with_hiredis(client)
    return client


class _HiredisPacking:
    """redis-py's async connections pack commands in Python, its sync ones with hiredis when it is installed; the
    producer packs every trajectory's XADD, and the Python packer was a third of its CPU. Same bytes either way.

    hiredis is handed the arguments as they are; only a command it refuses (a bytearray argument, say) goes
    through redis-py's serializer, which converts every argument first: that conversion, a Python step per
    argument, was half the packing's cost in a profile of the producer's writes (hundreds of arguments a call)."""

    def pack_command(self, *args: Any) -> list[bytes]:
        name = args[0]
        if isinstance(name, str) and " " not in name:  # a two-word name ("CLIENT SETNAME"): redis-py splits it
            try:
                return [hiredis.pack_command(args)]
            except TypeError:
                pass
        return HiredisRespSerializer().pack(*args)


_packing_classes: dict[type, type] = {}


def pack_with_hiredis(client: redis.asyncio.Redis) -> None:
    """Make the connections of an async client pack commands with hiredis (TLS and unix sockets included)."""
    if not HIREDIS_AVAILABLE:
        return
    pool = client.connection_pool
    base = pool.connection_class
    if issubclass(base, _HiredisPacking):
        return
    if base not in _packing_classes:
        _packing_classes[base] = type(f"Hiredis{base.__name__}", (_HiredisPacking, base), {})
    pool.connection_class = _packing_classes[base]


def _probe(url: str) -> None:
    """One PING with short timeouts, no retry; raises RedisUnavailable with one line saying what to check."""
    try:
        client = redis.Redis.from_url(url, socket_timeout=PROBE_TIMEOUT_S, socket_connect_timeout=PROBE_TIMEOUT_S,
                                      retry=Retry(ExponentialBackoff(), 0))
    except ValueError as e:  # redis-py's word for a URL it cannot parse
        raise RedisUnavailable(f"bad Redis URL {redact(url)}: {e}") from None
    try:
        client.ping()
    except redis.AuthenticationError as e:
        raise RedisUnavailable(_refused(url, e)) from None
    except redis.ResponseError as e:
        if "auth" in str(e).lower() or "hello" in str(e).lower():
            raise RedisUnavailable(_refused(url, e)) from None
        raise RedisUnavailable(f"Redis at {redact(url)} answered PING with an error: {e}") from None
    except (redis.ConnectionError, redis.TimeoutError, OSError, ssl.SSLError) as e:
        raise RedisUnavailable(_unreachable(url, e)) from None
    finally:
        client.close()


def _refused(url: str, e: BaseException) -> str:
    detail = str(e)
    if "HELLO must be called" in detail or "NOAUTH" in detail:
        detail = "the server requires a password and the URL gives none"
    return (f"Redis at {redact(url)} refused the credentials ({detail}): check the user and password in the URL "
            "(redis://user:password@host:port/db)")


def _unreachable(url: str, e: BaseException) -> str:
    detail = f"{type(e).__name__}: {e}"
    timed_out = isinstance(e, (redis.TimeoutError, TimeoutError))
    cut = "reset" in detail or "closed" in detail
    if url.startswith("rediss://") and timed_out:
        hint = "no answer to the TLS handshake: if the server speaks plain text, use redis://"
    elif url.startswith("rediss://") and ("SSL" in detail or cut):
        hint = "the TLS handshake failed: check the CA certificate (?ssl_ca_certs=...) and that the port speaks TLS"
    elif timed_out or cut:
        hint = "the server did not answer a plain PING: if that port speaks TLS, use rediss://"
    else:
        hint = "check that the server is running and reachable from this host and the host/port in the URL"
    return (f"cannot reach Redis at {redact(url)} ({detail}). {hint}. The URL comes from ${URL_ENV} if set, else "
            "from redis.url in the config; leave both unset to start an embedded server.")


# ---- stopping tasks that talk to Redis ----

async def cancel_and_wait(tasks: Iterable[asyncio.Future[Any]], timeout_s: float) -> set[asyncio.Future[Any]]:
    """Cancel `tasks` and wait up to `timeout_s` for them to end; returns those still running then.

    redis-py can swallow a cancellation that lands inside a command (redis/redis-py#2028, #2551): the task then
    goes on, and a loop around the command never ends. A task still running is cancelled again every
    CANCEL_AGAIN_S, which lands at its next await."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    pending = {t for t in tasks if not t.done()}
    while pending and (left := deadline - loop.time()) > 0:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=min(CANCEL_AGAIN_S, left))
    return pending


# ---- a full Redis ----

async def write_with_backoff(write: Callable[[], Awaitable[T]], what: str, limit_s: float) -> T:
    """Retry a write that Redis refuses at maxmemory (noeviction) with backoff, for up to `limit_s`: the trainer
    frees memory as it acknowledges and deletes what it trained."""
    since, failures = time.monotonic(), 0
    while True:
        try:
            return await write()
        except redis.OutOfMemoryError:
            failures += 1
            waited = time.monotonic() - since
            if failures == 1:
                log.warning("Redis is at maxmemory: %s waits and retries (up to %.0f s)", what, limit_s)
            if waited > limit_s:
                raise RedisUnavailable(f"Redis stayed at maxmemory for {waited:.0f} s (redis.max_outage_s="
                                       f"{limit_s:g}) while {what}: raise maxmemory or check that the trainer "
                                       "is running and consuming") from None
            await asyncio.sleep(_backoff().compute(failures))


StreamEntries = list[tuple[bytes, dict[bytes, bytes]]]
"""An XRANGE / XREVRANGE reply, or one stream's part of an XREAD reply, as our clients return it (bytes)."""
StreamReplies = list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes] | None]]]]
"""An XREAD / XREADGROUP reply: (stream, entries) per stream; an entry re-read from a consumer's pending list has
fields None when it was deleted since delivery."""


def text(value: bytes | str) -> str:
    """A reply field as text. Our clients keep replies as bytes (payloads are binary); redis-py types a reply
    field as bytes or str, depending on `decode_responses`."""
    return value.decode() if isinstance(value, bytes) else value
