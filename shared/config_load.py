"""Reading a config: YAML files and `key=value` overrides, merged over the schema's defaults, ROLL's keys
translated, types and ranges checked, then every check across keys. Every failure is one `ConfigError` line.

The merge is plain dicts (later wins, mappings merge key by key), except that a `custom_envs` tag written in the
config replaces its default preset whole: a tag means what its entry says, and a strategy named anew starts from
its own `strategy_config`. Interpolations (`${exp_name}`) are
resolved by omegaconf after the merge, so they may point at defaults.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any, Union, get_args, get_origin

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import TypeAdapter, ValidationError

from rollstream.shared.config import ConfigError, RollstreamConfig, as_dict
from rollstream.shared.config_checks import check_config
from rollstream.shared.config_compose import compose, interpolated_roots
from rollstream.shared.config_values import redact_url
from rollstream.shared.roll_keys import ROLL_TOP_KEYS, translate

ConfigPaths = Union[str, "os.PathLike[str]", Sequence[Union[str, "os.PathLike[str]"]], None]


@dataclass
class Loaded:
    cfg: RollstreamConfig
    notices: list[str]
    """One line per ROLL key that rollstream maps to something else (what it does instead)."""


def load(paths: ConfigPaths, overrides: Sequence[str] = ()) -> Loaded:
    files = _as_list(paths)
    user: dict[str, Any] = {}
    notices: list[str] = []
    for path in files:
        user = deep_merge(user, compose(path, read_yaml, deep_merge, notices))
    user = deep_merge(user, parse_overrides(overrides))
    if files and "actor_infer" not in user:
        raise ConfigError(f"{', '.join(map(str, files))}: no actor_infer section; without one the env-workers would "
                          "play the scripted random policy. Add actor_infer.strategy_args.strategy_name "
                          "(vllm, hf_infer or scripted), or, for a fragment, layer it after a full config: "
                          "rollstream config show FULL.yaml FRAGMENT.yaml")
    merged = _resolve(deep_merge(_defaults(user), user))
    variables = sorted((interpolated_roots(user) & set(merged)) - set(schema_keys([])) - ROLL_TOP_KEYS)
    if variables:  # Hydra-style helpers (custom_env, max_actions_per_traj, ...): read, then not config keys
        notices.append(f"{', '.join(variables)}: variables the config interpolates; not settings themselves")
        merged = {k: v for k, v in merged.items() if k not in variables}
    translated, roll_notices = translate(merged)
    notices += roll_notices
    cfg = build(translated)
    notices += check_config(cfg)
    return Loaded(cfg, notices)


def _as_list(paths: ConfigPaths) -> list[Path]:
    if paths is None:
        return []
    if isinstance(paths, (str, os.PathLike)):
        return [Path(paths)]
    return [Path(p) for p in paths]


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, reading 1e-6 as a float (YAML 1.1 wants 1.0e-6), as omegaconf does."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?|[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
               |\.[0-9_]+(?:[eE][-+][0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."),
)


def read_yaml(path: Path) -> dict[str, Any]:
    """One config file as a mapping; a missing, binary, malformed, empty or non-mapping file is one clear line."""
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {str(path)!r} is not UTF-8 text (byte {e.start}): is it a YAML file?") from None
    try:
        data = yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(path)!r}: {_describe_yaml_error(e)}") from None
    except RecursionError:
        raise ConfigError(f"config file {str(path)!r}: nested too deeply") from None
    if data is None:
        raise ConfigError(f"config file {str(path)!r} is empty; a config needs at least actor_infer "
                          "(see configs/frozen_lake_scripted.yaml)")
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} holds a {type(data).__name__}, not a mapping of keys to "
                          "values (key: value lines at the top level)")
    bad = [k for k in data if not isinstance(k, str)]
    if bad:
        raise ConfigError(f"config file {str(path)!r}: top-level key {bad[0]!r} is not a name")
    return data


def _describe_yaml_error(e: yaml.YAMLError) -> str:
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    hint = "; indent with spaces, not tabs" if "\\t" in problem or "\t" in problem else ""
    return f"YAML syntax error{where}: {problem}{hint}"


def parse_overrides(overrides: Sequence[str]) -> dict[str, Any]:
    """`a.b=value` items (values read as YAML) as one nested mapping."""
    out: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][\w-]*(\.[\w-]+)*", key):
            raise ConfigError(f"override {item!r}: write key=value, e.g. max_steps=10 or actor_train.training_args."
                              "learning_rate=1e-5")
        try:
            value = yaml.load(raw, Loader=_Loader) if raw else ""  # noqa: S506
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: {_describe_yaml_error(e)}") from None
        nested: Any = value
        for part in reversed(key.split(".")):
            nested = {part: nested}
        out = deep_merge(out, nested)
    return out


def deep_merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """`over` on `base`: mappings merge key by key, anything else is replaced. A `strategy_args` whose
    `strategy_name` changes drops the `strategy_config` below it: the other strategy's options are not this one's
    (`actor_infer.strategy_args.strategy_name=hf_infer` over a vLLM config would keep `gpu_memory_utilization`,
    which hf_infer refuses)."""
    out = dict(base)
    if "strategy_name" in over and over["strategy_name"] != base.get("strategy_name"):
        out.pop("strategy_config", None)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _defaults(user: Mapping[str, Any]) -> dict[str, Any]:
    """The schema's defaults as plain data, without the preset tags the config defines itself (an entry naming
    env_type replaces the preset; one without, e.g. an override of one env_config key, edits it)."""
    defaults = as_dict(RollstreamConfig())
    written = user.get("custom_envs")
    if isinstance(written, Mapping):
        defaults["custom_envs"] = {t: e for t, e in defaults["custom_envs"].items()
                                   if not (isinstance(written.get(t), Mapping) and "env_type" in written[t])}
    return defaults


def _resolve(data: dict[str, Any]) -> dict[str, Any]:
    """`${...}` interpolations resolved (omegaconf); everything else unchanged."""
    try:
        conf = OmegaConf.create(data)
        resolved = OmegaConf.to_container(conf, resolve=True)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"config key {key!r}: {first}" if key else f"config: {first}") from None
    assert isinstance(resolved, dict)
    return resolved  # type: ignore[return-value]  # a resolved mapping's keys are str (checked when read)


_ADAPTER = TypeAdapter(RollstreamConfig)


def build(data: Mapping[str, Any]) -> RollstreamConfig:
    """The typed config; the first type or range error as one line naming key, value and what is valid."""
    try:
        return _ADAPTER.validate_python(data)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise ConfigError(describe_error(errors[0]) + more) from None


def describe_error(error: Mapping[str, Any]) -> str:
    loc = [str(part) for part in error["loc"]]
    key = ".".join(loc)
    value = error.get("input")
    if key == "redis.url" and isinstance(value, str):
        value = redact_url(value)
    kind, ctx = error["type"], error.get("ctx") or {}
    if kind in ("unexpected_keyword_argument", "extra_forbidden"):
        parent = ".".join(loc[:-1])
        valid = ", ".join(schema_keys(loc[:-1]))
        return f"unknown key {key!r}{f' in {parent}' if parent else ''}; valid keys: {valid}"
    message = _MESSAGES.get(kind, lambda c, e: e["msg"])(ctx, error)
    if kind in _BOUNDS and _is_int(loc):
        message = message.replace("must be", "must be an integer", 1)
    return f"{key}={_short(value)}: {message}"


_BOUNDS = ("greater_than_equal", "greater_than", "less_than_equal", "less_than")


def _is_int(loc: Sequence[str]) -> bool:
    node: Any = RollstreamConfig
    for part in loc:
        node = _field_type(node, part)
    return node is int or "Annotated[int" in str(node)


_MESSAGES: dict[str, Any] = {
    "literal_error": lambda c, e: f"must be {c['expected']}",
    "greater_than_equal": lambda c, e: f"must be >= {c['ge']}",
    "greater_than": lambda c, e: f"must be > {c['gt']}",
    "less_than_equal": lambda c, e: f"must be <= {c['le']}",
    "less_than": lambda c, e: f"must be < {c['lt']}",
    "int_parsing": lambda c, e: "must be an integer",
    "int_type": lambda c, e: "must be an integer",
    "int_from_float": lambda c, e: "must be an integer",
    "float_parsing": lambda c, e: "must be a number",
    "float_type": lambda c, e: "must be a number",
    "finite_number": lambda c, e: "must be a finite number",
    "bool_parsing": lambda c, e: "must be true or false",
    "bool_type": lambda c, e: "must be true or false",
    "string_type": lambda c, e: "must be a string",
    "list_type": lambda c, e: "must be a list, e.g. [a, b]",
    "dict_type": lambda c, e: "must be a mapping (key: value lines)",
    "dataclass_type": lambda c, e: "must be a mapping (key: value lines)",
    "value_error": lambda c, e: str(e["msg"]).removeprefix("Value error, "),
}


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def schema_keys(loc: Sequence[str]) -> list[str]:
    """The keys the schema allows at `loc` (a path into RollstreamConfig)."""
    node: Any = RollstreamConfig
    for part in loc:
        node = _field_type(node, part)
    return [f.name for f in fields(node)] if is_dataclass(node) else []


def _field_type(node: Any, part: str) -> Any:
    node = _unwrap(node)
    if is_dataclass(node):
        for f in fields(node):
            if f.name == part:
                return _unwrap(getattr(node, "__pydantic_fields__")[f.name].annotation)  # noqa: B009
        return None
    if get_origin(node) is dict:
        return _unwrap(get_args(node)[1])
    return None


def _unwrap(node: Any) -> Any:
    """X from Optional[X] / X | None."""
    args = [a for a in get_args(node) if a is not type(None)]
    if get_origin(node) in (Union,) or (args and type(node).__name__ == "UnionType"):
        return args[0] if len(args) == 1 else node
    return node
