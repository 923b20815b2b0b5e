"""Stream entry codec: a pair of pure functions, msgpack with numpy arrays as raw bytes, no pickle.

An entry carries small readable fields (kind, group id, version, tag, score, tokens) beside the msgpack
payload, so `redis-cli XRANGE <ns>:traj - + COUNT 3` is legible. The payload is the source of truth.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgpack
import numpy as np

from rollstream.shared.schema import GroupDropNotice, Trajectory, Turn

SCHEMA_VERSION = 1
_NDARRAY_EXT = 1
_TURN_FIELDS = ("version", "observation", "reply", "action", "action_is_valid", "reward",
                "response_span", "finish_reason")
_TRAJ_FIELDS = ("traj_id", "group_id", "mode", "tag", "group_index", "episode", "member", "seed",
                "score", "success", "end_reason", "worker_rank", "created_at")
_ARRAY_FIELDS = {"input_ids": np.int32, "response_mask": np.uint8, "logprobs": np.float32}


class CodecError(ValueError):
    """A stream entry that cannot be decoded; the message says what was wrong with it."""


Fields = Mapping[bytes | str, bytes | str | int | float]


def encode_trajectory(traj: Trajectory) -> dict[str, bytes | str | int | float]:
    body: dict[str, Any] = {name: getattr(traj, name) for name in _TRAJ_FIELDS}
    body["turns"] = [[getattr(t, name) for name in _TURN_FIELDS] for t in traj.turns]
    for name, dtype in _ARRAY_FIELDS.items():
        body[name] = np.ascontiguousarray(getattr(traj, name), dtype=dtype)
    payload = _pack({"schema": SCHEMA_VERSION, "kind": "traj", "body": body})
    return {
        "kind": "traj",
        "group_id": traj.group_id,
        "traj_id": traj.traj_id,
        "version": traj.version,
        "tag": traj.tag,
        "score": round(float(traj.score), 4),
        "tokens": traj.num_tokens,
        "payload": payload,
    }


def encode_drop(notice: GroupDropNotice) -> dict[str, bytes | str | int | float]:
    body = {"group_id": notice.group_id, "reason": notice.reason, "detail": notice.detail,
            "worker_rank": notice.worker_rank}
    return {
        "kind": "drop",
        "group_id": notice.group_id,
        "reason": notice.reason,
        "payload": _pack({"schema": SCHEMA_VERSION, "kind": "drop", "body": body}),
    }


def decode_entry(fields: Fields) -> Trajectory | GroupDropNotice:
    """Decode one stream entry's fields (bytes or str keys, as redis-py returns them)."""
    raw = fields.get(b"payload", fields.get("payload"))
    if not isinstance(raw, bytes):
        raise CodecError("entry has no binary 'payload' field")
    try:
        message = msgpack.unpackb(raw, ext_hook=_ext_hook, raw=False, strict_map_key=True)
    except CodecError:
        raise
    except Exception as e:  # msgpack raises several unrelated types for malformed input
        raise CodecError(f"payload is not valid msgpack: {type(e).__name__}: {e}") from e
    if not isinstance(message, dict):
        raise CodecError(f"payload is a {type(message).__name__}, expected a map")
    if message.get("schema") != SCHEMA_VERSION:
        raise CodecError(
            f"payload schema version {message.get('schema')!r}, this reader understands {SCHEMA_VERSION}; "
            "producers and trainer must run the same rollstream version"
        )
    body = message.get("body")
    if not isinstance(body, dict):
        raise CodecError("payload has no 'body' map")
    kind = message.get("kind")
    try:
        if kind == "traj":
            return _trajectory_from(body)
        if kind == "drop":
            return GroupDropNotice(str(body["group_id"]), str(body["reason"]), str(body.get("detail", "")),
                                   int(body.get("worker_rank", 0)))
    except (KeyError, TypeError, ValueError) as e:
        raise CodecError(f"{kind} payload is malformed: {type(e).__name__}: {e}") from e
    raise CodecError(f"unknown entry kind {kind!r} (expected 'traj' or 'drop')")


def _trajectory_from(body: dict[str, Any]) -> Trajectory:
    missing = [n for n in (*_TRAJ_FIELDS, "turns", *_ARRAY_FIELDS) if n not in body]
    if missing:
        raise CodecError(f"traj payload lacks {', '.join(missing)}")
    turns = []
    for row in body["turns"]:
        if len(row) != len(_TURN_FIELDS):
            raise CodecError(f"a turn has {len(row)} fields, expected {len(_TURN_FIELDS)}")
        turn = Turn(**dict(zip(_TURN_FIELDS, row)))
        turn.response_span = (int(turn.response_span[0]), int(turn.response_span[1]))
        turns.append(turn)
    arrays = {}
    for name, dtype in _ARRAY_FIELDS.items():
        value = body[name]
        if not isinstance(value, np.ndarray) or value.dtype != dtype:
            raise CodecError(f"{name} must be a {np.dtype(dtype).name} array")
        arrays[name] = value
    if not len(arrays["input_ids"]) == len(arrays["response_mask"]) == len(arrays["logprobs"]):
        raise CodecError("input_ids, response_mask and logprobs differ in length")
    return Trajectory(turns=turns, **{n: body[n] for n in _TRAJ_FIELDS}, **arrays)


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, default=_default, use_bin_type=True)


def _default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        header = msgpack.packb([obj.dtype.str, list(obj.shape)])
        return msgpack.ExtType(_NDARRAY_EXT, header + obj.tobytes())
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot encode {type(obj).__name__}")


def _ext_hook(code: int, data: bytes) -> Any:
    if code != _NDARRAY_EXT:
        raise CodecError(f"unknown msgpack extension type {code}")
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(data)
    try:
        dtype_str, shape = next(unpacker)
        dtype = np.dtype(dtype_str)
        if dtype.hasobject:
            raise CodecError("object arrays are not allowed")
        offset = unpacker.tell()
        # copy: frombuffer would alias the read-only payload bytes
        return np.frombuffer(data, dtype=dtype, offset=offset).reshape(shape).copy()
    except CodecError:
        raise
    except Exception as e:
        raise CodecError(f"bad ndarray extension: {type(e).__name__}: {e}") from e
