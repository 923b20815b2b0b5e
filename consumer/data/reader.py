"""Reading a trajectory stream with XREADGROUP under a stable consumer name.

On start the reader re-reads its own pending entries (delivered before a crash, never acknowledged), then
new ones. Entries that cannot be decoded go to the dead-letter stream with the reason, and are acked there.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import redis

from rollstream.shared.codec import CodecError, decode_entry
from rollstream.shared.keys import TRAINER_GROUP, Keys
from rollstream.shared.schema import GroupDropNotice, Trajectory

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Entry:
    entry_id: bytes
    item: Trajectory | GroupDropNotice


class StreamReader:
    def __init__(self, client: redis.Redis, keys: Keys, stream: str, consumer: str, *,
                 count: int = 128, block_ms: int = 2000) -> None:
        self.client = client
        self.keys = keys
        self.stream = stream
        self.consumer = consumer
        self.count = count
        self.block_ms = block_ms
        self._pending_cursor: bytes | str | None = "0"
        """Where to continue re-reading our own pending entries; None once they are exhausted."""
        self._last_read = 0
        self.drained = False
        """The last read asked for new entries and got less than a page: everything written before it is in hand."""
        self.dead_letters = 0
        self.ensure_group()

    def ensure_group(self) -> None:
        # Start at 0, not $: trajectories written before the trainer first started are not lost.
        try:
            self.client.xgroup_create(self.stream, TRAINER_GROUP, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    @property
    def caught_up(self) -> bool:
        """True once the pending entries were re-read and the last read returned less than a full page."""
        return self._pending_cursor is None and self._last_read < self.count

    def read(self) -> list[Entry]:
        """One XREADGROUP: pending entries first, then new ones, blocking up to block_ms for new ones."""
        rereading = self._pending_cursor is not None
        cursor = self._pending_cursor if rereading else ">"
        try:
            reply = self.client.xreadgroup(TRAINER_GROUP, self.consumer, {self.stream: cursor},  # type: ignore[dict-item]
                                           count=self.count, block=None if rereading else self.block_ms)
        except redis.ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            # The stream or group vanished (a Redis restarted without persistence): recreate and go on.
            log.warning("consumer group missing on %s, recreating it", self.stream)
            self.ensure_group()
            return []
        raw = reply[0][1] if reply else []
        self._last_read = len(raw)
        self.drained = not rereading and len(raw) < self.count
        if rereading:
            self._pending_cursor = raw[-1][0] if raw else None
        return self._decode(raw)

    def _decode(self, raw: list[tuple[bytes, dict[bytes, bytes] | None]]) -> list[Entry]:
        entries, deleted = [], []
        for entry_id, fields in raw:
            if fields is None:  # pending, but deleted from the stream meanwhile: nothing left to process
                deleted.append(entry_id)
                continue
            try:
                entries.append(Entry(entry_id, decode_entry(fields)))
            except CodecError as e:
                self.dead_letter(entry_id, fields, str(e))
        if deleted:
            self.client.xack(self.stream, TRAINER_GROUP, *deleted)
        return entries

    def dead_letter(self, entry_id: bytes, fields: dict[bytes, bytes], reason: str) -> None:
        log.warning("dead letter %s %s: %s", self.stream, entry_id.decode(), reason)
        with self.client.pipeline(transaction=True) as pipe:
            pipe.xadd(self.keys.dead, {"source": self.stream, "entry_id": entry_id, "reason": reason,
                                       "at": time.time(), **{b"orig:" + k: v for k, v in fields.items()}})
            pipe.xack(self.stream, TRAINER_GROUP, entry_id)
            pipe.xdel(self.stream, entry_id)
            pipe.hincrby(self.keys.counters, "dead_letters", 1)
            pipe.execute()
        self.dead_letters += 1
