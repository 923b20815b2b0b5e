"""User code named in a config by an import path `package.module:Name` (env types, group filters)."""

from __future__ import annotations

import importlib
from functools import reduce
from typing import Any


def is_import_path(spec: str) -> bool:
    module_name, sep, attr = spec.partition(":")
    return bool(sep and module_name and attr)


def import_object(spec: str, key: str) -> Any:
    """The object `package.module:Name` (Name may be dotted) names; ValueError naming `key` if it cannot be had."""
    if not is_import_path(spec):
        raise ValueError(f"{key} {spec!r} is not an import path 'package.module:Name'")
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{key} {spec!r}: cannot import module {module_name!r} ({e})") from e
    try:
        return reduce(getattr, attr.split("."), module)
    except AttributeError as e:
        raise ValueError(f"{key} {spec!r}: module {module_name!r} has no attribute {attr!r}") from e
