"""The trainer's reading side against a real Redis: restarts, duplicates, garbage, drops and timeouts."""

from pathlib import Path

import redis

from rollstream.consumer.data.batcher import Batcher
from rollstream.consumer.data.reader import StreamReader
from rollstream.shared.codec import encode_drop, encode_trajectory
from rollstream.shared.keys import TRAINER_CONSUMER, Keys
from rollstream.shared.ledger import Ledger, reconciles
from rollstream.shared.messages import WeightsAnnouncement
from rollstream.shared.schema import GroupDropNotice
from tests.conftest import scripted_config
from tests.factories import make_traj

GROUP_SIZE = 2


def _cfg(tmp_path: Path, *extra: str):
    # G = 2 groups of 2 per batch
    return scripted_config(tmp_path, "exp_name=b", "rollout_batch_size=4", "train_env_manager.group_size=2",
                           "train_env_manager.max_env_num_per_worker=4", *extra)


def _write_groups(client: redis.Redis, groups: list[int], *, version: int = 0, members=range(GROUP_SIZE),
                  scores: tuple[float, ...] = (1.0,) * GROUP_SIZE) -> None:
    keys = Keys.for_exp("b")
    Ledger(client, keys).register([make_traj(g, 0, 0).group_id for g in groups])
    for g in groups:
        for m in members:
            client.xadd(keys.traj, encode_trajectory(make_traj(g, 0, m, version=version, score=scores[m])))


def test_restart_rereads_pending_so_nothing_is_lost_or_used_twice(tmp_path, redis_client) -> None:
    cfg = _cfg(tmp_path)
    _write_groups(redis_client, [0, 1, 2, 3])
    crashed = Batcher(redis_client, cfg, consumer=TRAINER_CONSUMER)
    first = crashed.next_batch(0, timeout_s=5)  # read and assembled, then "crash" before commit
    assert first is not None
    assert redis_client.xpending(Keys.for_exp("b").traj, "trainer")["pending"] == 8

    restarted = Batcher(redis_client, cfg, consumer=TRAINER_CONSUMER)
    again = restarted.next_batch(0, timeout_s=5)
    assert [g.group_id for g in again.groups] == [g.group_id for g in first.groups]
    restarted.commit(again, WeightsAnnouncement(1))
    rest = restarted.next_batch(1, timeout_s=5)
    restarted.commit(rest, WeightsAnnouncement(2))
    used = [g.group_id for g in again.groups + rest.groups]
    assert sorted(used) == sorted({*used}) and len(used) == 4
    assert redis_client.xlen(Keys.for_exp("b").traj) == 0
    assert restarted.ledger.counters() == {"admitted": 4, "trained": 4, "in_flight": 0}


def test_duplicated_xadds_are_dropped_by_trajectory_id(tmp_path, redis_client) -> None:
    cfg = _cfg(tmp_path)
    _write_groups(redis_client, [0, 1])
    _write_groups(redis_client, [0], members=[1])  # a client retry wrote member 1 twice
    batcher = Batcher(redis_client, cfg)
    batch = batcher.next_batch(0, timeout_s=5)
    assert sorted(t.traj_id for t in batch.trajectories) == sorted({t.traj_id for t in batch.trajectories})
    batcher.commit(batch, WeightsAnnouncement(1))
    assert redis_client.xlen(Keys.for_exp("b").traj) == 0  # the copy was acked with its group

    redis_client.xadd(Keys.for_exp("b").traj, encode_trajectory(make_traj(0, 0, 0)))  # a late copy
    assert batcher.next_batch(1, timeout_s=0.5) is None
    assert batcher.ledger.counters()["orphan_entries"] == 1
    assert redis_client.xlen(Keys.for_exp("b").traj) == 0


def test_undecodable_entries_go_to_the_dead_letter_stream(tmp_path, redis_client) -> None:
    cfg = _cfg(tmp_path)
    keys = Keys.for_exp("b")
    redis_client.xadd(keys.traj, {"payload": b"\x93garbage"})
    redis_client.xadd(keys.traj, {"hello": "world"})
    _write_groups(redis_client, [0, 1])
    batch = Batcher(redis_client, cfg).next_batch(0, timeout_s=5)
    assert len(batch.groups) == 2
    dead = redis_client.xrange(keys.dead)
    assert len(dead) == 2
    assert b"not valid msgpack" in dead[0][1][b"reason"] and dead[0][1][b"orig:payload"] == b"\x93garbage"
    assert b"no binary 'payload'" in dead[1][1][b"reason"]


def test_a_dead_letter_or_an_orphan_ack_sent_twice_counts_once(tmp_path, redis_client) -> None:
    """What redis-py does after a lost reply (a dropped connection): the same call again."""
    keys = Keys.for_exp("b")
    bad, late = redis_client.xadd(keys.traj, {"hello": "world"}), redis_client.xadd(keys.traj, {"x": "y"})
    batcher = Batcher(redis_client, _cfg(tmp_path))
    for _ in range(2):
        batcher.reader.dead_letter(bad, {b"hello": b"world"}, "no payload")
        batcher.ledger.ack_orphans([late])
    assert redis_client.xlen(keys.dead) == 1 and redis_client.xlen(keys.traj) == 0
    counters = batcher.ledger.counters()
    assert (counters["dead_letters"], counters["orphan_entries"]) == (1, 1)


def test_drop_notice_ends_the_group_and_returns_its_slot(tmp_path, redis_client) -> None:
    cfg = _cfg(tmp_path)
    keys = Keys.for_exp("b")
    _write_groups(redis_client, [0], members=[0])
    redis_client.xadd(keys.traj, encode_drop(GroupDropNotice(make_traj(0).group_id, "error", "boom", 0)))
    _write_groups(redis_client, [0], members=[1])  # a member that finished after the failure
    batcher = Batcher(redis_client, cfg)
    assert batcher.next_batch(0, timeout_s=0.5) is None
    counts = batcher.ledger.counters()
    assert counts["failed_dropped"] == 1 and counts["returned"] == 1 and reconciles(counts)
    assert redis_client.xlen(keys.traj) == 0


def test_incomplete_groups_time_out_and_complete_ones_do_not(tmp_path, redis_client) -> None:
    cfg = _cfg(tmp_path, "group_timeout_s=0.2")
    _write_groups(redis_client, [0], members=[0])  # its producer died
    _write_groups(redis_client, [1])
    batcher = Batcher(redis_client, cfg)
    assert batcher.next_batch(0, timeout_s=1.0) is None
    counts = batcher.ledger.counters()
    assert counts["timeout_dropped"] == 1 and counts["in_flight"] == 1
    assert batcher.assembler.is_complete(make_traj(1).group_id)


def test_stale_groups_are_dropped_and_counted(tmp_path, redis_client) -> None:
    cfg = _cfg(tmp_path, "async_generation_ratio=1")
    _write_groups(redis_client, [0, 1], version=0)
    _write_groups(redis_client, [2, 3], version=2)
    batch = Batcher(redis_client, cfg).next_batch(3, timeout_s=5)  # step 3, r=1: versions >= 2 only
    assert {g.group_id for g in batch.groups} == {make_traj(2).group_id, make_traj(3).group_id}
    assert batch.dropped["stale_dropped"] == 2


def test_the_commit_reads_the_next_entries_in_its_round_trip(tmp_path, redis_client) -> None:
    cfg = _cfg(tmp_path, "redis.read_count=4")  # one read holds one batch
    _write_groups(redis_client, [0, 1, 2, 3])
    batcher = Batcher(redis_client, cfg)
    first = batcher.next_batch(0, timeout_s=5)
    assert first is not None and not batcher.assembler.ready
    batcher.commit(first, WeightsAnnouncement(1))
    assert len(batcher.assembler.ready) == 2  # read with the commit: the next batch is in hand already
    second = batcher.next_batch(1, timeout_s=5)
    batcher.commit(second, WeightsAnnouncement(2))
    assert sorted(g.group_id for g in first.groups + second.groups) == [make_traj(g).group_id for g in range(4)]
    assert redis_client.xlen(Keys.for_exp("b").traj) == 0
    assert batcher.ledger.counters() == {"admitted": 4, "trained": 4, "in_flight": 0}


def test_entries_of_a_read_ahead_whose_reply_was_lost_are_read_again(tmp_path, redis_client) -> None:
    cfg = _cfg(tmp_path, "redis.read_count=4")
    _write_groups(redis_client, [0])
    batcher = Batcher(redis_client, cfg)
    with redis_client.pipeline(transaction=False) as pipe:
        assert batcher.reader.read_ahead(pipe) is False  # still re-reading its own pending entries: no read-ahead
    assert batcher.next_batch(0, timeout_s=0.5) is None  # one group of the two a batch needs
    _write_groups(redis_client, [1])
    with redis_client.pipeline(transaction=False) as pipe:
        assert batcher.reader.read_ahead(pipe)
        pipe.execute()  # delivered to this consumer, and the reply dropped as a lost connection would
    batch = batcher.next_batch(0, timeout_s=10)  # the stranded-entries check finds them within seconds
    assert batch is not None and sorted(g.group_id for g in batch.groups) == [make_traj(g).group_id for g in (0, 1)]
    batcher.commit(batch, WeightsAnnouncement(1))
    assert redis_client.xlen(Keys.for_exp("b").traj) == 0


def test_the_group_filter_drops_groups_without_advantage_and_returns_their_slots(tmp_path, redis_client) -> None:
    cfg = _cfg(tmp_path, "train_env_manager.group_filter_cls=no_advantage")
    keys = Keys.for_exp("b")
    _write_groups(redis_client, [0])  # every member scored 1.0: nothing to learn
    _write_groups(redis_client, [1], scores=(0.0, 0.0))  # nor here
    _write_groups(redis_client, [2, 3], scores=(0.0, 1.0))
    batcher = Batcher(redis_client, cfg)
    batch = batcher.next_batch(0, timeout_s=5)
    assert {g.group_id for g in batch.groups} == {make_traj(2).group_id, make_traj(3).group_id}
    assert batch.dropped["filtered_dropped"] == 2 and batch.dropped["filtered_all_success"] == 1
    counts = batcher.ledger.counters()
    assert counts["filtered_dropped"] == 2 and counts["returned"] == 2 and reconciles(counts)
    assert redis_client.xlen(keys.traj) == 4  # the filtered groups' entries are acked and deleted

    redis_client.xadd(keys.traj, encode_trajectory(make_traj(0, 0, 1)))  # a late copy of a filtered member
    batcher.commit(batch, WeightsAnnouncement(1))
    assert batcher.next_batch(1, timeout_s=0.5) is None
    counts = batcher.ledger.counters()
    assert counts["trained"] == 2 and counts["orphan_entries"] == 1 and reconciles(counts)
    assert redis_client.xlen(keys.traj) == 0


def test_the_group_filter_lets_groups_through_past_its_limit(tmp_path, redis_client) -> None:
    """group_filter_max_batches=1 with 2 groups per batch: two groups filtered, then the batch fills unfiltered."""
    cfg = _cfg(tmp_path, "train_env_manager.group_filter_cls=no_advantage",
               "train_env_manager.group_filter_max_batches=1")
    _write_groups(redis_client, [0, 1, 2, 3, 4, 5])
    batcher = Batcher(redis_client, cfg)
    batch = batcher.next_batch(0, timeout_s=5)
    assert {g.group_id for g in batch.groups} == {make_traj(2).group_id, make_traj(3).group_id}
    assert batch.dropped["filtered_dropped"] == 2 and batch.dropped["filter_bypassed"] == 2
    batcher.commit(batch, WeightsAnnouncement(1))
    second = batcher.next_batch(1, timeout_s=0.5)  # groups 4 and 5 were read ahead: the next batch filters them
    assert second is None and batcher.ledger.counters()["filtered_dropped"] == 4
    assert reconciles(batcher.ledger.counters())


def test_a_redis_back_empty_leaves_nothing_pending_and_the_next_read_recreates_the_group(
        redis_client: redis.Redis) -> None:
    """The trainer's checks between reads (how many entries it holds unacknowledged) must not crash on a server
    that lost the consumer group: the ledger's check, not a NOGROUP traceback, is what stops such a run."""
    keys = Keys.for_exp("back_empty")
    reader = StreamReader(redis_client, keys, keys.traj, TRAINER_CONSUMER, block_ms=10)
    redis_client.xadd(keys.traj, encode_trajectory(make_traj(0, 0, 0)))
    reader.read()  # nothing pending of its own yet: that read was the re-read of its pending entries
    assert len(reader.read()) == 1  # delivered, not acknowledged
    assert reader.pending_count() == 1
    redis_client.flushall()
    assert reader.pending_count() == 0
    assert reader.read() == []
    assert redis_client.xinfo_groups(keys.traj)[0]["name"] in (b"trainer", "trainer")
