"""The vllm_server backend: env-workers hold no model, only its tokenizer, and send token ids to engine servers.

Each engine is vLLM's OpenAI-compatible server started by `rollstream engine` (producer/engine.py) with
`--enable-scale-out`, whose `/inference/v1/generate` takes prompt token ids and returns the sampled ids, their
logprobs and `weight_versions`: the spans of output tokens and the weight version label that sampled them. The
engine relabels only while paused (pause -> reload -> /update_weight_version -> resume), so a reply with one span
came from one version; a reply spanning two (or labelled below the episode's admission version) is refused and
the turn is asked again.

Routing: least outstanding requests (this process's own) among the engines that are up and serve a version at
least as new as the episode's admission version. A monitor polls each engine's /health and /weight_info; an
engine that fails a request is marked down at once, and the turn raises EngineLost, which ends the episode as
failed (no partial trajectory) while the other engines go on. An engine never seen up within startup_timeout_s
of the start is a clear error naming its URL.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from rollstream.producer.policy.base import GenerateRequest, Generation
from rollstream.producer.policy.conversation import request_prompt_ids

log = logging.getLogger(__name__)

POLL_S = 0.5
"""How often the monitor asks each engine for its health and served version."""
REPLY_RETRIES = 3
"""Turns asked again after a reply that spans two versions or comes from a version below the episode's."""


class EngineLost(RuntimeError):
    """An engine failed a request (killed, crashed, aborted): the episode it was serving ends as failed."""


class EngineUnreachable(RuntimeError):
    """An engine was never reachable within startup_timeout_s: the deployment is wrong, not the engine slow."""


def served_version(label: object) -> int | None:
    """The integer version a label stands for; None for vLLM's "default" (an engine not yet labelled)."""
    try:
        return int(str(label))
    except ValueError:
        return None


class EngineClient:
    """The HTTP endpoints rollstream uses on one vLLM server (the RL ones need VLLM_SERVER_DEV_MODE=1)."""

    def __init__(self, url: str, client: httpx.AsyncClient) -> None:
        self.url = url.rstrip("/")
        self.http = client

    async def healthy(self) -> bool:
        try:
            return (await self.http.get(f"{self.url}/health", timeout=5.0)).status_code == 200
        except httpx.HTTPError:
            return False

    async def version(self) -> int | None:
        reply = await self.http.get(f"{self.url}/weight_info", timeout=5.0)
        reply.raise_for_status()
        return served_version(reply.json().get("weight_version"))

    async def generate(self, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        reply = await self.http.post(f"{self.url}/inference/v1/generate", json=body, timeout=timeout_s)
        reply.raise_for_status()
        result: dict[str, Any] = reply.json()
        return result

    async def reload(self, version: int, weights_path: str, timeout_s: float) -> None:
        """Drain in-flight requests (they finish on the old weights), reload in place (re-tying a tied LM head),
        relabel, resume. Requests arriving meanwhile queue in the server and run on the new version."""
        await self._post("/pause", params={"mode": "wait", "clear_cache": "true"}, timeout=timeout_s)
        await self._post("/collective_rpc", json={"method": "reload_weights_and_retie",
                                                  "kwargs": {"weights_path": weights_path}, "timeout": timeout_s},
                         timeout=timeout_s)
        await self.set_version(version)
        await self._post("/resume", timeout=30.0)

    async def set_version(self, version: int) -> None:
        await self._post("/update_weight_version", json={"new_version": str(version)}, timeout=30.0)

    async def _post(self, path: str, **kwargs: Any) -> None:
        reply = await self.http.post(f"{self.url}{path}", **kwargs)
        if reply.status_code != 200:
            raise RuntimeError(f"{self.url}{path}: HTTP {reply.status_code}: {reply.text[:300]}")


@dataclass
class _Engine:
    client: EngineClient
    up: bool = False
    version: int | None = None
    outstanding: int = 0
    seen_up: bool = False
    failures: int = 0
    """Requests it failed: a probe begun before one must not mark it up again with what it saw before."""

    def serves(self, min_version: int) -> bool:
        return self.up and self.version is not None and self.version >= min_version


@dataclass
class _Monitor:
    task: asyncio.Task[None] | None = None
    started: float = field(default_factory=time.monotonic)
    changed: asyncio.Event = field(default_factory=asyncio.Event)


class VLLMServerPolicy:
    """A Policy whose generations come from engine servers over HTTP."""

    loads_weights = False
    """The engines follow the weights stream themselves; the env-worker only waits for them (wait_for_version)."""

    def __init__(self, model_dir: str | None, urls: Sequence[str], *, startup_timeout_s: float = 600.0,
                 request_timeout_s: float = 600.0, max_connections: int = 1024) -> None:
        """`model_dir` gives the tokenizer (for the chat template); None: requests must carry prompt_ids."""
        if not urls:
            raise ValueError("VLLMServerPolicy needs at least one engine URL")
        self.tokenizer: Any = None
        if model_dir is not None:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        # httpx's default pool of 100 would queue an env-worker's concurrent turns inside the client
        self.http = httpx.AsyncClient(limits=httpx.Limits(max_connections=max_connections * len(urls),
                                                          max_keepalive_connections=max_connections))
        self.engines = [_Engine(EngineClient(u, self.http)) for u in urls]
        self.startup_timeout_s = startup_timeout_s
        self.request_timeout_s = request_timeout_s
        self._monitor = _Monitor()
        self._ids = itertools.count()
        self.refused_replies = 0
        """Replies refused because they spanned two versions or came from one below the episode's."""

    # ---- Policy ----

    @property
    def version(self) -> int:
        """The newest version an engine that is up serves (what admission waits for)."""
        return max((e.version for e in self.engines if e.up and e.version is not None), default=0)

    async def load_weights(self, version: int, uri: str, digest: str) -> None:
        """Nothing to load here: each engine loads every version itself (`rollstream engine`)."""

    async def wait_for_version(self, version: int, stop: asyncio.Event | None = None) -> None:
        """Until some engine that is up serves `version` or newer (or `stop` is set)."""
        self._ensure_monitor()
        while not any(e.serves(version) for e in self.engines) and not (stop is not None and stop.is_set()):
            self._raise_fatal()
            self._monitor.changed.clear()
            try:
                await asyncio.wait_for(self._monitor.changed.wait(), timeout=POLL_S * 4)
            except asyncio.TimeoutError:
                pass
        self._raise_fatal()

    def prompt_token_ids(self, request: GenerateRequest) -> list[int]:
        return request_prompt_ids(self.tokenizer, request)

    async def generate(self, request: GenerateRequest) -> Generation:
        s = request.sampling
        body: dict[str, Any] = {
            "token_ids": self.prompt_token_ids(request),
            "sampling_params": {"max_tokens": s.max_tokens, "temperature": s.temperature, "top_p": s.top_p,
                                "top_k": max(s.top_k, 0), "seed": s.seed, "logprobs": 0,
                                # the text is decoded here: the server's process shares the CPU with the engine
                                "detokenize": False},
        }
        if s.bad_words:
            body["sampling_params"]["bad_words"] = list(s.bad_words)
        for _ in range(REPLY_RETRIES + 1):
            await self.wait_for_version(request.min_version)
            engine = self._pick(request.min_version)
            body["request_id"] = f"r{next(self._ids)}"
            engine.outstanding += 1
            try:
                reply = await engine.client.generate(body, self.request_timeout_s)
            except httpx.HTTPStatusError as e:
                if e.response.status_code < 500:  # this request is wrong (e.g. too long), not the engine
                    raise RuntimeError(f"engine {engine.client.url} refused a request: HTTP "
                                       f"{e.response.status_code}: {e.response.text[:300]}") from None
                self._mark_down(engine, e)
                raise EngineLost(f"engine {engine.client.url} failed a request: HTTP {e.response.status_code}") from e
            except (httpx.HTTPError, ValueError) as e:  # killed, crashed, or not a JSON reply
                self._mark_down(engine, e)
                raise EngineLost(f"engine {engine.client.url} failed a request: {type(e).__name__}: {e}") from e
            finally:
                engine.outstanding -= 1
            generation = self._generation(engine, reply, request.min_version)
            if generation is not None:
                return generation
            self.refused_replies += 1
        raise EngineLost(f"{REPLY_RETRIES + 1} replies in a row spanned two weight versions or came from one below "
                         f"version {request.min_version}")

    async def close(self) -> None:
        task, self._monitor.task = self._monitor.task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await self.http.aclose()

    # ---- routing and replies ----

    def _pick(self, min_version: int) -> _Engine:
        ready = [e for e in self.engines if e.serves(min_version)]
        fewest = min(e.outstanding for e in ready)
        return random.choice([e for e in ready if e.outstanding == fewest])

    def _generation(self, engine: _Engine, reply: dict[str, Any], min_version: int) -> Generation | None:
        choice = reply["choices"][0]
        if choice.get("finish_reason") == "abort":  # partial tokens of an aborted request are no reply
            self._mark_down(engine, RuntimeError("request aborted"))
            raise EngineLost(f"engine {engine.client.url} aborted a request")
        spans = choice.get("weight_versions") or []
        token_ids = [int(t) for t in choice.get("token_ids") or []]
        labels = {served_version(span["version"]) for span in spans}
        if len(labels) != 1 or None in labels:
            if not token_ids:  # no output tokens, no span: the version is the engine's
                labels = {engine.version}
            else:
                log.warning("engine %s: reply spans versions %s; asking again", engine.client.url, spans)
                return None
        version = labels.pop()
        if version is None or version < min_version:
            return None
        content = (choice.get("logprobs") or {}).get("content") or []
        if len(content) != len(token_ids):
            raise RuntimeError(f"engine {engine.client.url} returned {len(content)} logprobs for {len(token_ids)} "
                               "tokens; the trainer needs every one")
        logprobs = []
        for token, entry in zip(token_ids, content):
            if int(entry["token_id"]) != token:
                raise RuntimeError(f"engine {engine.client.url}: logprob of token {entry['token_id']} where "
                                   f"{token} was sampled")
            logprobs.append(float(entry["logprob"]))
        return Generation(
            text=self.tokenizer.decode(token_ids, skip_special_tokens=True) if self.tokenizer is not None else "",
            token_ids=np.asarray(token_ids, np.int32),
            logprobs=np.asarray(logprobs, np.float32),
            finish_reason=choice.get("finish_reason") or "stop",
            version=version,
        )

    # ---- the monitor ----

    def _ensure_monitor(self) -> None:
        if self._monitor.task is None:
            self._monitor.task = asyncio.create_task(self._watch(), name="engine-monitor")

    def _raise_fatal(self) -> None:
        """The monitor's end, raised: EngineUnreachable, or whatever else stopped it (a monitor that stopped would
        otherwise leave every turn waiting, silently)."""
        task = self._monitor.task
        if task is None or not task.done():
            return
        error = None if task.cancelled() else task.exception()
        if isinstance(error, EngineUnreachable):
            raise error
        raise RuntimeError("the engine monitor stopped; no engine can be marked up again") from error

    def _mark_down(self, engine: _Engine, error: BaseException) -> None:
        if engine.up:
            log.warning("engine %s is down (%s: %s): sending to the others until it is back", engine.client.url,
                        type(error).__name__, error)
        engine.up = False
        engine.failures += 1
        self._monitor.changed.set()

    async def _watch(self) -> None:
        while True:
            await asyncio.gather(*(self._probe(e) for e in self.engines))
            self._monitor.changed.set()
            waited = time.monotonic() - self._monitor.started
            never = [e.client.url for e in self.engines if not e.seen_up]
            if never and waited > self.startup_timeout_s:
                raise EngineUnreachable(
                    f"engine server {never[0]} unreachable for {waited:.0f} s since this env-worker started "
                    "(actor_infer.strategy_args.strategy_config.startup_timeout_s): is `rollstream engine` running "
                    "there, and does strategy_config.urls/base_port name it?")
            await asyncio.sleep(POLL_S)

    async def _probe(self, engine: _Engine) -> None:
        failures = engine.failures
        up = await engine.client.healthy()
        version = None
        if up:
            try:
                version = await engine.client.version()
            except Exception:  # any answer but a version (a reply cut by a kill, not JSON, ...): not up yet
                up = False
        if engine.failures != failures:  # a request failed while this probe waited: its answers are stale
            return
        if up and not engine.up:
            log.info("engine %s is up, serving version %s", engine.client.url, version)
        engine.up, engine.version = up, version
        engine.seen_up |= up
