"""Token-in/token-out multi-turn conversations: the exact token ids the policy saw and produced.

Re-tokenizing a whole conversation every turn can split a reply into different tokens than the ones the engine
sampled (BPE is not stable across boundaries), and then the logprobs the trainer recomputes belong to a sequence
the policy never produced. So a Conversation only ever appends: the first prompt is templated once, each reply
is appended as the engine's own token ids, and each new user turn is appended as the tokens of the chat
template's *delta* between n and n + 1 messages, computed once per tokenizer by `ChatTemplateDeltas`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rollstream.producer.policy.base import GenerateRequest, Generation

_PROBE_USER = "probe-user"
_PROBE_REPLY = "probe-reply"
_MARKER = "\x00"


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Messages templated with the generation prompt, then tokenized (the template holds the special tokens)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(str(text), add_special_tokens=False))


def request_prompt_ids(tokenizer: Any, request: GenerateRequest) -> list[int]:
    """The request's token ids, or its messages templated and tokenized when it carries none."""
    if request.prompt_ids is not None:
        return [int(t) for t in request.prompt_ids]
    return chat_prompt_ids(tokenizer, request.messages)


class ChatTemplateDeltas:
    """The token pieces of a chat template that a conversation appends between turns.

    Rendering [user, assistant] and [user, assistant, user'] and taking the string difference gives the text
    that follows an assistant message: its closing (`<|im_end|>\\n` for ChatML) then the new user message and the
    generation prompt. Templates that rewrite earlier turns (e.g. strip old thoughts) fail the prefix check
    and are refused rather than silently producing tokens the model would not see at training time.
    """

    def __init__(self, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"tokenizer {type(tokenizer).__name__} has no chat template")
        self.tokenizer = tokenizer
        base = [{"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE_REPLY}]
        before = self._render(base, add_generation_prompt=False)
        reply_end = before.rfind(_PROBE_REPLY) + len(_PROBE_REPLY)
        self.assistant_closing = before[reply_end:]
        """Template text after an assistant message's content, e.g. "<|im_end|>\\n"."""
        self.closing_ids = self.encode(self.assistant_closing)
        # Render a user message holding a marker: what surrounds the marker is the template's own text.
        after = self._render([*base, {"role": "user", "content": _MARKER}], add_generation_prompt=True)
        head, _, self._user_tail = after[reply_end:].partition(_MARKER)
        if not after.startswith(before) or not head.startswith(self.assistant_closing):
            raise ValueError(
                "the chat template re-renders earlier turns when a turn is added; token-in/token-out needs a "
                "template whose rendering of n messages is a prefix of its rendering of n + 1"
            )
        self._user_head = head[len(self.assistant_closing) :]

    def _render(self, messages: list[dict[str, str]], *, add_generation_prompt: bool) -> str:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        return str(text)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def first_prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """The opening messages (system, first user) templated, ending with the generation prompt."""
        return chat_prompt_ids(self.tokenizer, messages)

    def user_turn_ids(self, content: str, last_response_ids: np.ndarray | list[int]) -> list[int]:
        """Tokens to append after a reply: the rest of the assistant closing, the user turn, the generation prompt.

        A reply that ended with the closing's first token (the stop token, `<|im_end|>`) already holds it;
        a reply cut off by max_tokens gets the whole closing, as the template would render it.
        """
        closing = self.closing_ids
        ends_closed = len(last_response_ids) > 0 and len(closing) > 0 and int(last_response_ids[-1]) == closing[0]
        head = closing[1:] if ends_closed else closing
        return head + self.encode(self._user_head + content + self._user_tail)


@dataclass
class Conversation:
    """One episode's conversation as messages and as the token ids the policy saw, with a response mask.

    `sequence_length` caps the whole conversation: replies are limited to the room that is left, and a user turn
    that would leave no room for a reply is refused (`add_user` returns False: the episode ends `max_length`).
    """

    deltas: ChatTemplateDeltas
    sequence_length: int
    messages: list[dict[str, str]] = field(default_factory=list)
    input_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)
    """[start, end) of each reply in input_ids."""

    @classmethod
    def start(
        cls, deltas: ChatTemplateDeltas, messages: list[dict[str, str]], sequence_length: int
    ) -> Conversation:
        """A conversation opened with its system and first user messages (templated once, as a whole)."""
        conv = cls(deltas, sequence_length, messages=list(messages))
        conv._append(deltas.first_prompt_ids(conv.messages), generated=False)
        return conv

    @property
    def prompt_ids(self) -> np.ndarray:
        return np.asarray(self.input_ids, np.int32)

    @property
    def room(self) -> int:
        """How many tokens a reply may still have."""
        return self.sequence_length - len(self.input_ids)

    @property
    def over_length(self) -> bool:
        """True when no reply fits: the episode must end with reason max_length."""
        return self.room <= 0

    def reply_budget(self, max_tokens: int) -> int:
        """max_tokens for the next reply, capped by the room left under `sequence_length`."""
        return max(0, min(max_tokens, self.room))

    def add_response(self, generation: Generation) -> None:
        """Append a reply's own token ids (mask 1) and their logprobs."""
        ids = [int(t) for t in generation.token_ids]
        if len(ids) > self.room:
            raise ValueError(f"reply of {len(ids)} tokens exceeds the {self.room} left under sequence_length "
                             f"{self.sequence_length}; ask for reply_budget() tokens")
        if len(generation.logprobs) not in (0, len(ids)):
            raise ValueError(f"{len(generation.logprobs)} logprobs for {len(ids)} reply tokens")
        start = len(self.input_ids)
        lps = [float(x) for x in generation.logprobs] if len(generation.logprobs) else [0.0] * len(ids)
        self.input_ids.extend(ids)
        self.response_mask.extend([1] * len(ids))
        self.logprobs.extend(lps)
        self.spans.append((start, len(self.input_ids)))
        self.messages.append({"role": "assistant", "content": generation.text})

    def add_user(self, content: str) -> bool:
        """Append a user turn; False (and nothing appended) if it would leave no room for a reply."""
        if not self.spans:
            raise RuntimeError("add_user before any reply: open the conversation with start()")
        last_start, last_end = self.spans[-1]
        ids = self.deltas.user_turn_ids(content, self.input_ids[last_start:last_end])
        if len(self.input_ids) + len(ids) >= self.sequence_length:
            return False
        self._append(ids, generated=False)
        self.messages.append({"role": "user", "content": content})
        return True

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(input_ids int32, response_mask uint8, logprobs float32) as a Trajectory carries them."""
        return (
            np.asarray(self.input_ids, np.int32),
            np.asarray(self.response_mask, np.uint8),
            np.asarray(self.logprobs, np.float32),
        )

    def _append(self, ids: list[int], *, generated: bool) -> None:
        self.input_ids.extend(ids)
        self.response_mask.extend([int(generated)] * len(ids))
        self.logprobs.extend([0.0] * len(ids))
