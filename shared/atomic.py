"""Things that appear whole or not at all: written under a temporary name beside their final one, then renamed.

Weight versions, checkpoints and the Redis copies of weights are all published this way. Rename is atomic within
one filesystem (and RENAME within one Redis), so a reader sees the old state or the new one, never half of it.
What a crash leaves behind carries the final name inside a recognisable temporary name (`LEFTOVER`), so pruning
can find it by the same rule as the thing itself.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_TMP, _TRASH, _KEY_TMP = ".tmp-", ".trash-", ":tmp-"


def _tag() -> str:
    return uuid.uuid4().hex[:8]


def leftover_pattern(name: str) -> str:
    """A regex for `name` itself or for what an interrupted write or replacement left of it."""
    return rf"(?:{re.escape(_TMP)}|{re.escape(_TRASH)})?{name}(?:-[0-9a-f]{{8}}|{re.escape(_KEY_TMP)}[0-9a-f]{{8}})?"


@contextmanager
def staged_dir(final_dir: str | os.PathLike[str], *, replace: bool = False) -> Iterator[Path]:
    """Yield a temporary directory to fill; when the block ends without an error it becomes `final_dir`.

    The temporary directory sits beside `final_dir` under a hidden name and is removed if the block fails. An
    existing `final_dir` is an error unless `replace`: then it is moved aside (not deleted) until the new one
    holds its name, so a crash in between leaves one of the two whole. The block may await: the rename happens
    only once it is done.
    """
    final = Path(final_dir)
    if final.exists() and not replace:
        raise FileExistsError(f"{str(final)!r} already exists and is immutable")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f"{_TMP}{final.name}-{_tag()}"
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    previous = move_aside(final) if final.exists() else None
    os.rename(tmp, final)
    if previous is not None:
        shutil.rmtree(previous, ignore_errors=True)


def move_aside(path: Path) -> Path:
    """Rename `path` to a hidden sibling (to delete), so nobody sees a half-deleted directory under its name."""
    trash = path.parent / f"{_TRASH}{path.name}-{_tag()}"
    os.rename(path, trash)
    return trash


def temp_key(key: str) -> str:
    """A temporary Redis key to build `key` under before RENAMEing it into place."""
    return f"{key}{_KEY_TMP}{_tag()}"
