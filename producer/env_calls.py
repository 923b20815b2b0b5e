"""Env code off the worker's event loop: reset and step run on a thread, under a time limit.

A worker's envs share one event loop; an env call that runs on it stalls every other env of the worker for
as long as it takes, and one that never returns stalls the worker for good. On a thread the loop keeps
serving the other envs (a CPU-bound Python env still holds the GIL, but yields it every switch interval), and
a call past its limit ends the episode as failed instead of the worker.

The threads are daemon threads of our own: a call that never returns strands its thread, and a
ThreadPoolExecutor's threads (asyncio.to_thread's) are joined at interpreter exit, so one hung env would keep
the worker process from ever exiting.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
_Job = tuple[asyncio.AbstractEventLoop, "asyncio.Future[Any]", Callable[[], Any]]


class EnvStepTimeout(TimeoutError):
    """An env call ran past its limit; its thread is abandoned with the env instance."""


class DaemonThreads:
    """Runs blocking calls on daemon threads, started when none is idle and reused after."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self.started = 0

    def submit(self, call: Callable[[], T]) -> asyncio.Future[T]:
        """`call()` on a thread; its outcome lands in the returned future of the running loop."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        with self._lock:
            if self._idle:
                self._idle -= 1
            else:
                self.started += 1
                threading.Thread(target=self._work, name=f"env-call-{self.started}", daemon=True).start()
        self._jobs.put((loop, future, call))
        return future

    def _work(self) -> None:
        while True:
            loop, future, call = self._jobs.get()
            # Its episode ended while the call waited for a thread: skip it. (A read across threads, but a
            # stale answer only means running a call nobody waits for.)
            if future.cancelled():
                with self._lock:
                    self._idle += 1
                continue
            try:
                outcome: tuple[bool, Any] = (True, call())
            except BaseException as e:  # handed to the awaiting coroutine, which decides
                outcome = (False, e)
            with self._lock:
                self._idle += 1
            try:
                loop.call_soon_threadsafe(_settle, future, outcome)
            except RuntimeError:  # the loop closed while the call ran: nobody is waiting any more
                pass


def _settle(future: asyncio.Future[Any], outcome: tuple[bool, Any]) -> None:
    if future.done():  # timed out or cancelled meanwhile
        return
    ok, value = outcome
    if ok:
        future.set_result(value)
    else:
        future.set_exception(value)


_THREADS = DaemonThreads()


async def call_env(call: Callable[[], T], timeout_s: float | None, what: str) -> T:
    """`call()` on a daemon thread, raising EnvStepTimeout after `timeout_s`; with None, on the loop itself."""
    if timeout_s is None:
        return call()
    future = _THREADS.submit(call)
    # asyncio.wait, not wait_for: on Python < 3.12 wait_for can swallow a cancellation that arrives as the
    # call completes, and a worker's member task would then play on after its shutdown.
    try:
        done, _ = await asyncio.wait({future}, timeout=timeout_s)
    except asyncio.CancelledError:
        future.cancel()
        raise
    if not done:
        future.cancel()
        raise EnvStepTimeout(f"{what} did not return within {timeout_s:g} s")
    return future.result()
