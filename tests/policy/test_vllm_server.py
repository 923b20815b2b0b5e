"""The vllm_server backend: one real `rollstream engine` (vLLM's server, CPU build) on the tied tiny model, a real
Redis, and VLLMServerPolicy as an env-worker uses it.

One engine server for the whole module (its start costs about 2 minutes on 2 cores). Tests run in file order;
the reload test comes last because it moves the server to version 1.
"""

from __future__ import annotations

import asyncio
import http.server
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
import redis
from transformers import AutoTokenizer

from rollstream.producer.policy.base import GenerateRequest, Generation, SamplingParams
from rollstream.producer.policy.vllm_server import EngineUnreachable, VLLMServerPolicy
from rollstream.shared.config import RollstreamConfig, dump_config, load_config
from rollstream.shared.embedded import EmbeddedRedis, free_port
from rollstream.shared.engines import engine_plans
from rollstream.shared.keys import Keys
from rollstream.shared.redis_io import URL_ENV

from .helpers import TinyVersions, banned_tokens, most_common_word, reference_logprobs, top2_replies

T = TypeVar("T")
REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.timeout(600)]
MESSAGES = [
    {"role": "system", "content": "FrozenLake: walk from P to the goal G."},
    {"role": "user", "content": "Turn 1\nState:\nP..\n.O.\n..G\nActions left: 3. Reply in at most 16 tokens."},
]
PARITY_ATOL = 1e-4
START_TIMEOUT_S = 420.0


def server_config(out: Path, pretrain: Path, port: int, *overrides: str) -> RollstreamConfig:
    """The FrozenLake job on engine servers: float32 (parity), eager, a small KV cache on CPU."""
    return load_config(REPO / "configs" / "frozen_lake.yaml", [
        f"output_dir={out}", f"pretrain={pretrain}", "tiny_model.build=false", "wandb_mode=disabled",
        "redis.block_ms=200", "actor_infer.strategy_args.strategy_name=vllm_server",
        f"actor_infer.strategy_args.strategy_config={{gpu_memory_utilization: 0.1, enforce_eager: true, "
        f"base_port: {port}, max_model_len: 1024, startup_timeout_s: {START_TIMEOUT_S}}}",
        *overrides])


def start_engine(cfg: RollstreamConfig, url: str, log: Path) -> subprocess.Popen[bytes]:
    config_path = Path(cfg.output_dir) / "config.yaml"
    dump_config(cfg, config_path)
    with log.open("ab") as out:
        return subprocess.Popen([sys.executable, "-m", "rollstream", "engine", str(config_path), "--engine-rank", "0"],
                                env=os.environ | {URL_ENV: url}, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def stop_engine(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM (the engine kills its server's group), then SIGKILL whatever of the group is left."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def wait_for_beat(client: redis.Redis, keys: Keys, proc: subprocess.Popen[bytes], log: Path,
                  version: int = 0) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while int(client.hget(keys.engine(0), "loaded_version") or -1) < version:
        assert proc.poll() is None, f"the engine exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"engine not serving version {version}:\n{log.read_text()[-3000:]}"
        time.sleep(0.5)


@dataclass
class Server:
    cfg: RollstreamConfig
    proc: subprocess.Popen[bytes]
    client: redis.Redis
    keys: Keys
    policy: VLLMServerPolicy
    loop: asyncio.AbstractEventLoop
    model: TinyVersions
    log: Path

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    def prompt(self) -> np.ndarray:
        return np.asarray(self.policy.prompt_token_ids(GenerateRequest(MESSAGES, SamplingParams(1))), np.int32)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, redis_server: EmbeddedRedis,
           tied_model: TinyVersions) -> Iterator[Server]:
    out = tmp_path_factory.mktemp("engine")
    cfg = server_config(out, tied_model.v0, free_port())
    client = redis.Redis.from_url(redis_server.url, socket_timeout=30)
    client.flushall()
    keys = Keys.for_exp(cfg.exp_name)
    log = out / "engine.log"
    proc = start_engine(cfg, redis_server.url, log)
    loop = asyncio.new_event_loop()
    policy = VLLMServerPolicy(str(tied_model.v0), [p.url for p in engine_plans(cfg)], startup_timeout_s=START_TIMEOUT_S)
    try:
        wait_for_beat(client, keys, proc, log)
        loop.run_until_complete(policy.wait_for_version(0))
        yield Server(cfg, proc, client, keys, policy, loop, tied_model, log)
    finally:
        loop.run_until_complete(policy.close())
        loop.close()
        stop_engine(proc)
        client.close()


def assert_parity(model_dir: Path, prompt: np.ndarray, gen: Generation) -> None:
    ids = np.concatenate([prompt, gen.token_ids])
    positions = np.arange(len(prompt), len(ids))
    ref = reference_logprobs(model_dir, ids, positions)
    np.testing.assert_allclose(gen.logprobs, ref, atol=PARITY_ATOL, rtol=0)


def test_an_engine_unreachable_at_start_is_an_error_naming_its_url() -> None:
    url = f"http://127.0.0.1:{free_port()}"

    async def wait() -> None:
        policy = VLLMServerPolicy(None, [url], startup_timeout_s=1.0)
        try:
            await policy.wait_for_version(0)
        finally:
            await policy.close()

    with pytest.raises(EngineUnreachable, match=url.replace(".", r"\.")):
        asyncio.run(wait())


def test_an_engine_that_answers_garbage_stays_down_until_it_answers_a_version() -> None:
    """The monitor takes any bad answer for "not up yet" and keeps probing: a reply cut short by a kill, or a body
    that is not the JSON object vLLM sends, must neither mark the engine up nor stop the monitor (a stopped monitor
    would leave every turn of the env-worker waiting, silently)."""
    answer = {"body": b"[]"}  # JSON, but not an object: what a half-started or wrong server could send

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"" if self.path == "/health" else answer["body"]
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    stub = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=stub.serve_forever, daemon=True).start()

    async def probe() -> None:
        policy = VLLMServerPolicy(None, [f"http://127.0.0.1:{stub.server_address[1]}"], startup_timeout_s=60.0)
        try:
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(policy.wait_for_version(0), timeout=2.0)
            answer["body"] = b'{"weight_version": "3"}'
            await asyncio.wait_for(policy.wait_for_version(3), timeout=10.0)
            assert policy.version == 3
        finally:
            await policy.close()

    try:
        asyncio.run(probe())
    finally:
        stub.shutdown()
        stub.server_close()


def test_generation_through_the_server_returns_tokens_logprobs_and_version(server: Server) -> None:
    prompt = server.prompt()
    requests = [GenerateRequest([], SamplingParams(16, seed=s), prompt_ids=prompt) for s in range(6)]

    async def all_at_once() -> list[Generation]:
        return list(await asyncio.gather(*(server.policy.generate(r) for r in requests)))

    gens = server.run(all_at_once())
    for gen in gens:
        assert gen.version == 0 and gen.finish_reason in ("stop", "length")
        assert 0 < len(gen.token_ids) <= 16 and len(gen.logprobs) == len(gen.token_ids)
    for gen in gens[:2]:
        assert_parity(server.model.v0, prompt, gen)
    again = server.run(server.policy.generate(requests[0]))
    assert again.token_ids.tolist() == gens[0].token_ids.tolist()  # seeded: the same tokens
    beat = server.client.hgetall(server.keys.engine(0))
    assert beat[b"loaded_version"] == b"0" and beat[b"url"].decode() == engine_plans(server.cfg)[0].url


def test_bad_words_reach_the_server(server: Server) -> None:
    prompt = server.prompt()

    tokenizer = AutoTokenizer.from_pretrained(server.model.v0)  # as the transformers backend loads it
    word = most_common_word(tokenizer, server.run(top2_replies(server.policy.generate, prompt, (), 6)))
    banned = banned_tokens(tokenizer, word)  # vLLM's forms: test_vllm checks it
    for gen in server.run(top2_replies(server.policy.generate, prompt, (word,), 6)):
        assert not banned & set(gen.token_ids.tolist())


def test_a_version_is_reloaded_once_with_its_digest_checked_and_gives_transformers_logprobs(server: Server) -> None:
    keys, client = server.keys, server.client
    client.xadd(keys.weights, {"version": 1, "uri": server.model.v1.as_uri(), "digest": "sha256:" + "0" * 64})
    client.xadd(keys.weights, {"version": 1, "uri": server.model.v1.as_uri(), "digest": server.model.v1_digest})
    wait_for_beat(client, keys, server.proc, server.log, version=1)
    prompt = server.prompt()
    server.run(server.policy.wait_for_version(1))
    gens = [server.run(server.policy.generate(GenerateRequest([], SamplingParams(24, seed=s), prompt_ids=prompt,
                                                              min_version=1))) for s in range(3)]
    assert {g.version for g in gens} == {1}
    for gen in gens:  # the tied LM head re-tied after the reload: the logits come from the new embeddings
        assert_parity(server.model.v1, prompt, gen)
    assert client.hget(keys.engine(0), "reloads") == b"1"  # the refused announcement loaded nothing
    assert "refused weights announcement" in server.log.read_text()
