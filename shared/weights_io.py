"""Weight directories on disk: atomic publication and the digest that proves a directory is complete.

The trainer writes each policy version as a Hugging Face directory (config, safetensors, tokenizer files);
producers reload their engines from it. A reader must never see a half-written directory, so a version is
written under a temporary name and renamed into place (`atomic.staged_dir`). The digest is a sha256 over every
file's relative path and bytes, so a truncated, missing or swapped file is caught before an engine loads it.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlparse

import torch
from safetensors.torch import load_file

from rollstream.shared import atomic

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

DIGEST_PREFIX = "sha256:"
_CHUNK = 1 << 20


class WeightsDigestError(ValueError):
    """A weights directory does not match the digest it was announced with."""


def _weight_files(model_dir: Path) -> list[Path]:
    """Every regular file under the directory, in a platform-independent order."""
    files = [p for p in model_dir.rglob("*") if p.is_file()]
    return sorted(files, key=lambda p: p.relative_to(model_dir).as_posix())


def compute_digest(model_dir: str | os.PathLike[str]) -> str:
    """sha256 over (relative path, size, bytes) of every file, as "sha256:<hex>".

    Paths and sizes are hashed too, so renaming a file or moving bytes between files changes the digest.
    """
    root = Path(model_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"weights directory {str(root)!r} does not exist")
    h = hashlib.sha256()
    for path in _weight_files(root):
        h.update(path.relative_to(root).as_posix().encode())
        h.update(path.stat().st_size.to_bytes(8, "little"))
        with path.open("rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
    return DIGEST_PREFIX + h.hexdigest()


def verify_digest(model_dir: str | os.PathLike[str], digest: str) -> None:
    """Raise WeightsDigestError unless the directory's digest equals `digest`."""
    if not digest.startswith(DIGEST_PREFIX):
        raise WeightsDigestError(f"digest {digest!r} is not of the form {DIGEST_PREFIX}<hex>")
    actual = compute_digest(model_dir)
    if actual != digest:
        raise WeightsDigestError(f"weights at {str(model_dir)!r} have digest {actual}, expected {digest}")


def weights_path_from_uri(uri: str) -> Path:
    """The local directory a weights URI names: a plain path or a file:// URI (other transports download first)."""
    parsed = urlparse(uri)
    if parsed.scheme in ("", "file"):
        return Path(unquote(parsed.path) if parsed.scheme else uri)
    raise ValueError(f"weights uri {uri!r}: only local paths and file:// URIs can be loaded directly")


def write_atomically(final_dir: str | os.PathLike[str], write: Callable[[Path], None]) -> str:
    """Call `write(tmp_dir)`, then rename tmp_dir to `final_dir`; return the digest of what was written.

    A published version is immutable: an existing `final_dir` is an error.
    """
    with atomic.staged_dir(final_dir) as tmp:
        write(tmp)
        return compute_digest(tmp)


def save_pretrained_atomically(
    model: PreTrainedModel,
    final_dir: str | os.PathLike[str],
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> str:
    """Publish a transformers model (and its tokenizer) as a safetensors directory; return its digest.

    `state_dict` lets a sharded trainer pass the gathered full weights instead of the module's own.
    """

    from transformers.utils import logging as transformers_logging  # here: env-workers never import it

    # transformers draws a "Writing model shards" bar per save: one per train step on the trainer's console
    transformers_logging.disable_progress_bar()
    with atomic.staged_dir(final_dir) as tmp:
        model.save_pretrained(tmp, state_dict=state_dict)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        return compute_digest(tmp)


def load_safetensors_dir(model_dir: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """All tensors of a directory's *.safetensors files (sharded or not) as one state dict, on CPU."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {str(model_dir)!r}")
    state: dict[str, torch.Tensor] = {}
    for path in files:
        state.update(load_file(path, device="cpu"))
    return state
