"""Checks and readers of single config values, used by the schema's validators (`rollstream.shared.config`).

Each raises ValueError with what is valid; the loader prefixes the key and the value.
"""

from __future__ import annotations

import ast
import re
from typing import Any
from urllib.parse import urlsplit

REDIS_SCHEMES = ("redis", "rediss", "unix")
MAX_RANGE_BOUND = 1_000_000
"""Largest |bound| of a list(range(...)) a config may write (GPU ids are small)."""


def parse_int_list(value: Any) -> Any:
    """ROLL writes GPU lists as Python: `list(range(0,4))`, `[0,1]+list(range(4,8))`. Read those; pass the rest on."""
    if not isinstance(value, str):
        return value
    try:
        return _eval_int_list(ast.parse(value.strip(), mode="eval").body)
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError, OverflowError) as e:
        raise ValueError(f"cannot read {value!r} as a list of integers ({e}); write [0, 1, 2, 3] or "
                         "list(range(0,4))") from None


def _eval_int_list(node: ast.expr) -> list[int]:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _eval_int_list(node.left) + _eval_int_list(node.right)
    if isinstance(node, ast.List):
        return [_int_constant(e) for e in node.elts]
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "list"
            and len(node.args) == 1 and isinstance(node.args[0], ast.Call)
            and isinstance(node.args[0].func, ast.Name) and node.args[0].func.id == "range"):
        bounds = [_int_constant(a) for a in node.args[0].args]
        if not 1 <= len(bounds) <= 3 or any(abs(b) > MAX_RANGE_BOUND for b in bounds):
            raise ValueError("range() takes 1 to 3 small integers")
        return list(range(*bounds))
    raise ValueError("only integer lists, list(range(...)) and + are understood")


def _int_constant(node: ast.expr) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    raise ValueError("not an integer")


def check_exp_name(name: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}", name):
        raise ValueError("use letters, digits, '.', '_' and '-' (1 to 100, starting with a letter or digit): the "
                         "name makes Redis keys rollstream:<exp_name>:*, so a colon, a space or a glob character "
                         "(*?[]) would mix it up with other experiments' keys")
    return name


def check_bad_word(word: str) -> str:
    if not word.strip():
        raise ValueError("a bad word must hold some text: an empty one would ban nothing (vLLM refuses it); "
                         "remove it from the list")
    return word


def redact_url(url: str) -> str:
    """The URL with any password (user:password@ or ?password=) replaced by ***: for output, files and logs."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return "<unparseable URL>"
    netloc = parts.netloc
    if password is not None:
        user_info, _, host = netloc.rpartition("@")
        netloc = f"{user_info.split(':', 1)[0]}:***@{host}"
    query = re.sub(r"(^|&)(password=)[^&]*", r"\1\2***", parts.query)
    return parts._replace(netloc=netloc, query=query).geturl()


def check_redis_url(url: str | None) -> str | None:
    if url is None:
        return None
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - parsing the port raises on a bad one
    except ValueError as e:
        raise ValueError(f"not a URL ({e})") from None
    if parts.scheme not in REDIS_SCHEMES:
        raise ValueError("must be redis://[user:password@]host:port/db, rediss://... (TLS) or unix:///path/to.sock; "
                         "leave unset to start an embedded server")
    if parts.scheme != "unix" and not parts.hostname:
        raise ValueError("names no host: write redis://host:6379/0")
    if parts.scheme == "unix" and not parts.path:
        raise ValueError("names no socket path: write unix:///path/to/redis.sock")
    return url


TURN_FIELDS = ("turn_idx", "observation", "actions_left", "max_response_length")


def check_turn_template(template: str | None) -> str | None:
    if template is None:
        return None
    try:
        template.format(**{name: 1 for name in TURN_FIELDS})
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(f"cannot fill the template ({type(e).__name__}: {e}); its fields are "
                         f"{', '.join('{' + n + '}' for n in TURN_FIELDS)} (write {{{{ and }}}} for braces)") from None
    return template


def check_resume(value: Any) -> bool | str:
    if isinstance(value, (bool, str)):
        return value
    if value is None:
        return False
    raise ValueError("must be false (start fresh), true (the latest checkpoint under output_dir) or the path of a "
                     "checkpoint dir .../step_<n>")


def attn_alias(value: Any) -> Any:
    return "flash_attention_2" if value == "fa2" else value  # ROLL's name for the same kernel
