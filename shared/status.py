"""`rollstream status`: the experiment as Redis sees it, as a table."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import redis

from rollstream.shared.keys import TRAINER_GROUP, Keys
from rollstream.shared.ledger import OUTCOMES, read_counters, reconciles
from rollstream.shared.messages import (
    LOADED_VERSION,
    EngineBeat,
    Fields,
    MessageError,
    WorkerBeat,
    parse_engine_beat,
    parse_worker_beat,
)


@dataclass
class Status:
    version: int
    backlog: int
    pending: int
    lag: int | None
    dead_letters: int
    counters: dict[str, int]
    workers: list[WorkerBeat]
    engines: list[EngineBeat] = field(default_factory=list)
    """Live engine servers (strategy vllm_server)."""
    unreadable_beats: int = 0
    """Heartbeat hashes that do not parse (not counted as workers or engines)."""
    finished: int | None = None
    """The final version once the trainer reached max_steps."""


def read_status(client: redis.Redis, keys: Keys) -> Status:
    pending, lag = 0, None
    try:
        for group in client.xinfo_groups(keys.traj):
            if group["name"] in (TRAINER_GROUP, TRAINER_GROUP.encode()):
                pending, lag = int(group["pending"]), group.get("lag")
    except redis.ResponseError:  # no stream yet
        pass
    counters = read_counters(client, keys)
    workers, unreadable_workers = _beats(client, keys.worker_pattern, parse_worker_beat)
    engines, unreadable_engines = _beats(client, keys.engine_pattern, parse_engine_beat)
    return Status(
        version=int(client.get(keys.version) or 0),
        backlog=int(client.xlen(keys.traj)),
        pending=pending,
        lag=None if lag is None else int(lag),
        dead_letters=int(client.xlen(keys.dead)),
        counters=counters,
        workers=workers,
        engines=engines,
        unreadable_beats=unreadable_workers + unreadable_engines,
        finished=None if (end := client.get(keys.finished)) is None else int(end),
    )


B = TypeVar("B", WorkerBeat, EngineBeat)


def _beats(client: redis.Redis, pattern: str, parse: Callable[[Fields], B]) -> tuple[list[B], int]:
    """The heartbeats under `pattern` by rank, and how many did not parse."""
    beats, unreadable = [], 0
    for key in client.scan_iter(match=pattern, count=1000):
        try:
            beats.append(parse(client.hgetall(key)))  # type: ignore[arg-type]  # bytes replies
        except MessageError:
            unreadable += 1
    return sorted(beats, key=lambda b: b.rank), unreadable


def loaded_versions(client: redis.Redis, keys: Keys) -> list[int]:
    """The policy version each live env-worker or engine server has loaded (from their heartbeats)."""
    versions = []
    for key in [*client.scan_iter(match=keys.worker_pattern, count=1000),
                *client.scan_iter(match=keys.engine_pattern, count=1000)]:
        loaded = client.hget(key, LOADED_VERSION)
        if loaded is not None:
            versions.append(int(loaded))
    return versions


def format_status(status: Status, ns: str) -> str:
    c = status.counters
    rows = [
        ("namespace", ns),
        ("published version", status.version),
        ("finished", "no" if status.finished is None else f"yes, at version {status.finished}"),
        ("stream backlog (entries)", status.backlog),
        ("delivered, not acked", status.pending),
        ("consumer lag (entries)", "-" if status.lag is None else status.lag),
        ("dead letters", status.dead_letters),
        ("groups admitted", c.get("admitted", 0)),
        *((f"groups {o.replace('_', ' ')}", c.get(o, 0)) for o in OUTCOMES),
        ("groups in flight", c.get("in_flight", 0)),
        ("counters reconcile", "yes" if reconciles(c) else "NO"),
        ("orphan entries acked", c.get("orphan_entries", 0)),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    if status.unreadable_beats:
        lines.append(f"{'unreadable heartbeats':<{width}}  {status.unreadable_beats} (written by another version?)")
    lines.append("")
    now = time.time()
    if status.workers:
        workers: list[tuple[object, ...]] = [("rank", "host", "pid", "envs", "episodes", "ep/s", "errors",
                                              "version", "seen")]
        workers += [(w.rank, w.host, w.pid, w.envs, w.episodes, w.episodes_per_s, w.errors, w.loaded_version,
                     f"{now - w.last_seen:.1f}s ago") for w in status.workers]
        lines += _table(workers)
    else:
        lines.append("no live env-workers")
    if status.engines:
        engines: list[tuple[object, ...]] = [("engine", "url", "host", "pid", "version", "reloads", "last reload",
                                              "seen")]
        engines += [(e.rank, e.url, e.host, e.pid, e.loaded_version, e.reloads, f"{e.last_reload_s:.2f}s",
                     f"{now - e.last_seen:.1f}s ago") for e in status.engines]
        lines += ["", *_table(engines)]
    return "\n".join(lines)


def _table(rows: list[tuple[object, ...]]) -> list[str]:
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(f"{str(v):<{widths[i]}}" for i, v in enumerate(row)) for row in rows]
