"""`--fresh` deletes exactly its own experiment's keys, with commands an ACL user without @dangerous may run."""

from __future__ import annotations

from pathlib import Path

import redis

from rollstream.launch import delete_namespace
from rollstream.shared.keys import Keys
from tests.faults.conftest import FaultRedis


def _fill(client: redis.Redis, exp: str, n: int = 3) -> None:
    keys = Keys.for_exp(exp)
    client.set(keys.version, 1)
    client.xadd(keys.traj, {"kind": "traj"})
    for rank in range(n):
        client.hset(keys.worker(rank), "rank", rank)


def test_fresh_deletes_only_its_own_namespace(fault_redis: FaultRedis) -> None:
    client = fault_redis.client()
    for exp in ("prod", "prodexp", "prod*", "pro", "p[r]od"):
        _fill(client, exp)
    client.set("rollstream:prod", "not in the namespace either")
    for _ in range(2000):  # enough keys that SCAN needs several rounds
        client.set(f"unrelated:{_}", 1)

    assert delete_namespace(client, Keys.for_exp("prod*")) == 5
    assert delete_namespace(client, Keys.for_exp("p[r]od")) == 5
    assert delete_namespace(client, Keys.for_exp("prod")) == 5
    left = {k.decode().rsplit(":", 2)[0] for k in client.scan_iter(match="rollstream:*")}
    assert left == {"rollstream:prodexp", "rollstream:pro", "rollstream"}, left
    assert client.exists("rollstream:prod")


def test_fresh_works_for_an_acl_user_without_dangerous_commands(fault_redis: FaultRedis, tmp_path: Path) -> None:
    admin = fault_redis.client()
    admin.acl_setuser("runner", enabled=True, passwords=["+pw"], keys=["rollstream:*"],
                      commands=["+@all", "-@dangerous"])
    _fill(admin, "exp")
    runner = redis.Redis(port=fault_redis.port, username="runner", password="pw")
    assert delete_namespace(runner, Keys.for_exp("exp")) == 5
    assert not admin.exists(Keys.for_exp("exp").version)
