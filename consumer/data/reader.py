"""Reading a trajectory stream with XREADGROUP under a stable consumer name.

On start the reader re-reads its own pending entries (delivered before a crash, never acknowledged), then
new ones; it re-reads them again whenever asked (`reread_pending`: entries delivered whose reply was lost).
Entries that cannot be decoded go to the dead-letter stream with the reason, and are acked there; the
dead-letter stream is capped and keeps truncated copies of large fields, so bad input cannot fill Redis.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import cast

import redis

from rollstream.shared.codec import CodecError, decode_entry
from rollstream.shared.keys import TRAINER_GROUP, Keys
from rollstream.shared.redis_io import StreamReplies, register_script
from rollstream.shared.schema import GroupDropNotice, Trajectory

log = logging.getLogger(__name__)

DEAD_MAXLEN = 10_000
"""About how many dead letters are kept (approximate MAXLEN: the dead stream holds no unconsumed training data)."""
DEAD_FIELD_BYTES = 1024
"""A dead letter keeps at most this many bytes of each original field, and the original length beside it."""

# KEYS: dead-letter stream, source stream, counters
# ARGV: consumer group, entry id, maxlen, then the dead letter's field/value pairs
# Only an entry still in the source stream is moved: a call retried after a lost reply adds no second letter.
# allow-oom: moving an entry to the capped dead stream, truncated, frees memory; it must run at maxmemory.
DEAD_LETTER_LUA = """#!lua flags=allow-oom
redis.call('XACK', KEYS[2], ARGV[1], ARGV[2])
if redis.call('XDEL', KEYS[2], ARGV[2]) == 1 then
  redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[3], '*', unpack(ARGV, 4))
  redis.call('HINCRBY', KEYS[3], 'dead_letters', 1)
end
"""

# KEYS: stream. ARGV: consumer group. Returns 1 when created, 0 when it existed.
# allow-oom: a trainer started while Redis is at maxmemory must get its group, or nobody ever frees memory.
ENSURE_GROUP_LUA = """#!lua flags=allow-oom
local reply = redis.pcall('XGROUP', 'CREATE', KEYS[1], ARGV[1], '0', 'MKSTREAM')
if type(reply) == 'table' and reply.err then
  if string.find(reply.err, 'BUSYGROUP') then return 0 end
  return redis.error_reply(reply.err)
end
return 1
"""


@dataclass(frozen=True)
class Entry:
    entry_id: bytes
    item: Trajectory | GroupDropNotice


def _group_missing(error: redis.ResponseError) -> bool:
    """Redis's NOGROUP: the stream or its consumer group is gone (a server that restarted without persistence)."""
    return "NOGROUP" in str(error)


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
        self._new_read_short = False
        """The last read of new entries returned less than a full page: the backlog has been read."""
        self.rereading = False
        """The last read returned pending entries (ones this consumer may already hold)."""
        self._dead_letter = register_script(client, DEAD_LETTER_LUA)
        self._ensure_group = register_script(client, ENSURE_GROUP_LUA)
        self.ensure_group()

    def ensure_group(self) -> None:
        # Start at 0, not $: trajectories written before the trainer first started are not lost.
        self._ensure_group(keys=[self.stream], args=[TRAINER_GROUP])

    @property
    def caught_up(self) -> bool:
        """True once the pending entries were re-read and a read of new entries returned less than a full page:
        only then may a group be judged incomplete (its members are not sitting unread in the stream)."""
        return self._pending_cursor is None and self._new_read_short

    @property
    def drained(self) -> bool:
        """The last read asked for new entries and got less than a page: everything written before it is in hand."""
        return not self.rereading and self._new_read_short

    def reread_pending(self) -> None:
        """Read this consumer's pending entries again from the start, before new ones."""
        self._pending_cursor = "0"

    def pending_count(self) -> int:
        """How many entries the group has delivered to this consumer and not yet seen acknowledged."""
        try:
            summary = self.client.xpending(self.stream, TRAINER_GROUP)
        except redis.ResponseError as e:
            if not _group_missing(e):
                raise
            # The group vanished with a Redis that came back empty: nothing is pending; `read` recreates the group,
            # and the ledger's check of the committed version stops the run with one line.
            return 0
        mine = [c["pending"] for c in summary.get("consumers") or [] if c["name"] in (self.consumer,
                                                                                      self.consumer.encode())]
        return int(mine[0]) if mine else 0

    def read(self) -> list[Entry]:
        """One XREADGROUP: pending entries first, then new ones, blocking up to block_ms for new ones."""
        rereading = self._pending_cursor is not None
        cursor: bytes | str = self._pending_cursor if self._pending_cursor is not None else ">"
        try:
            reply = cast(StreamReplies, self.client.xreadgroup(
                TRAINER_GROUP, self.consumer, {self.stream: cursor}, count=self.count,
                block=None if rereading else self.block_ms))
        except redis.ResponseError as e:
            if not _group_missing(e):
                raise
            # The stream or group vanished (a Redis restarted without persistence): recreate and go on.
            log.warning("consumer group missing on %s, recreating it", self.stream)
            self.ensure_group()
            return []
        return self._received(reply, rereading)

    def read_ahead(self, pipe: redis.client.Pipeline) -> bool:
        """Queue a read of new entries that does not block on `pipe`, beside another command (the step's commit):
        one round trip, and under appendfsync always one fsync instead of two. Its reply goes to `take`. False,
        with nothing queued, while this consumer's pending entries are being re-read."""
        if self._pending_cursor is not None:
            return False
        pipe.xreadgroup(TRAINER_GROUP, self.consumer, {self.stream: ">"}, count=self.count)
        return True

    def take(self, reply: object) -> list[Entry]:
        """The entries of a read queued by `read_ahead`. An error reply delivered nothing: the next read asks
        again (and a delivery whose reply was lost is found by the stranded-entries check, as for `read`)."""
        if isinstance(reply, Exception):
            log.warning("read-ahead on %s failed (%s: %s); the next read asks again", self.stream,
                        type(reply).__name__, reply)
            return []
        return self._received(cast(StreamReplies, reply), rereading=False)

    def _received(self, reply: StreamReplies, rereading: bool) -> list[Entry]:
        """A read's entries, decoded, after noting where it leaves the reader (pending cursor, or backlog read)."""
        raw = reply[0][1] if reply else []
        self.rereading = rereading
        if rereading:
            self._pending_cursor = raw[-1][0] if raw else None
        else:
            self._new_read_short = len(raw) < self.count
        return self._decode(raw)

    def _decode(self, raw: list[tuple[bytes, dict[bytes, bytes] | None]]) -> list[Entry]:
        entries: list[Entry] = []
        deleted: list[bytes] = []
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
        log.warning("dead letter %s %s: %s", self.stream, entry_id.decode(), reason[:500])
        letter: list[bytes | str | float] = ["source", self.stream, "entry_id", entry_id, "reason", reason[:2000],
                                             "at", time.time()]
        for name, value in fields.items():
            value = value if isinstance(value, bytes) else str(value).encode()
            letter += [b"orig:" + name, value[:DEAD_FIELD_BYTES]]
            if len(value) > DEAD_FIELD_BYTES:
                letter += [b"size:" + name, len(value)]
        self._dead_letter(keys=[self.keys.dead, self.stream, self.keys.counters],
                          args=[TRAINER_GROUP, entry_id, DEAD_MAXLEN, *letter])
