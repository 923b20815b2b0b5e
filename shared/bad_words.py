"""Banned words (`actor_infer.generating_args.bad_words`) as token ids: what the transformers backend bans, what the
trainer's loss masks (so that the policy trained is the policy sampled), and what vLLM computes for itself (tested
equal)."""

from __future__ import annotations

from typing import Any


def bad_word_ids(tokenizer: Any, words: tuple[str, ...]) -> list[list[int]]:
    """Token ids of each bad word, and of its space-prefixed form where that is other tokens of the same count:
    the forms vLLM bans. A word's last token is banned right after its other tokens."""
    forms: list[list[int]] = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not bare:
            raise ValueError(f"bad word {word!r} is no token of this tokenizer: remove it from bad_words")
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        forms += [bare] + ([spaced] if len(spaced) == len(bare) and spaced[0] != bare[0] else [])
    return forms
