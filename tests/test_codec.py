from pathlib import Path

import msgpack
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollstream.shared.codec import CodecError, decode_entry, encode_drop, encode_trajectory
from rollstream.shared.recording import read_records
from rollstream.shared.schema import GroupDropNotice, Trajectory, parse_group_id
from tests.factories import make_traj

RECORDED = Path(__file__).with_name("data") / "frozen_lake_scripted.msgpack"
"""Recorded by `run` in schema 1 (arrays as msgpack extensions), kept so: old recordings must still replay."""


def _as_redis_returns(fields: dict) -> dict[bytes, bytes]:
    """What XRANGE hands back: bytes keys and values."""
    return {k.encode(): v if isinstance(v, bytes) else str(v).encode() for k, v in fields.items()}


def test_trajectory_round_trip_is_exact() -> None:
    traj = make_traj(3, 7, 2, version=5, score=0.5)
    back = decode_entry(_as_redis_returns(encode_trajectory(traj)))
    assert isinstance(back, Trajectory)
    for name in ("traj_id", "group_id", "tag", "episode", "member", "seed", "score", "success", "turns"):
        assert getattr(back, name) == getattr(traj, name)
    for name in ("input_ids", "response_mask", "logprobs"):
        assert getattr(back, name).dtype == getattr(traj, name).dtype
        np.testing.assert_array_equal(getattr(back, name), getattr(traj, name))
    assert back.version == 5


def test_readable_fields_sit_beside_the_payload() -> None:
    fields = encode_trajectory(make_traj(1, 2, 0, version=3, score=1.0))
    assert fields["group_id"] == "train/FrozenLake/g1/e2"
    assert (fields["version"], fields["tag"], fields["score"], fields["tokens"]) == (3, "FrozenLake", 1.0, 6)
    assert parse_group_id(fields["group_id"]) == ("train", "FrozenLake", 1, 2)


def test_drop_notice_round_trip() -> None:
    notice = GroupDropNotice("train/FrozenLake/g1/e2", "error", "ValueError: boom", 3)
    assert decode_entry(_as_redis_returns(encode_drop(notice))) == notice


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (None, "no binary 'payload'"),
        (b"\xc1", "not valid msgpack"),
        (msgpack.packb([1, 2]), "expected a map"),
        (msgpack.packb({"schema": 99, "kind": "traj", "body": {}}), "schema version 99"),
        (msgpack.packb({"schema": True, "kind": "traj", "body": {}}), "schema version True"),
        (msgpack.packb({"schema": 1, "kind": "what", "body": {}}), "unknown entry kind"),
        (msgpack.packb({"schema": 1, "kind": "traj", "body": {"traj_id": "x"}}), "traj payload lacks"),
        (msgpack.packb({"schema": 1, "kind": "traj", "body": []}), "no 'body' map"),
    ],
)
def test_garbage_raises_codec_error_saying_what(payload: bytes | None, message: str) -> None:
    fields = {} if payload is None else {b"payload": payload}
    with pytest.raises(CodecError, match=message):
        decode_entry(fields)


def _schema_1(fields: dict) -> bytes:
    """The payload as schema 1 wrote it: each array a msgpack extension holding [dtype, shape] and its bytes."""
    message = msgpack.unpackb(fields["payload"], raw=False)
    message["schema"] = 1
    for name, dtype in (("input_ids", "<i4"), ("response_mask", "|u1"), ("logprobs", "<f4")):
        data = message["body"][name]
        length = len(data) // np.dtype(dtype).itemsize
        message["body"][name] = msgpack.ExtType(1, msgpack.packb([dtype, [length]]) + data)
    return msgpack.packb(message, use_bin_type=True)


def test_payloads_of_schema_1_still_decode_to_the_same_trajectory() -> None:
    traj = make_traj(3, 7, 2, version=5, score=0.5)
    now = decode_entry(_as_redis_returns(encode_trajectory(traj)))
    before = decode_entry({b"payload": _schema_1(encode_trajectory(traj))})
    assert isinstance(now, Trajectory) and isinstance(before, Trajectory)
    assert before.turns == now.turns and before.traj_id == now.traj_id
    for name in ("input_ids", "response_mask", "logprobs"):
        assert getattr(before, name).dtype == getattr(now, name).dtype
        np.testing.assert_array_equal(getattr(before, name), getattr(now, name))


def test_the_recorded_file_of_schema_1_replays() -> None:
    entries = list(read_records(RECORDED))
    assert entries and msgpack.unpackb(entries[0][b"payload"], raw=False, ext_hook=lambda c, d: None)["schema"] == 1
    trajectories = [decode_entry(e) for e in entries]
    assert all(isinstance(t, Trajectory) and t.input_ids.dtype == np.int32 for t in trajectories)


def test_object_arrays_of_schema_1_are_refused() -> None:
    message = msgpack.unpackb(_schema_1(encode_trajectory(make_traj())), raw=False, ext_hook=msgpack.ExtType)
    message["body"]["input_ids"] = msgpack.ExtType(1, msgpack.packb(["|O", [1]]) + b"\x00" * 8)
    with pytest.raises(CodecError, match="object arrays"):
        decode_entry({b"payload": msgpack.packb(message)})


@pytest.mark.parametrize(("name", "value", "says"), [
    ("input_ids", b"\x00" * 7, "input_ids is 7 bytes, expected int32 values"),
    ("logprobs", [0.5, 0.25], "logprobs is a list, expected float32"),
    ("response_mask", "1100", "response_mask is a str"),
])
def test_an_array_that_is_not_whole_values_as_bytes_is_refused_by_name(name: str, value: object, says: str) -> None:
    message = msgpack.unpackb(encode_trajectory(make_traj())["payload"], raw=False)
    message["body"][name] = value
    with pytest.raises(CodecError, match=says):
        decode_entry({b"payload": msgpack.packb(message, use_bin_type=True)})


@given(st.binary(max_size=512))
def test_random_bytes_never_raise_anything_but_codec_error(data: bytes) -> None:
    try:
        decode_entry({b"payload": data})
    except CodecError:
        pass


@given(st.integers(0, 2**31 - 1), st.integers(0, 255))
def test_flipping_a_byte_of_a_real_payload_is_caught_or_harmless(position: int, value: int) -> None:
    payload = bytearray(encode_trajectory(make_traj())["payload"])
    payload[position % len(payload)] = value
    try:
        traj = decode_entry({b"payload": bytes(payload)})
    except CodecError:
        return
    # Harmless: what decodes is a well-formed trajectory (a changed value, not a changed shape or type), which
    # encodes again to the same thing.
    assert isinstance(traj, Trajectory)
    assert isinstance(traj.group_id, str) and isinstance(traj.member, int) and isinstance(traj.version, int)
    assert all(isinstance(turn.version, int) for turn in traj.turns)
    assert len(traj.input_ids) == len(traj.response_mask) == len(traj.logprobs)
    again = decode_entry(encode_trajectory(traj))
    assert isinstance(again, Trajectory) and again.traj_id == traj.traj_id
    assert np.array_equal(again.input_ids, traj.input_ids) and again.turns == traj.turns


# One wrong value per trajectory field: the decoder checks them inline (its fast path) and must still refuse each,
# naming the field, as the field-by-field rules (_TRAJ_TYPES) do.
WRONG = {"traj_id": 3, "group_id": None, "mode": b"train", "tag": 1.5, "group_index": -1, "episode": "2",
         "member": True, "seed": 1.0, "score": float("inf"), "success": 1, "end_reason": None, "worker_rank": -2,
         "created_at": "now"}


@pytest.mark.parametrize(("name", "value"), WRONG.items())
def test_every_trajectory_field_of_the_wrong_type_is_refused_by_name(name: str, value: object) -> None:
    message = msgpack.unpackb(encode_trajectory(make_traj(1, 2, 0))["payload"], raw=False)
    message["body"][name] = value
    payload = msgpack.packb(message, use_bin_type=True)
    with pytest.raises(CodecError, match=name):
        decode_entry({b"payload": payload})


def test_what_producers_write_takes_the_typed_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer decodes every entry: a well-formed schema 2 trajectory (an invalid reply's None action, an
    integer reward, a negative seed) must not need the general path, which is ~3x slower."""
    traj = make_traj(3, 7, 2, version=5)
    traj.seed = -1
    traj.turns[0].action, traj.turns[0].action_is_valid, traj.turns[0].reward = None, False, -0.1
    traj.turns[1].reward = 1
    fields = _as_redis_returns(encode_trajectory(traj))

    def general_path(raw: bytes) -> None:
        raise AssertionError("a well-formed trajectory went to the general path")

    monkeypatch.setattr("rollstream.shared.codec._decode_any", general_path)
    back = decode_entry(fields)
    assert isinstance(back, Trajectory) and back.turns == traj.turns and back.seed == -1


def test_the_typed_schema_has_the_general_paths_fields() -> None:
    """The typed decoder and the general path (and the encoder) name the same fields in the same order: a field
    added to one only would send every entry down the slow path, or decode it without the new field."""
    from rollstream.shared import codec

    expected = (*codec._TRAJ_FIELDS, "turns", *codec._ARRAY_FIELDS)
    assert codec._TrajBody.__struct_fields__ == expected
    assert len(codec._TurnRow.__args__) == len(codec._TURN_FIELDS)
