"""An env whose step hangs: its episode fails within custom_envs.<tag>.step_timeout_s, the worker goes on."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import redis.asyncio

from rollstream.consumer.data.batcher import Batcher
from rollstream.producer.env_calls import EnvStepTimeout, call_env
from rollstream.producer.policy.scripted import ScriptedPolicy
from rollstream.producer.worker import EnvWorker
from rollstream.shared.codec import decode_entry
from rollstream.shared.envs.frozen_lake import FrozenLakeEnv
from rollstream.shared.keys import Keys
from rollstream.shared.ledger import reconciles
from rollstream.shared.schema import GroupDropNotice, Trajectory
from tests.conftest import scripted_config

RELEASE = threading.Event()
"""Hung steps wait on this; set at the end of each test so no thread outlives it."""
HUNG: list[int] = []


class HangingLake(FrozenLakeEnv):
    """FrozenLake whose episodes with an even seed hang in their second step (a user's env stuck on I/O)."""

    def _new_episode(self, seed: int) -> None:
        self._seed = seed
        super()._new_episode(seed)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self._seed % 2 == 0 and self._turn == 1:
            HUNG.append(self._seed)
            RELEASE.wait()
        return super().step(action)


@pytest.fixture(autouse=True)
def release_hung_steps():
    RELEASE.clear()
    HUNG.clear()
    yield
    RELEASE.set()


def test_a_hanging_env_step_drops_its_group_and_the_worker_goes_on(tmp_path, redis_server, redis_client) -> None:
    cfg = scripted_config(tmp_path, "exp_name=hang", "async_generation_ratio=1000",
                          "train_env_manager.tags=[FrozenLake]", "train_env_manager.num_groups_partition=null",
                          "train_env_manager.num_env_groups=2", "train_env_manager.group_size=2",
                          "rollout_batch_size=4", "train_env_manager.max_env_num_per_worker=4",
                          "custom_envs.FrozenLake.max_actions_per_traj=4",
                          f"custom_envs.FrozenLake.env_type={__name__}:HangingLake",
                          "custom_envs.FrozenLake.step_timeout_s=0.3")

    async def burst() -> EnvWorker:
        client = redis.asyncio.Redis.from_url(redis_server.url)
        # Every reply invalid: no episode ends before its second step, so the even seeds always hang.
        worker = EnvWorker(cfg, 0, client, ScriptedPolicy(invalid_reply_rate=1.0), episodes_per_group=4)
        await worker.run()
        await client.aclose()
        return worker

    worker = asyncio.run(burst())
    assert HUNG and not RELEASE.is_set()  # the burst ended while hung steps were still blocked
    items = [decode_entry(f) for _, f in redis_client.xrange(Keys.for_exp("hang").traj)]
    failed = {i.group_id for i in items if isinstance(i, GroupDropNotice)}
    played = {i.group_id for i in items if isinstance(i, Trajectory)}
    assert failed and played and not failed & played
    for notice in (i for i in items if isinstance(i, GroupDropNotice)):
        assert notice.reason == "error" and "EnvStepTimeout" in notice.detail
        assert "FrozenLake env's step 2" in notice.detail and "custom_envs.FrozenLake.step_timeout_s" in notice.detail
    assert len(failed) + len(played) == 2 * 4  # every episode of every group ended, one way or the other
    assert worker.stats.errors["FrozenLake"] >= len(failed)

    batcher = Batcher(redis_client, cfg)
    batcher.next_batch(0, timeout_s=1.0)
    counts = batcher.ledger.counters()
    assert counts["failed_dropped"] == len(failed) and counts["returned"] == len(failed)  # slots back
    assert reconciles(counts)


def test_env_calls_run_off_the_loop_and_return_their_result_or_error() -> None:
    def boom() -> None:
        raise ValueError("bad action")

    async def go() -> None:
        assert await call_env(threading.get_ident, 5.0, "x") != threading.get_ident()
        assert await call_env(threading.get_ident, None, "x") == threading.get_ident()
        with pytest.raises(ValueError, match="bad action"):
            await call_env(boom, 5.0, "x")
        with pytest.raises(EnvStepTimeout, match="the hung step did not return within 0.05 s"):
            await call_env(RELEASE.wait, 0.05, "the hung step")

    asyncio.run(go())
