"""`rollstream config show --explain`: every key with its type, default and one-line docstring, from the schema."""

from __future__ import annotations

import re
from dataclasses import MISSING, fields, is_dataclass
from typing import Any, get_args, get_origin

from rollstream.shared.config import RollstreamConfig
from rollstream.shared.config_checks import STRATEGY_OPTIONS


def explain() -> str:
    lines = ["# every key: type = default  # what it does", *_section(RollstreamConfig, "")]
    for name, options in STRATEGY_OPTIONS.items():
        if is_dataclass(options):
            lines.append(f"# strategy_config keys of {name}")
            lines += _section(options, "  ")
    return "\n".join(lines) + "\n"


def _section(cls: Any, prefix: str) -> list[str]:
    lines = []
    for f in fields(cls):
        info = cls.__pydantic_fields__[f.name]
        annotation = _strip(info.annotation)
        if is_dataclass(annotation):
            lines.append(f"{prefix}{f.name}:  # {_doc(info.description)}")
            lines += _section(annotation, prefix + "  ")
            continue
        lines.append(f"{prefix}{f.name}: {_type_name(annotation)} = {_default(f)}  # {_doc(info.description)}")
    return lines


def _strip(annotation: Any) -> Any:
    return annotation if get_origin(annotation) is not None or not get_args(annotation) else annotation


def _doc(description: str | None) -> str:
    return " ".join((description or "").split())


def _default(f: Any) -> str:
    if f.default is not MISSING:
        return repr(f.default)
    if f.default_factory is not MISSING:
        value = f.default_factory()
        return "{...}" if isinstance(value, dict) and len(repr(value)) > 40 else repr(value)
    return "(required)"


def _type_name(annotation: Any) -> str:
    text = str(annotation).replace("typing.", "")
    text = re.sub(r"Annotated\[(\w+(?:\[[^\]]*\])?), [^\]]*\]", r"\1", text)
    text = re.sub(r"<class '(\w+)'>", r"\1", text)
    return text.replace("NoneType", "None")
