"""Random mutations of a valid config, loaded as a file: it loads, or fails with one ConfigError that names the
mutated key. Never any other exception (a traceback at the CLI edge)."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollstream.shared.config import ConfigError, load_config
from tests.conftest import REPO

BASE = yaml.safe_load((REPO / "configs" / "frozen_lake_scripted.yaml").read_text())
BASE["val_env_manager"] = {"max_env_num_per_worker": 8, "num_env_groups": 4, "group_size": 1,
                           "tags": ["SimpleSokoban", "FrozenLake"]}
BASE["eval_steps"] = 5


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every key path of the config (list items by index), sections included."""
    out = []
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else []
    for key, child in items:
        out.append((*prefix, key))
        out += _paths(child, (*prefix, key))
    return out


PATHS = _paths(BASE)

VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-10, 10), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
    st.text(max_size=12), st.sampled_from(["", "list(range(0,4))", "${nope}", "${exp_name}", "-1", "1e400",
                                           "fp16", "vllm", "a:b", "redis://x", "unix://", "*"]),
    st.lists(st.integers(-3, 9), max_size=4), st.dictionaries(st.sampled_from(["a", "size", "tags"]),
                                                              st.integers(-2, 5), max_size=2),
)


def _mutate(data: dict[str, Any], path: tuple[Any, ...], op: str, value: Any) -> dict[str, Any]:
    copy = yaml.safe_load(yaml.safe_dump(data))
    parent = copy
    for key in path[:-1]:
        parent = parent[key]
    if op == "delete":
        del parent[path[-1]]
    elif op == "unknown" and isinstance(parent, dict):
        parent[f"{path[-1]}_typo"] = value
    else:
        parent[path[-1]] = value
    return copy


def _named(path: tuple[Any, ...], op: str) -> list[str]:
    """Words one of which the error must contain: the mutated key's name (or the typo'd key's)."""
    names = [str(p) for p in path if isinstance(p, str)]
    if op == "unknown":
        return [f"{path[-1]}_typo"] if isinstance(path[-1], str) else names
    return names[-1:]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(path=st.sampled_from(PATHS), op=st.sampled_from(["set", "set", "delete", "unknown"]), value=VALUES)
def test_a_mutated_config_loads_or_names_the_key(path: tuple[Any, ...], op: str, value: Any) -> None:
    if isinstance(value, float) and not math.isfinite(value) and op == "unknown":
        value = str(value)
    data = _mutate(BASE, path, op, value)
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / "mutated.yaml"
        file.write_text(yaml.safe_dump(data))
        try:
            load_config(file)
        except ConfigError as e:
            message = str(e)
            assert "\n" not in message, message
            assert any(name in message for name in _named(path, op)), (path, op, value, message)
