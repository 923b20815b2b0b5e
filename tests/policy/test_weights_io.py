"""Weight directories: atomic publication and digests that catch any change."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rollstream.shared.weights_io import (
    WeightsDigestError,
    compute_digest,
    load_safetensors_dir,
    verify_digest,
    weights_path_from_uri,
    write_atomically,
)

from .helpers import TinyVersions


def _write_files(files: dict[str, bytes]):  # noqa: ANN202 - a tiny local writer
    def write(tmp: Path) -> None:
        for name, data in files.items():
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp / name).write_bytes(data)

    return write


def test_atomic_write_publishes_a_complete_directory(tmp_path: Path) -> None:
    digest = write_atomically(tmp_path / "v1", _write_files({"a.bin": b"abc", "sub/b.json": b"{}"}))
    assert sorted(os.listdir(tmp_path)) == ["v1"]  # no temporary directory left behind
    assert digest == compute_digest(tmp_path / "v1")
    verify_digest(tmp_path / "v1", digest)
    with pytest.raises(FileExistsError, match="immutable"):
        write_atomically(tmp_path / "v1", _write_files({"a.bin": b"new"}))


def test_a_failed_write_leaves_nothing(tmp_path: Path) -> None:
    def fail(tmp: Path) -> None:
        (tmp / "half.bin").write_bytes(b"x")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomically(tmp_path / "v2", fail)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "change",
    [
        {"a.bin": b"abd"},  # a flipped byte
        {"a.bin": b"ab"},  # a truncated file
        {"a.bin": b"abc", "extra.bin": b""},  # an added (even empty) file
    ],
)
def test_the_digest_catches_changes(tmp_path: Path, change: dict[str, bytes]) -> None:
    digest = write_atomically(tmp_path / "v", _write_files({"a.bin": b"abc"}))
    for name, data in change.items():
        (tmp_path / "v" / name).write_bytes(data)
    with pytest.raises(WeightsDigestError, match="expected"):
        verify_digest(tmp_path / "v", digest)


def test_a_renamed_file_changes_the_digest(tmp_path: Path) -> None:
    a = write_atomically(tmp_path / "a", _write_files({"x.bin": b"1", "y.bin": b"2"}))
    b = write_atomically(tmp_path / "b", _write_files({"x.bin": b"2", "y.bin": b"1"}))
    assert a != b
    with pytest.raises(WeightsDigestError, match="sha256"):
        verify_digest(tmp_path / "a", "md5:0")


def test_published_model_round_trips(tied_model: TinyVersions) -> None:
    verify_digest(tied_model.v1, tied_model.v1_digest)
    state = load_safetensors_dir(tied_model.v1)
    assert "model.embed_tokens.weight" in state
    assert "lm_head.weight" not in state  # tied: the checkpoint carries the embedding once


def test_uris(tmp_path: Path) -> None:
    assert weights_path_from_uri(str(tmp_path)) == tmp_path
    assert weights_path_from_uri(tmp_path.as_uri()) == tmp_path
    with pytest.raises(ValueError, match="file://"):
        weights_path_from_uri("redis://host/weights/3")
