"""`rollstream config show --explain`: every key with its type, default and one-line docstring, from the schema."""

from __future__ import annotations

from dataclasses import MISSING, fields, is_dataclass
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

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
        annotation = cls.__pydantic_fields__[f.name].annotation
        doc = field_doc(cls, f.name)
        if is_dataclass(_strip(annotation)):
            lines.append(f"{prefix}{f.name}:  # {doc}")
            lines += _section(_strip(annotation), prefix + "  ")
            continue
        lines.append(f"{prefix}{f.name}: {type_name(annotation)} = {_default(f)}  # {doc}")
    return lines


def field_doc(cls: Any, name: str) -> str:
    """The field's docstring, from the class or, for an inherited field, the base class that documents it."""
    for klass in cls.__mro__:
        info = getattr(klass, "__pydantic_fields__", {}).get(name)
        if info is not None and info.description:
            return " ".join(info.description.split())
    return ""


def _strip(annotation: Any) -> Any:
    """X from X | None, for sections."""
    args = [a for a in get_args(annotation) if a is not type(None)]
    return args[0] if get_origin(annotation) in (Union, UnionType) and len(args) == 1 else annotation


def _default(f: Any) -> str:
    if f.default is not MISSING:
        return repr(f.default)
    if f.default_factory is not MISSING:
        value = f.default_factory()
        return "{...}" if isinstance(value, dict) and len(repr(value)) > 40 else repr(value)
    return "(required)"


def type_name(annotation: Any) -> str:
    """A readable type: `int | None`, `'fp32' | 'bf16'`, `list[int]`."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return type_name(args[0])
    if origin in (Union, UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(type_name(a) for a in args)}]"
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation).replace("typing.", ""))
