"""The typed messages of the control and weights streams, the pause key and the heartbeats; and that what the
ledger's Lua scripts write parses as the same messages."""

import pytest
import redis

from rollstream.shared.keys import Keys
from rollstream.shared.ledger import Ledger
from rollstream.shared.messages import (
    EngineBeat,
    ExperimentFinished,
    MessageError,
    PausedRound,
    SlotFreed,
    ValidationEnded,
    ValidationStarted,
    VersionPublished,
    WeightsAnnouncement,
    WorkerBeat,
    control_fields,
    parse_announcement,
    parse_control,
    parse_engine_beat,
    parse_paused,
    parse_worker_beat,
)

KEYS = Keys.for_exp("msgs")


def wire(fields: dict[str, str | int | float]) -> dict[bytes, bytes]:
    """What a reader gets back from Redis for the fields a writer sent."""
    return {k.encode(): str(v).encode() for k, v in fields.items()}


@pytest.mark.parametrize("message", [SlotFreed("train/A/g0/e3"), VersionPublished(7), ValidationStarted(2, 20),
                                     ValidationEnded(2), ExperimentFinished(220)])
def test_control_messages_round_trip(message) -> None:
    assert parse_control(wire(control_fields(message))) == message


def test_other_messages_round_trip() -> None:
    announcement = WeightsAnnouncement(3, "file:///out/weights/v3", "sha256:ab")
    assert parse_announcement(wire(announcement.fields())) == announcement
    assert WeightsAnnouncement(3).fields() == {"version": 3}  # a learner without a model: the version alone
    assert parse_announcement({b"version": b"3"}) == WeightsAnnouncement(3)
    assert parse_paused(PausedRound(4, 40).value().encode()) == PausedRound(4, 40)
    worker = WorkerBeat(rank=1, host="h", pid=9, incarnation="abc", envs=16, episodes=5, errors=0,
                        episodes_per_s=0.5, loaded_version=3, last_seen=1.5)
    assert parse_worker_beat(wire(worker.fields())) == worker
    engine = EngineBeat(rank=0, url="http://h:8000", host="h", pid=9, incarnation="x", loaded_version=3,
                        reloads=2, last_reload_s=0.25, last_seen=1.5)
    assert parse_engine_beat(wire(engine.fields())) == engine


@pytest.mark.parametrize("fields, says", [
    ({b"kind": b"nope"}, "unknown kind b'nope'"),
    ({b"round": b"1"}, "unknown kind None"),
    ({b"kind": b"val", b"round": b"1"}, "field 'version' is missing"),
    ({b"kind": b"val", b"round": b"x", b"version": b"1"}, "field 'round' = b'x' is not int"),
    ({b"kind": b"finished", b"version": b"\xff"}, "field 'version'"),
])
def test_a_malformed_control_message_is_refused_with_what_was_wrong(fields, says) -> None:
    with pytest.raises(MessageError, match=says.replace("(", r"\(").replace(")", r"\)")):
        parse_control(fields)


def test_malformed_announcements_pauses_and_beats_are_refused() -> None:
    with pytest.raises(MessageError, match="weights announcement: field 'version' = b'abc' is not int"):
        parse_announcement({b"version": b"abc", b"uri": b"file:///x"})
    with pytest.raises(MessageError, match="field 'version' is missing"):
        parse_announcement({b"uri": b"file:///x"})
    with pytest.raises(MessageError, match="pause key holds b'1'"):
        parse_paused(b"1")
    with pytest.raises(MessageError, match="env-worker heartbeat: field 'rank' is missing"):
        parse_worker_beat({b"pid": b"1"})


def test_what_the_ledgers_scripts_write_parses(redis_client: redis.Redis) -> None:
    ledger = Ledger(redis_client, KEYS)
    redis_client.xgroup_create(KEYS.traj, "trainer", id="0", mkstream=True)
    ledger.register(["train/A/g0/e0", "train/A/g1/e0"])
    ledger.finish("train/A/g1/e0", "timeout_dropped", [])
    ledger.commit_step([("train/A/g0/e0", [])], WeightsAnnouncement(1, "file:///w/v1", "sha256:x"))
    ledger.announce(WeightsAnnouncement(1, "file:///w/v1-resumed", "sha256:y"))
    ledger.finish_experiment(1)
    control = [parse_control(fields) for _, fields in redis_client.xrange(KEYS.control)]
    # a dropped group frees its slot at once; trained ones with the new version (the commit, then the resume)
    assert control == [SlotFreed("train/A/g1/e0"), VersionPublished(1), VersionPublished(1), ExperimentFinished(1)]
    weights = [parse_announcement(fields) for _, fields in redis_client.xrange(KEYS.weights)]
    assert weights == [WeightsAnnouncement(1, "file:///w/v1", "sha256:x"),
                       WeightsAnnouncement(1, "file:///w/v1-resumed", "sha256:y")]
