"""Deleting published weight versions that no env-worker can still need: directories, and Redis copies."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import redis

from rollstream.shared import atomic
from rollstream.shared.keys import Keys

_VERSION_NAME = re.compile(atomic.leftover_pattern(r"v(\d+)(?:-resumed-from-\d+)?"))
"""A published version (v<N>, v<N>-resumed-from-<S>), or what an interrupted write left of one (a temporary or
moved-aside directory, a temporary Redis key: `atomic`). The trainer prunes after its own writes have finished, so
a leftover of a version no worker can need is garbage, whatever state it was left in."""


def _prunable(name: str, loaded: list[int], newest: int) -> bool:
    """A version older than every live worker's loaded version. With no live worker nothing is: a worker that
    starts later loads the newest version, but one that is merely slow to beat could still be reading an older one."""
    match = _VERSION_NAME.fullmatch(name)
    return bool(loaded) and match is not None and int(match.group(1)) < min(min(loaded), newest)


def prune_versions(weights_dir: Path, loaded: list[int], newest: int) -> list[Path]:
    """Remove v<N> directories no live worker can need; returns what was removed."""
    if not weights_dir.is_dir():
        return []
    removed = [path for path in weights_dir.iterdir() if _prunable(path.name, loaded, newest)]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def prune_redis_versions(client: redis.Redis, keys: Keys, loaded: list[int], newest: int) -> list[str]:
    """Delete the Redis copies (weights_transport: redis) of versions no live worker can need."""
    prefix = keys.weights_blob("")
    removed = [key.decode() for key in client.scan_iter(match=keys.weights_blob_pattern, count=1000)
               if _prunable(key.decode().removeprefix(prefix), loaded, newest)]
    if removed:
        client.delete(*removed)
    return removed
