"""What processes tell each other through Redis besides trajectories: control messages, weights announcements,
the validation pause and heartbeats, one frozen dataclass each.

Trajectories have their codec (codec.py); these are small and stay flat, readable field/value pairs on the wire,
so `redis-cli XRANGE <ns>:control - +` shows them as they are. `fields()` is what a writer sends; the parsers take
what a reader got (bytes from Redis) and raise MessageError, naming the field and what was wrong, for anything
else: readers log, count and skip such entries, and never stop on them. The ledger's Lua scripts write the `slot`,
`version` and `finished` control messages and the weights announcement with these same field names
(tests/test_messages.py parses what the scripts wrote).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

Fields = Mapping[bytes, bytes]
"""An entry or hash as redis-py returns it (no decoding)."""


class MessageError(ValueError):
    """A stream entry, hash or key value that is not the message it should be."""


M = TypeVar("M")


def _parse(cls: type[M], fields: Fields, what: str) -> M:
    """Build `cls` from its fields, converting each to the type its dataclass field declares (int, float, str)."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        raw = fields.get(f.name.encode())
        if raw is None:
            if f.default is not dataclasses.MISSING:
                continue
            raise MessageError(f"{what}: field {f.name!r} is missing (got {_show(fields)})")
        try:
            text = raw.decode()
            values[f.name] = {"int": int, "float": float}.get(str(f.type), str)(text)
        except (UnicodeDecodeError, ValueError, AttributeError) as e:
            raise MessageError(f"{what}: field {f.name!r} = {raw!r:.60} is not {f.type}") from e
    return cls(**values)


def _show(fields: Fields) -> str:
    return f"{dict(fields)!r:.200}"


def _flat(message: object) -> dict[str, str | int | float]:
    return dataclasses.asdict(message)  # type: ignore[call-overload]


# ---- the control stream ----


@dataclass(frozen=True)
class SlotFreed:
    """A train group ended (trained or dropped): its slot is free for another admission."""

    kind: ClassVar[str] = "slot"
    group_id: str


@dataclass(frozen=True)
class VersionPublished:
    """The trainer committed a step: `version` is the newest policy (its weights are on the weights stream)."""

    kind: ClassVar[str] = "version"
    version: int


@dataclass(frozen=True)
class ValidationStarted:
    """Every env-worker plays its share of validation round `round` at policy `version`."""

    kind: ClassVar[str] = "val"
    round: int
    version: int


@dataclass(frozen=True)
class ValidationEnded:
    """Validation round `round` is over: train admission goes on."""

    kind: ClassVar[str] = "resume"
    round: int


@dataclass(frozen=True)
class ExperimentFinished:
    """The trainer reached max_steps at `version`: env-workers return their slots and exit 0."""

    kind: ClassVar[str] = "finished"
    version: int


ControlMessage = SlotFreed | VersionPublished | ValidationStarted | ValidationEnded | ExperimentFinished
_CONTROL: dict[bytes, type[ControlMessage]] = {
    cls.kind.encode(): cls
    for cls in (SlotFreed, VersionPublished, ValidationStarted, ValidationEnded, ExperimentFinished)
}


def control_fields(message: ControlMessage) -> dict[str, str | int | float]:
    """The entry to XADD to the control stream."""
    return {"kind": message.kind, **_flat(message)}


def parse_control(fields: Fields) -> ControlMessage:
    kind = fields.get(b"kind")
    cls = _CONTROL.get(kind) if kind is not None else None
    if cls is None:
        raise MessageError(f"control message of unknown kind {kind!r} (expected one of "
                           f"{', '.join(k.decode() for k in _CONTROL)}): {_show(fields)}")
    return _parse(cls, fields, f"control message {cls.kind!r}")


# ---- the weights stream and the validation pause ----


@dataclass(frozen=True)
class WeightsAnnouncement:
    """Policy `version` is published: its weights at `uri` (file:// or redis-chunks:), `digest` over every file.

    A learner without a model (stats_only) announces the version alone (empty uri and digest)."""

    version: int
    uri: str = ""
    digest: str = ""

    def fields(self) -> dict[str, str | int | float]:
        return {name: value for name, value in _flat(self).items() if value != ""}


def parse_announcement(fields: Fields) -> WeightsAnnouncement:
    return _parse(WeightsAnnouncement, fields, "weights announcement")


@dataclass(frozen=True)
class PausedRound:
    """The value of the pause key while validation round `round` (at policy `version`) runs: train admission
    waits, and a worker that starts mid-round still plays its share."""

    round: int
    version: int

    def value(self) -> str:
        return f"{self.round} {self.version}"


def parse_paused(value: bytes) -> PausedRound:
    try:
        round_, version = map(int, value.split())
    except ValueError as e:
        raise MessageError(f"pause key holds {value!r:.60}, expected '<round> <version>'") from e
    return PausedRound(round_, version)


# ---- heartbeats ----


@dataclass(frozen=True)
class WorkerBeat:
    """An env-worker's heartbeat hash, refreshed every heartbeat_s; it expires when the worker stops beating."""

    rank: int
    host: str
    pid: int
    incarnation: str
    """One per process start: a group admitted by another incarnation of the rank was lost with it."""
    envs: int
    episodes: int
    errors: int
    episodes_per_s: float
    loaded_version: int
    last_seen: float
    """Unix time of the beat."""

    def fields(self) -> dict[str, str | int | float]:
        return _flat(self)


@dataclass(frozen=True)
class EngineBeat:
    """An engine server's heartbeat hash: where it listens and the version it serves."""

    rank: int
    url: str
    host: str
    pid: int
    incarnation: str
    loaded_version: int
    reloads: int
    last_reload_s: float
    last_seen: float

    def fields(self) -> dict[str, str | int | float]:
        return _flat(self)


INCARNATION = "incarnation"
"""The heartbeat field the ledger reads to tell a live worker from a restarted one."""
LOADED_VERSION = "loaded_version"
"""The heartbeat field that keeps a version's weights from being pruned while a worker or engine serves them."""


def parse_worker_beat(fields: Fields) -> WorkerBeat:
    return _parse(WorkerBeat, fields, "env-worker heartbeat")


def parse_engine_beat(fields: Fields) -> EngineBeat:
    return _parse(EngineBeat, fields, "engine heartbeat")
