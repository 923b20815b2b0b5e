"""`rollstream record` and `rollstream replay`: trajectory files in and out of a stream."""

from __future__ import annotations

import os
from typing import cast

import redis

from rollstream.shared.codec import decode_entry
from rollstream.shared.keys import Keys
from rollstream.shared.ledger import Ledger
from rollstream.shared.recording import Recorder, read_records
from rollstream.shared.redis_io import StreamEntries


def record_backlog(client: redis.Redis, keys: Keys, path: str | os.PathLike[str], limit: int | None = None) -> int:
    """Copy the entries now in the trajectory stream to a file, without consuming them."""
    written = 0
    start = "-"
    with Recorder(path) as recorder:
        while limit is None or written < limit:
            page = cast(StreamEntries, client.xrange(keys.traj, min=start, max="+",
                                                     count=min(512, limit - written) if limit else 512))
            if not page:
                break
            for _, fields in page:
                recorder.write(fields)
            written += len(page)
            start = "(" + page[-1][0].decode()
    return written


def replay_file(client: redis.Redis, keys: Keys, path: str | os.PathLike[str]) -> int:
    """Push a file's entries into the trajectory stream, admitting their groups so the trainer takes them.

    Each entry is decoded first: a file that does not decode is refused before anything is written."""
    records = list(read_records(path))
    group_ids = sorted({decode_entry(r).group_id for r in records})
    Ledger(client, keys).register(group_ids)
    with client.pipeline(transaction=False) as pipe:
        for fields in records:
            pipe.xadd(keys.traj, fields)  # type: ignore[arg-type]  # fields as recorded: bytes or str keys
        pipe.execute()
    return len(records)
