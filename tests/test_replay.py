"""A recorded file replays through the batcher deterministically (tests/data holds one from a real run)."""

from pathlib import Path

import redis

from rollstream.consumer.data.batch_stats import rollout_stats
from rollstream.consumer.data.batcher import Batcher
from rollstream.shared.codec import decode_entry
from rollstream.shared.keys import Keys
from rollstream.shared.messages import WeightsAnnouncement
from rollstream.shared.recording import read_records
from rollstream.shared.replay import record_backlog, replay_file
from tests.conftest import REPO, scripted_config

DATA = REPO / "tests" / "data" / "frozen_lake_scripted.msgpack"  # 2 steps x 2 groups of 8, recorded by `run`


def _replay_batches(client: redis.Redis, tmp_path: Path) -> list[tuple[list[str], dict[str, float]]]:
    client.flushall()
    cfg = scripted_config(tmp_path, "exp_name=replay", "rollout_batch_size=16")
    assert replay_file(client, Keys.for_exp("replay"), DATA) == 32
    batcher = Batcher(client, cfg)
    batches = []
    for step in range(2):
        batch = batcher.next_batch(step, timeout_s=5)
        assert batch is not None
        batches.append(([g.group_id for g in batch.groups], rollout_stats(batch.trajectories, step)))
        batcher.commit(batch, WeightsAnnouncement(step + 1))
    assert batcher.next_batch(2, timeout_s=0.3) is None
    return batches


def test_replay_gives_the_same_batches_every_time(redis_client, tmp_path) -> None:
    first = _replay_batches(redis_client, tmp_path)
    second = _replay_batches(redis_client, tmp_path)
    assert first == second
    recorded = [decode_entry(r) for r in read_records(DATA)]
    assert sorted(g for ids, _ in first for g in ids) == sorted({t.group_id for t in recorded})


def test_record_copies_the_backlog_without_consuming_it(redis_client, tmp_path) -> None:
    keys = Keys.for_exp("replay")
    replay_file(redis_client, keys, DATA)
    out = tmp_path / "copy.msgpack"
    assert record_backlog(redis_client, keys, out, limit=10) == 10
    assert redis_client.xlen(keys.traj) == 32
    copied = [decode_entry(r).traj_id for r in read_records(out)]
    assert copied == [decode_entry(r).traj_id for r in read_records(DATA)][:10]


def test_a_recorder_reopened_after_a_torn_write_drops_the_half_record(tmp_path) -> None:
    from rollstream.shared.recording import Recorder

    path = tmp_path / "r.msgpack"
    records = list(read_records(DATA))[:3]
    with Recorder(path) as rec:
        rec.write(records[0])
        rec.write(records[1])
    with open(path, "r+b") as f:  # kill -9 in the middle of the second record
        f.truncate(path.stat().st_size - 100)
    with Recorder(path) as rec:
        rec.write(records[2])
    assert [decode_entry(r).traj_id for r in read_records(path)] == [decode_entry(r).traj_id
                                                                     for r in (records[0], records[2])]
