"""Deleting published weight versions that no env-worker can still need."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

_VERSION_DIR = re.compile(r"v(\d+)(-resumed-from-\d+)?")


def prune_versions(weights_dir: Path, loaded: list[int], newest: int) -> list[Path]:
    """Remove v<N> directories older than every live worker's loaded version; returns what was removed.

    With no live worker nothing is removed: a worker that starts later loads the newest version, but one that
    is merely slow to beat could still be reading an older one.
    """
    if not loaded or not weights_dir.is_dir():
        return []
    keep_from = min(min(loaded), newest)
    removed = []
    for path in weights_dir.iterdir():
        match = _VERSION_DIR.fullmatch(path.name)
        if match and int(match.group(1)) < keep_from:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
