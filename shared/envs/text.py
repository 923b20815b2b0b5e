"""The text the policy reads and writes: reply parsing and the per-turn user message.

A tiny model with a small context consumes this text, so every template is short.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

# A reply is `<answer>A</answer>`, optionally after one `<think>...</think>`, with only whitespace around.
# The think body may hold anything but another think/answer tag, so a reply with two answers
# (or an answer hidden inside the thought) is rejected instead of silently picking one.
_NO_TAG = r"(?:(?!</?(?:think|answer)>).)*"
_REPLY = re.compile(
    rf"\s*(?:<think>{_NO_TAG}</think>\s*)?<answer>({_NO_TAG})</answer>\s*",
    re.DOTALL,
)


def parse_action(reply: str, action_names: Sequence[str]) -> str | None:
    """The action named in a well-formed reply, spelled as in `action_names`; None for anything else."""
    match = _REPLY.fullmatch(reply)
    if match is None:
        return None
    answer = match.group(1).strip().casefold()
    for name in action_names:
        if name.casefold() == answer:
            return name
    return None


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
