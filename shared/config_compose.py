"""ROLL's Hydra layout of a config, composed without Hydra: a `defaults:` list pulling other files, a `hydra:`
section, and top-level variables that other keys interpolate (`custom_envs: {SimpleSokoban: ${custom_env.X}}`).

A defaults entry is a path relative to the file, without `.yaml`, optionally `@_here_` (merged at the top level,
which is also what an entry without a package means for a primary config) or `@a.b` (merged under that key).
`_self_` places the file's own keys; without it they come last, as in Hydra 1.1+. Config groups with options
(`- db: mysql`) and `override` entries are Hydra command-line machinery and are refused with the rollstream way.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from rollstream.shared.config import ConfigError

Reader = Callable[[Path], dict[str, Any]]
"""Reads one YAML file as a mapping (config_load.read_yaml)."""
Merge = Callable[[Mapping[str, Any], Mapping[str, Any]], dict[str, Any]]


def compose(path: Path, read: Reader, merge: Merge, notices: list[str], _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The file with its defaults list merged in, in order; its `hydra:` section dropped with a notice."""
    resolved = path.resolve()
    if resolved in _seen:
        raise ConfigError(f"config file {str(path)!r}: its defaults list includes itself (via "
                          f"{' -> '.join(p.name for p in _seen)})")
    data = read(path)
    if "hydra" in data:
        data.pop("hydra")
        notices.append(f"{path.name}: hydra: section unused (no Hydra run dir or logging; output_dir and "
                       "logging_dir say where files go)")
    defaults = data.pop("defaults", None)
    if defaults is None:
        return data
    if not isinstance(defaults, list):
        raise ConfigError(f"config file {str(path)!r}: defaults must be a list of files, got {defaults!r}")
    out: dict[str, Any] = {}
    entries = defaults if "_self_" in defaults else [*defaults, "_self_"]
    for entry in entries:
        if entry == "_self_":
            out = merge(out, data)
            continue
        target, package = _entry(path, entry)
        included = compose(target, read, merge, notices, (*_seen, resolved))
        out = merge(out, _place(included, package))
    return out


def _entry(path: Path, entry: Any) -> tuple[Path, str]:
    if isinstance(entry, dict) and any(str(k).startswith("override ") for k in entry):
        entry = next(iter(entry))
    if not isinstance(entry, str):
        raise ConfigError(f"config file {str(path)!r}: defaults entry {entry!r} selects a Hydra config-group "
                          "option; rollstream composes files only: write the file's path, e.g. "
                          "- ../config/traj_envs@_here_")
    if entry.startswith("override "):
        raise ConfigError(f"config file {str(path)!r}: defaults entry {entry!r}: Hydra overrides are not read; "
                          "set the keys directly, or pass key=value after the config file")
    name, _, package = entry.partition("@")
    if not re.fullmatch(r"[\w./-]+", name):
        raise ConfigError(f"config file {str(path)!r}: defaults entry {entry!r} is not a file path")
    target = (path.parent / name).with_suffix(".yaml") if not name.endswith((".yaml", ".yml")) \
        else path.parent / name
    if not target.is_file():
        raise ConfigError(f"config file {str(path)!r}: defaults entry {entry!r}: no file {str(target)!r}")
    return target, package


def _place(data: dict[str, Any], package: str) -> dict[str, Any]:
    if package in ("", "_here_", "_global_"):
        return data
    for part in reversed(package.split(".")):
        data = {part: data}
    return data


def interpolated_roots(node: Any) -> set[str]:
    """Top-level keys that `${...}` interpolations anywhere in `node` point at (`${custom_env.X}` -> custom_env)."""
    if isinstance(node, str):
        return set(re.findall(r"\$\{\s*([A-Za-z_][\w-]*)", node))
    if isinstance(node, Mapping):
        return set().union(*(interpolated_roots(v) for v in node.values())) if node else set()
    if isinstance(node, list):
        return set().union(*(interpolated_roots(v) for v in node)) if node else set()
    return set()
