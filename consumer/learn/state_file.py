"""Training state (state dicts, optimizer and schedule state, RNG states) in one safetensors file, without pickle.

`torch.save` writes a pickle: loading one runs whatever it names, unless `weights_only` holds (and that allows
what torch's allowlist allows). Here the tensors go into a safetensors file and the structure around them
(dicts, lists, tuples, numbers, strings, None) into its metadata as JSON, so loading executes nothing and any
reader that knows safetensors and JSON can inspect a checkpoint. Anything else is refused when saving.

In the JSON a tensor is {"$tensor": name}, a tuple {"$tuple": [...]}, and a dict whose keys are not all strings,
or whose keys start with "$", {"$items": [[key, value], ...]} (an optimizer's state is keyed by parameter index).
Tensors that are the same tensor (tied embeddings) are stored once.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

STRUCTURE_KEY = "rollstream.structure"
FORMAT_KEY = "format"
FORMAT = "rollstream-state-1"


class StateFileError(ValueError):
    """A state that cannot be stored without pickle, or a file that is not one of ours."""


def tensor_identity(tensor: torch.Tensor) -> tuple[Any, ...]:
    """Equal for two names of one tensor (tied embeddings, a shared buffer), different for distinct tensors (but
    for empty ones, whose memory address means nothing)."""
    return (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), tensor.device)


def encode(obj: Any, tensors: dict[str, torch.Tensor], seen: dict[tuple[Any, ...], str], path: str = "") -> Any:
    """`obj` as JSON-able data; its tensors are added to `tensors` (named by where they sit). Pure but for
    `tensors` and `seen` (identical tensors stored once)."""
    if isinstance(obj, torch.Tensor):
        if obj.is_sparse or obj.layout != torch.strided:
            raise StateFileError(f"{path or 'state'}: a {obj.layout} tensor cannot be stored")
        ident = tensor_identity(obj)
        if obj.numel() and ident in seen:
            return {"$tensor": seen[ident]}
        name = path or "."
        tensors[name] = obj.detach().to("cpu").contiguous()
        if obj.numel():
            seen[ident] = name
        return {"$tensor": name}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, tuple):
        return {"$tuple": [encode(v, tensors, seen, f"{path}/{i}") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [encode(v, tensors, seen, f"{path}/{i}") for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in obj):
            return {k: encode(v, tensors, seen, f"{path}/{k}") for k, v in obj.items()}
        for k in obj:
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise StateFileError(f"{path or 'state'}: dict key {k!r} ({type(k).__name__}) cannot be stored")
        return {"$items": [[k, encode(v, tensors, seen, f"{path}/{k}")] for k, v in obj.items()]}
    raise StateFileError(f"{path or 'state'}: a {type(obj).__module__}.{type(obj).__qualname__} cannot be stored "
                         "without pickle")


def decode(data: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The inverse of `encode`. Pure."""
    if isinstance(data, list):
        return [decode(v, tensors) for v in data]
    if not isinstance(data, dict):
        return data
    if "$tensor" in data:
        return tensors[data["$tensor"]]
    if "$tuple" in data:
        return tuple(decode(v, tensors) for v in data["$tuple"])
    if "$items" in data:
        return {k: decode(v, tensors) for k, v in data["$items"]}
    return {k: decode(v, tensors) for k, v in data.items()}


def save_state(obj: Any, path: str | os.PathLike[str]) -> None:
    """Write `obj` to `path` (a safetensors file). Checkpoints stage their whole directory (`atomic.staged_dir`),
    so the file itself is written in place."""
    tensors: dict[str, torch.Tensor] = {}
    structure = encode(obj, tensors, {})
    metadata = {FORMAT_KEY: FORMAT, STRUCTURE_KEY: json.dumps(structure)}
    save_file(tensors, str(path), metadata=metadata)


def load_state(path: str | os.PathLike[str], device: str | torch.device = "cpu") -> Any:
    """Read what `save_state` wrote; tensors on `device`. Executes nothing from the file."""
    with safe_open(str(path), framework="pt", device=str(device)) as f:
        metadata = f.metadata() or {}
        if metadata.get(FORMAT_KEY) != FORMAT or STRUCTURE_KEY not in metadata:
            raise StateFileError(f"{path}: not a rollstream state file (format {metadata.get(FORMAT_KEY)!r})")
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    return decode(json.loads(metadata[STRUCTURE_KEY]), tensors)
