"""Token-in/token-out conversations: appended turns match the chat template, replies keep their own tokens."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
from transformers import AutoTokenizer

from rollstream.producer.policy.base import Generation
from rollstream.producer.policy.conversation import ChatTemplateDeltas, Conversation

from .helpers import TinyVersions

OPENING = [
    {"role": "system", "content": "FrozenLake: walk from P to the goal G."},
    {"role": "user", "content": "Turn 1\nState:\nP..\n.O.\n..G\nActions left: 3. Reply in at most 16 tokens."},
]
SECOND = "Turn 2\nState:\n.P.\n.O.\n..G\nActions left: 2. Reply in at most 16 tokens."


@pytest.fixture(scope="module")
def tokenizer(tied_model: TinyVersions) -> Any:
    return AutoTokenizer.from_pretrained(tied_model.v0)


def _reply(tokenizer: Any, text: str, *, closed: bool = True, ids: list[int] | None = None) -> Generation:
    """A reply as an engine returns it: token ids (ending with <|im_end|> when closed) and their logprobs."""
    token_ids = list(ids if ids is not None else tokenizer.encode(text, add_special_tokens=False))
    if closed:
        token_ids.append(tokenizer.eos_token_id)
    logprobs = -np.arange(1, len(token_ids) + 1, dtype=np.float32) / 10
    return Generation(text=text, token_ids=np.asarray(token_ids, np.int32), logprobs=logprobs)


def _template_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


def test_appended_turns_equal_the_templated_conversation(tokenizer: Any) -> None:
    conv = Conversation.start(ChatTemplateDeltas(tokenizer), OPENING, sequence_length=4096)
    assert conv.input_ids == _template_ids(tokenizer, OPENING)
    conv.add_response(_reply(tokenizer, "<think>Go Right.</think><answer>Right</answer>"))
    assert conv.add_user(SECOND)
    # The reply's text tokenizes back to its own ids here, so the appended form must equal a full re-render.
    assert conv.input_ids == _template_ids(tokenizer, conv.messages)
    assert [m["role"] for m in conv.messages] == ["system", "user", "assistant", "user"]


def test_masks_spans_and_logprobs_across_turns(tokenizer: Any) -> None:
    conv = Conversation.start(ChatTemplateDeltas(tokenizer), OPENING, sequence_length=4096)
    replies = [_reply(tokenizer, "<answer>Right</answer>"), _reply(tokenizer, "<answer>Down</answer>")]
    conv.add_response(replies[0])
    conv.add_user(SECOND)
    conv.add_response(replies[1])
    ids, mask, logprobs = conv.arrays()
    assert ids.dtype == np.int32 and mask.dtype == np.uint8 and logprobs.dtype == np.float32
    assert len(ids) == len(mask) == len(logprobs)
    assert len(conv.spans) == 2
    expected_mask = np.zeros(len(ids), np.uint8)
    for (start, end), reply in zip(conv.spans, replies):
        assert ids[start:end].tolist() == reply.token_ids.tolist()
        np.testing.assert_array_equal(logprobs[start:end], reply.logprobs)
        expected_mask[start:end] = 1
    np.testing.assert_array_equal(mask, expected_mask)
    assert not logprobs[mask == 0].any()
    # The prompt of turn 2 is turn 1's prompt plus its reply: earlier tokens are never re-tokenized.
    assert ids[: conv.spans[0][1]].tolist() == _template_ids(tokenizer, OPENING) + replies[0].token_ids.tolist()


def test_reply_tokens_are_kept_even_when_not_canonical(tokenizer: Any) -> None:
    text = "<answer>Right</answer>"
    canonical = tokenizer.encode(text, add_special_tokens=False)
    # The same text spelled one character per token: an engine may sample that; re-tokenizing would hide it.
    spelled = [t for ch in "Right" for t in tokenizer.encode(ch, add_special_tokens=False)]
    odd = canonical[:1] + spelled + canonical[-1:]
    assert tokenizer.decode(odd) == text and odd != canonical
    conv = Conversation.start(ChatTemplateDeltas(tokenizer), OPENING, sequence_length=4096)
    conv.add_response(_reply(tokenizer, text, ids=odd))
    conv.add_user(SECOND)
    start, end = conv.spans[0]
    assert conv.input_ids[start:end] == [*odd, tokenizer.eos_token_id]


def test_a_cut_off_reply_is_closed_by_the_template(tokenizer: Any) -> None:
    deltas = ChatTemplateDeltas(tokenizer)
    conv = Conversation.start(deltas, OPENING, sequence_length=4096)
    conv.add_response(_reply(tokenizer, "<think>Right is", closed=False))
    end = len(conv.input_ids)
    conv.add_user(SECOND)
    # The missing <|im_end|> is added as a prompt token (mask 0), as the template renders the turn.
    assert conv.input_ids[end : end + len(deltas.closing_ids)] == deltas.closing_ids
    assert conv.input_ids[end] == tokenizer.eos_token_id
    assert conv.response_mask[end] == 0


def test_sequence_length_caps_replies_and_refuses_turns(tokenizer: Any) -> None:
    deltas = ChatTemplateDeltas(tokenizer)
    first = len(_template_ids(tokenizer, OPENING))
    reply = _reply(tokenizer, "<answer>Right</answer>")
    conv = Conversation.start(deltas, OPENING, sequence_length=first + len(reply.token_ids) + 5)
    assert conv.reply_budget(1000) == len(reply.token_ids) + 5
    with pytest.raises(ValueError, match="exceeds"):
        conv.add_response(_reply(tokenizer, "<answer>Right</answer>" * 3))
    conv.add_response(reply)
    before = copy.deepcopy(conv.input_ids)
    assert conv.add_user(SECOND) is False  # no room left for a reply: the episode ends with max_length
    assert conv.input_ids == before and conv.messages[-1]["role"] == "assistant"
    assert conv.reply_budget(16) == 5 and not conv.over_length


def test_a_template_that_rewrites_history_is_refused(tokenizer: Any) -> None:
    rewriting = copy.deepcopy(tokenizer)
    # Like templates that drop earlier assistant turns: n messages no longer render as a prefix of n + 1.
    rewriting.chat_template = (
        "{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}"
        "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    with pytest.raises(ValueError, match="prefix"):
        ChatTemplateDeltas(rewriting)
