"""Admission under the version cap and the ends of groups, against a real Redis."""

import asyncio

import redis
import redis.asyncio

from rollstream.shared.keys import Keys
from rollstream.shared.ledger import AsyncAdmissions, Ledger, reconciles
from rollstream.shared.messages import WeightsAnnouncement
from rollstream.shared.versioning import admission_cap, is_stale

KEYS = Keys.for_exp("t")


def _admit_all(url: str, prefix: str, n: int, ratio: int = 0, g: int = 2) -> list:
    async def go() -> list:
        client = redis.asyncio.Redis.from_url(url)
        adm = AsyncAdmissions(client, KEYS, groups_per_batch=g, ratio=ratio)
        out = [await adm.admit(prefix) for _ in range(n)]
        await client.aclose()
        return out

    return asyncio.run(go())


def test_cap_admits_exactly_v_plus_r_plus_1_batches(redis_server, redis_client: redis.Redis) -> None:
    results = _admit_all(redis_server.url, "train/A/g0/e", 5, ratio=1, g=2)
    assert [r.episode for r in results] == [0, 1, 2, 3, None]  # (0 + 1 + 1) * 2 = 4 slots
    assert admission_cap(0, 1, 2) == 4
    redis_client.set(KEYS.version, 1)
    assert [r.episode for r in _admit_all(redis_server.url, "train/A/g0/e", 3, ratio=1, g=2)] == [4, 5, None]


def test_returned_slots_are_admitted_again_and_paused_admits_nothing(redis_server, redis_client) -> None:
    ledger = Ledger(redis_client, KEYS)
    first = _admit_all(redis_server.url, "train/A/g0/e", 2, g=1)
    assert [r.episode for r in first] == [0, None]
    assert ledger.finish("train/A/g0/e0", "timeout_dropped", [])
    assert not ledger.finish("train/A/g0/e0", "failed_dropped", [])  # a group ends once
    assert [r.episode for r in _admit_all(redis_server.url, "train/A/g0/e", 1, g=1)] == [1]
    redis_client.set(KEYS.paused, 1)
    paused = _admit_all(redis_server.url, "train/A/g0/e", 1, g=5)[0]
    assert paused.episode is None and not paused.finished  # g=5 leaves room under the cap: the pause refused it
    counts = ledger.counters()
    assert counts == {"admitted": 2, "returned": 1, "timeout_dropped": 1, "in_flight": 1}
    assert reconciles(counts)


def test_commit_step_marks_trained_publishes_and_acks(redis_client) -> None:
    ledger = Ledger(redis_client, KEYS)
    redis_client.xgroup_create(KEYS.traj, "trainer", id="0", mkstream=True)
    ledger.register(["train/A/g0/e0"])
    entry = redis_client.xadd(KEYS.traj, {"x": 1})
    redis_client.xreadgroup("trainer", "c", {KEYS.traj: ">"})
    ledger.commit_step([("train/A/g0/e0", [entry])], WeightsAnnouncement(1, "/w/1", "abc"))
    assert ledger.version() == 1
    assert redis_client.xlen(KEYS.traj) == 0
    assert redis_client.xpending(KEYS.traj, "trainer")["pending"] == 0
    assert redis_client.xrevrange(KEYS.weights, count=1)[0][1][b"uri"] == b"/w/1"
    assert ledger.counters() == {"admitted": 1, "trained": 1, "in_flight": 0}


def test_registering_groups_again_admits_only_the_new_ones(redis_client) -> None:
    """A replayed file registered twice, or a register retried after a lost reply: nothing admitted twice."""
    ledger = Ledger(redis_client, KEYS)
    assert ledger.register(["train/A/g0/e0", "train/A/g1/e0"]) == 2
    assert ledger.register(["train/A/g1/e0", "train/A/g2/e0"]) == 1
    assert ledger.counters() == {"admitted": 3, "in_flight": 3}
    assert reconciles(ledger.counters())


def test_staleness_rule() -> None:
    assert not is_stale(group_version=3, step=4, ratio=1)
    assert is_stale(group_version=2, step=4, ratio=1)
    assert is_stale(group_version=3, step=4, ratio=0)
