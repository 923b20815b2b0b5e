"""A worker following the weights stream refuses what it cannot trust, keeps its weights, and goes on."""

from __future__ import annotations

import asyncio
from pathlib import Path

from rollstream.producer.policy.scripted import ScriptedPolicy
from rollstream.producer.worker import EnvWorker
from rollstream.shared.keys import Keys
from rollstream.shared.redis_io import connect_async
from rollstream.shared.weights_io import compute_digest, verify_digest, weights_path_from_uri
from tests.conftest import scripted_config
from tests.faults.conftest import FaultRedis


class CheckingPolicy(ScriptedPolicy):
    """The scripted policy, checking the announced digest as the LLM backends do before loading."""

    async def load_weights(self, version: int, uri: str, digest: str) -> None:
        verify_digest(weights_path_from_uri(uri), digest)
        await super().load_weights(version, uri, digest)


def _weights_dir(root: Path, name: str) -> Path:
    path = root / name
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(name.encode() * 100)
    return path


def test_bad_announcements_are_refused_counted_and_a_later_version_loads(fault_redis: FaultRedis, tmp_path) -> None:
    cfg = scripted_config(tmp_path, "exp_name=faults", "redis.heartbeat_s=0.1",
                          "train_env_manager.max_env_num_per_worker=64")
    keys = Keys.for_exp("faults")
    v1, v2 = _weights_dir(tmp_path, "v1"), _weights_dir(tmp_path, "v2")
    direct = fault_redis.client()

    async def heartbeat_errors() -> int:
        return int(direct.hget(keys.worker(0), "errors") or 0)

    async def until(condition, what: str) -> None:
        for _ in range(300):
            if await condition():
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}")

    async def main() -> None:
        client = await connect_async(fault_redis.url, cfg.redis)
        worker = EnvWorker(cfg, 0, client, CheckingPolicy())
        run = asyncio.create_task(worker.run())
        try:
            await until(heartbeat_errors_is(0), "the first heartbeat")
            direct.xadd(keys.weights, {"version": 1, "uri": v1.as_uri(), "digest": compute_digest(v2)})
            await until(heartbeat_errors_is(1), "the corrupt version counted")
            direct.xadd(keys.weights, {"version": "abc", "uri": v1.as_uri(), "digest": "x"})
            await until(heartbeat_errors_is(2), "the unparsable announcement counted")
            direct.xadd(keys.control, {"kind": "val", "round": "x", "version": "y"})  # fuzzed control message
            await until(heartbeat_errors_is(3), "the bad control message counted")
            assert worker.policy.version == 0 and not run.done()  # the old weights stay
            direct.xadd(keys.weights, {"version": 2, "uri": v2.as_uri(), "digest": compute_digest(v2)})
            await until(lambda: _true(worker.policy.version == 2), "version 2 loaded")
        finally:
            worker.request_stop()
            await run
            await client.aclose()

    def heartbeat_errors_is(n: int):
        async def check() -> bool:
            return direct.exists(keys.worker(0)) and await heartbeat_errors() == n
        return check

    asyncio.run(main())


async def _true(value: bool) -> bool:
    return value
