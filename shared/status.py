"""`rollstream status`: the experiment as Redis sees it, as a table."""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis

from rollstream.shared.keys import TRAINER_GROUP, Keys
from rollstream.shared.ledger import OUTCOMES, read_counters, reconciles
from rollstream.shared.redis_io import text


@dataclass
class Status:
    version: int
    backlog: int
    pending: int
    lag: int | None
    dead_letters: int
    counters: dict[str, int]
    workers: list[dict[str, str]]
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
    workers = []
    for key in sorted(client.scan_iter(match=keys.worker_pattern, count=1000)):
        workers.append({text(k): text(v) for k, v in client.hgetall(key).items()})
    workers.sort(key=lambda w: int(w.get("rank", 0)))
    return Status(
        version=int(client.get(keys.version) or 0),
        backlog=int(client.xlen(keys.traj)),
        pending=pending,
        lag=None if lag is None else int(lag),
        dead_letters=int(client.xlen(keys.dead)),
        counters=counters,
        workers=workers,
        finished=None if (end := client.get(keys.finished)) is None else int(end),
    )


def loaded_versions(client: redis.Redis, keys: Keys) -> list[int]:
    """The policy version each live env-worker has loaded (from their heartbeats)."""
    versions = []
    for key in client.scan_iter(match=keys.worker_pattern, count=1000):
        loaded = client.hget(key, "loaded_version")
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
    lines.append("")
    if not status.workers:
        lines.append("no live env-workers")
        return "\n".join(lines)
    header = ("rank", "host", "pid", "envs", "episodes", "ep/s", "errors", "version", "seen")
    table = [header]
    now = time.time()
    for w in status.workers:
        seen = f"{now - float(w.get('last_seen', now)):.1f}s ago"
        table.append((w.get("rank", "?"), w.get("host", "?"), w.get("pid", "?"), w.get("envs", "?"),
                      w.get("episodes", "?"), w.get("episodes_per_s", "?"), w.get("errors", "?"),
                      w.get("loaded_version", "?"), seen))
    widths = [max(len(str(row[i])) for row in table) for i in range(len(header))]
    lines += ["  ".join(f"{str(v):<{widths[i]}}" for i, v in enumerate(row)) for row in table]
    return "\n".join(lines)
