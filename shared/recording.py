"""Trajectory files: stream entries written one after another with msgpack, for record and replay.

A file starts with a header map; each record is one stream entry's fields as XADD takes them, so a
replayed entry holds the same payload bytes as the recorded one.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO

import msgpack

from rollstream.shared.codec import CodecError

FORMAT = "rollstream-trajectories"
FORMAT_VERSION = 1

Fields = Mapping[bytes, bytes | str | int | float] | Mapping[str, bytes | str | int | float]


class Recorder:
    """Appends entries to a file; a context manager."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            _cut_torn_tail(self.path)  # a writer killed mid-record leaves half a record behind
        fresh = not self.path.exists() or self.path.stat().st_size == 0
        self._file: IO[bytes] = open(self.path, "ab")
        self._packer = msgpack.Packer(use_bin_type=True)
        if fresh:
            self._file.write(self._packer.pack({"format": FORMAT, "version": FORMAT_VERSION}))
        self.count = 0

    def write(self, fields: Fields) -> None:
        self._file.write(self._pack(fields))
        self.count += 1

    def write_all(self, entries: list[Fields]) -> None:
        """Append `entries` in one write and flush, so a writer killed between two entries cannot leave a group
        half recorded (as a write per entry through the 8 KB buffer could); only a kill inside that one write
        call can, and the next open cuts the torn record at the tail."""
        self._file.write(b"".join(self._pack(fields) for fields in entries))
        self._file.flush()
        self.count += len(entries)

    def _pack(self, fields: Fields) -> bytes:
        return self._packer.pack({_as_bytes(k): v for k, v in fields.items()})

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_records(path: str | os.PathLike[str]) -> Iterator[dict[bytes, bytes | str | int | float]]:
    with open(path, "rb") as f:
        unpacker = msgpack.Unpacker(f, raw=False, strict_map_key=False)
        try:
            header = next(unpacker)
        except StopIteration:
            raise CodecError(f"{path} is empty, not a {FORMAT} file") from None
        except Exception as e:
            raise CodecError(f"{path} is not a {FORMAT} file: {e}") from e
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            raise CodecError(f"{path} is not a {FORMAT} file (header {header!r:.80})")
        if header.get("version") != FORMAT_VERSION:
            raise CodecError(f"{path} has format version {header.get('version')}, expected {FORMAT_VERSION}")
        for record in unpacker:
            yield {_as_bytes(k): v for k, v in record.items()}


def _cut_torn_tail(path: Path) -> None:
    """Truncate the file after its last complete record."""
    with open(path, "rb") as f:
        unpacker = msgpack.Unpacker(f, raw=False, strict_map_key=False)
        end = 0
        try:
            for _ in unpacker:
                end = unpacker.tell()
        except ValueError:  # garbage rather than a torn record: keep what decoded
            pass
    if end < path.stat().st_size:
        os.truncate(path, end)


def _as_bytes(key: bytes | str) -> bytes:
    return key if isinstance(key, bytes) else key.encode()
