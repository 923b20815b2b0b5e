"""How a published weights directory reaches producers on hosts without the trainer's filesystem.

`weights_transport: filesystem` (default) announces the directory's file:// URI and producers read it in place.
`weights_transport: redis` also copies the directory into one Redis hash per version, `<ns>:weights:<name>`:
field `manifest` lists (relative path, size) of every file, field `<file>:<chunk>` holds up to
`weights_chunk_mb` of that file's bytes. The hash is written under a temporary key and renamed into place, so a
reader never sees a half-written version; the announced URI is `redis-chunks:<name>`. A producer downloads
the chunks into a local directory and hands that to its engine, which checks the announced digest (the same
digest as on disk: it covers every file's path and bytes) before loading.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import msgpack
import redis
import redis.asyncio

from rollstream.shared import atomic
from rollstream.shared.keys import Keys
from rollstream.shared.messages import WeightsAnnouncement
from rollstream.shared.weights_io import weights_path_from_uri

SCHEME = "redis-chunks:"
_MANIFEST = "manifest"


def share_weights(client: redis.Redis, keys: Keys, announcement: WeightsAnnouncement,
                  chunk_bytes: int) -> WeightsAnnouncement:
    """Copy the announced directory into Redis; returns the announcement with the redis-chunks URI.

    An announcement without weights (a learner with no model) is returned as it is.
    """
    if not announcement.uri:
        return announcement
    model_dir = weights_path_from_uri(announcement.uri)
    name = model_dir.name
    files = sorted((p for p in model_dir.rglob("*") if p.is_file()), key=lambda p: p.relative_to(model_dir).as_posix())
    manifest = [(p.relative_to(model_dir).as_posix(), p.stat().st_size) for p in files]
    tmp = atomic.temp_key(keys.weights_blob(name))
    try:
        for index, path in enumerate(files):
            with path.open("rb") as f:
                # One chunk per command: no single reply or request holds a whole model.
                for chunk_index, chunk in enumerate(iter(lambda: f.read(chunk_bytes), b"")):
                    client.hset(tmp, f"{index}:{chunk_index}", chunk)
        client.hset(tmp, mapping={_MANIFEST: msgpack.packb([chunk_bytes, manifest])})
        client.rename(tmp, keys.weights_blob(name))  # atomic: readers see all of it or nothing
    except BaseException:
        client.delete(tmp)
        raise
    return dataclasses.replace(announcement, uri=SCHEME + name)


async def fetch_weights(client: redis.asyncio.Redis, keys: Keys, uri: str, cache_dir: Path) -> str:
    """The file:// URI of a local copy of the announced weights: `uri` itself unless it is a redis-chunks URI,
    which is downloaded into `cache_dir/<name>` (once) first."""
    if not uri.startswith(SCHEME):
        return uri
    name = uri.removeprefix(SCHEME)
    final = cache_dir / name
    if final.is_dir():
        return final.resolve().as_uri()
    key = keys.weights_blob(name)
    raw = await client.hget(key, _MANIFEST)
    if raw is None:
        raise FileNotFoundError(f"weights {uri!r}: Redis has no key {key!r} (pruned, or Redis lost it); "
                                "waiting for the next announced version")
    chunk_bytes, manifest = msgpack.unpackb(raw)
    with atomic.staged_dir(final) as tmp:
        for index, (relative, size) in enumerate(manifest):
            target = tmp / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            with target.open("wb") as f:
                for chunk_index in range(-(-size // chunk_bytes)):
                    chunk = await client.hget(key, f"{index}:{chunk_index}")
                    if chunk is None:
                        raise FileNotFoundError(f"weights {uri!r}: chunk {index}:{chunk_index} of {relative} "
                                                "vanished during the download (pruned?)")
                    f.write(chunk)
    return final.resolve().as_uri()


def drop_downloads(cache_dir: Path, keep: str) -> None:
    """Remove every downloaded version but `keep` (the engine has read its weights into memory by now)."""
    if not cache_dir.is_dir():
        return
    for path in cache_dir.iterdir():
        if path.name != keep:
            shutil.rmtree(path, ignore_errors=True)
