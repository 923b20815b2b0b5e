"""The text the policy reads and writes: reply parsing and the per-turn user message.

A tiny model with a small context consumes this text, so every template is short.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence

import regex

# A reply is `<answer>A</answer>`, optionally after one `<think>...</think>`, with only whitespace around.
# The think body may hold anything but another think/answer tag, so a reply with two answers
# (or an answer hidden inside the thought) is rejected instead of silently picking one.
_NO_TAG = r"(?:(?!</?(?:think|answer)>).)*"
_OPENING = rf"\s*(?:<think>{_NO_TAG}</think>\s*)?<answer>"
"""A reply up to its answer: an optional think, then the opening tag."""
_REPLY = re.compile(
    rf"{_OPENING}({_NO_TAG})</answer>\s*",
    re.DOTALL,
)
_OPENED_ANSWER = regex.compile(rf"{_OPENING}\s*", regex.DOTALL)
"""A reply written up to its answer's first character."""


def compile_action_pattern(pattern: str | None) -> re.Pattern[str] | None:
    """ROLL's env_config.action_pattern, e.g. `<answer>(.*?)</answer>`; a bad regex is a ValueError."""
    if pattern is None:
        return None
    if not isinstance(pattern, str):
        raise ValueError(f"action_pattern must be a regular expression string, got {pattern!r}")
    try:
        return re.compile(pattern, re.DOTALL)
    except re.error as e:
        raise ValueError(f"action_pattern {pattern!r} is not a regular expression ({e})") from None


def parse_action(reply: str, action_names: Sequence[str], pattern: re.Pattern[str] | None = None) -> str | None:
    """The action named in a well-formed reply, spelled as in `action_names`; None for anything else.

    With `pattern` (ROLL's action_pattern) the first match anywhere in the reply is read, as ROLL does: its first
    group, or the whole match when it has none."""
    if pattern is not None:
        found = pattern.search(reply)
        answer = (found.group(1) if found and pattern.groups else found.group(0) if found else None)
        return _named_action(answer, action_names)
    match = _REPLY.fullmatch(reply)
    return None if match is None else _named_action(match.group(1), action_names)


def _named_action(answer: str | None, action_names: Sequence[str]) -> str | None:
    if answer is None:
        return None
    answer = answer.strip().casefold()
    for name in action_names:
        if name.casefold() == answer:
            return name
    return None


def format_break(pieces: Sequence[str | None], action_names: Sequence[str], *, whole_moves: bool = False) -> int | None:
    """Where a reply first left the reply format: the index of the first of its tokens' `pieces` (each token's
    text; None for a token that ends the reply, end-of-sequence) after which no well-formed reply naming one of
    `action_names` begins with what was written. None when there is no such token: the reply is well formed, or it
    was cut off by the token cap while it could still have become one.

    `<answer>Down<answer>Down...`: the second `<answer>`; `<answer></answer>`: the `</answer>`; `<answer>Down`
    then end-of-sequence: the end. With no `action_names` any non-empty answer counts as one.

    `whole_moves`: the tokenizer spells each of `action_names` in one token, so a well-formed reply's answer begins
    with one of those tokens, and an answer begun with any other (`L` then `Right`) left the format at that token,
    though its text alone (`L`, the start of `Left`) could still have become a move."""
    prefix = _reply_pattern(tuple(action_names))
    moves = {name.casefold() for name in action_names} if whole_moves else set()
    text = ""
    for i, piece in enumerate(pieces):
        if piece is None:
            return None if prefix.fullmatch(text) else i
        if moves and (word := piece.strip().casefold()) and word not in moves and _OPENED_ANSWER.fullmatch(text):
            return i
        text += piece
        if prefix.fullmatch(text, partial=True) is None:
            return i
    return None


@functools.cache
def _reply_pattern(action_names: tuple[str, ...]) -> regex.Pattern[str]:
    """A well-formed reply naming one of `action_names`, in the `regex` package's dialect: its partial matching
    says whether a text can still be extended into a match."""
    any_answer = rf"{_NO_TAG}(?!</?(?:think|answer)>)\S{_NO_TAG}"
    answer = "|".join(regex.escape(name) for name in action_names) if action_names else any_answer
    return regex.compile(rf"{_OPENING}\s*(?i:{answer})\s*</answer>\s*",
                         regex.DOTALL)


def answer_token(pieces: Sequence[str | None]) -> int | None:
    """Which of a well-formed reply's tokens (their text `pieces`; None for a special token such as
    end-of-sequence) holds the first character of the answer: the token at which the policy chose its action
    (`<answer>` `R` `ight` `</answer>`: `R`). None when the pieces do not spell a well-formed reply."""
    texts = [piece or "" for piece in pieces]
    match = _REPLY.fullmatch("".join(texts))
    if match is None:
        return None
    answer = match.group(1)
    first = match.start(1) + len(answer) - len(answer.lstrip())
    end = 0
    for i, text in enumerate(texts):
        end += len(text)
        if end > first:
            return i
    return None


def opens_think(reply: str) -> bool:
    """The reply starts with a `<think>` (well-formed or not): the share of such replies shows which path a
    policy takes, since greedy decoding can settle on a think path that sampling rarely shows."""
    return reply.lstrip().startswith("<think>")


def format_reply(action: str, think: str | None = None) -> str:
    """A well-formed reply for `action` (the inverse of `parse_action`; scripted policies and SFT data use it)."""
    thought = "" if think is None else f"<think>{think}</think>"
    return f"{thought}<answer>{action}</answer>"


def reply_instructions(action_names: Sequence[str]) -> str:
    """The reply-format line of a system prompt."""
    example = action_names[0] if action_names else "Action"
    return (
        f"Reply with exactly one action as <answer>{example}</answer>, "
        "optionally after a short <think>...</think>."
    )


def turn_prompt(turn: int, observation: str, actions_left: int, max_response_tokens: int) -> str:
    """The user message of one turn: turn number (from 1), the state, actions left and the reply budget."""
    return (
        f"Turn {turn}\n"
        f"State:\n{observation}\n"
        f"Actions left: {actions_left}. Reply in at most {max_response_tokens} tokens."
    )
