"""Reply parsing and the turn prompt."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollstream.shared.envs.text import format_break, format_reply, parse_action, reply_instructions, turn_prompt

NAMES = ("Left", "Down", "Right", "Up")
TAGS = ("<think>", "</think>", "<answer>", "</answer>")


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        ("<answer>Left</answer>", "Left"),
        ("<answer>left</answer>", "Left"),
        ("<answer> RIGHT \n</answer>", "Right"),
        ("  <think>the goal is below</think> <answer>Down</answer>\n", "Down"),
        ("<think></think><answer>Up</answer>", "Up"),
        ("<think>x < 3 and y > 2</think><answer>Up</answer>", "Up"),
        ("Left", None),
        ("", None),
        ("<answer></answer>", None),
        ("<answer>Jump</answer>", None),
        ("<answer>Left Right</answer>", None),
        ("<answer>Left</answer> then Right", None),
        ("I go <answer>Left</answer>", None),
        ("<answer>Left</answer><answer>Right</answer>", None),
        ("<think>maybe <answer>Up</answer></think><answer>Left</answer>", None),
        ("<think>a</think>b</think><answer>Left</answer>", None),
        ("<answer>Left", None),
        ("<ANSWER>Left</ANSWER>", None),
        ("<answer>Left</answer></think>", None),
        ("<think>unclosed<answer>Left</answer>", None),
    ],
)
def test_parse_action_cases(reply: str, expected: str | None) -> None:
    assert parse_action(reply, NAMES) == expected


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_parse_action_never_raises_on_any_text(reply: str) -> None:
    assert parse_action(reply, NAMES) in (None, *NAMES)


# Replies built from the pieces a model actually emits, so the fuzz hits near-misses, not just noise.
_pieces = st.sampled_from([*TAGS, *NAMES, "left", "UP", " ", "\n", "x", "<", ">", "/"])


@settings(max_examples=300, deadline=None)
@given(st.lists(_pieces, max_size=12).map("".join))
def test_parse_action_never_raises_on_tag_soup(reply: str) -> None:
    action = parse_action(reply, NAMES)
    if action is not None:
        assert reply.count("<answer>") == reply.count("</answer>") == 1


_whitespace = st.text(alphabet=" \t\n", max_size=3)
_thought = st.text(max_size=40).filter(lambda t: not any(tag in t for tag in TAGS))


@st.composite
def _case_variant(draw: st.DrawFn, name: str) -> str:
    upper = draw(st.lists(st.booleans(), min_size=len(name), max_size=len(name)))
    return "".join(ch.upper() if up else ch.lower() for ch, up in zip(name, upper))


@settings(max_examples=300, deadline=None)
@given(
    name=st.sampled_from(NAMES),
    data=st.data(),
    thought=st.none() | _thought,
    spaces=st.lists(_whitespace, min_size=5, max_size=5),
)
def test_well_formed_replies_round_trip(name: str, data: st.DataObject, thought: str | None, spaces: list[str]) -> None:
    spelled = data.draw(_case_variant(name))
    think = "" if thought is None else f"<think>{thought}</think>{spaces[1]}"
    reply = f"{spaces[0]}{think}<answer>{spaces[2]}{spelled}{spaces[3]}</answer>{spaces[4]}"
    assert parse_action(reply, NAMES) == name


@given(name=st.sampled_from(NAMES), thought=st.none() | _thought)
def test_format_reply_is_the_inverse_of_parse(name: str, thought: str | None) -> None:
    assert parse_action(format_reply(name, thought), NAMES) == name


def test_turn_prompt_holds_turn_state_budget() -> None:
    prompt = turn_prompt(3, "P_\n_G", actions_left=7, max_response_tokens=64)
    assert prompt == "Turn 3\nState:\nP_\n_G\nActions left: 7. Reply in at most 64 tokens."


def test_reply_instructions_show_the_format() -> None:
    line = reply_instructions(NAMES)
    assert "<answer>Left</answer>" in line and "<think>" in line
    assert parse_action("<answer>Left</answer>", NAMES) == "Left"


END = None  # a token that ends the reply (end-of-sequence)


@pytest.mark.parametrize(
    ("pieces", "expected"),
    [
        (["<answer>", "Down", "<answer>", "Down", "<answer>"], 2),  # the second opening tag where the closing belongs
        (["<answer>", "</answer>", END], 1),  # the empty answer
        (["<answer>", "Down", "R", "ight", "</answer>"], 2),  # no action is spelled "DownR..."
        (["<answer>", "Jump", "</answer>"], 1),
        (["<answer>", "Down", END], 2),  # ended before the closing tag
        (["<answer>", "Down", "</answer>", " then"], 3),
        (["Down"], 0),
        (["<answer>", "Down", "</answer>", "\n", END], None),
        (["<think>", "a < b", "</think>", " <answer>", "up", "</answer>", END], None),
        (["<answer>", "Do", "wn"], None),  # cut off by the token cap while still on course
        ([], None),
    ],
)
def test_format_break_is_the_first_token_no_well_formed_reply_starts_with(pieces: list[str | None],
                                                                          expected: int | None) -> None:
    assert format_break(pieces, NAMES) == expected


@pytest.mark.parametrize(
    ("pieces", "expected", "by_text"),
    [
        (["<answer>", "L", "Right", "</answer>", END], 1, 2),  # `L` could begin `Left` by its text alone
        (["<answer>", "R", "Down", "</answer>", END], 1, 2),
        (["<answer>", " ", "R", "ight", "</answer>", END], 2, None),  # Right spelled in two tokens: it parses
        (["<think>", "go", "</think>", "<answer>", "Le", "ft"], 4, None),
        (["<answer>", " Right", "</answer>", END], None, None),
        (["<answer>", "right", "</answer>", END], None, None),
        (["<answer>", "Down", "<answer>"], 2, 2),  # after the answer's first token, the text rule as before
        (["<answer>", "</answer>", END], 1, 1),
        (["<answer>", "Down", END], 2, 2),
    ],
)
def test_with_whole_moves_an_answer_breaks_at_a_first_token_that_is_no_move(
        pieces: list[str | None], expected: int | None, by_text: int | None) -> None:
    """A tokenizer that spells every move in one token: the answer's first token is a move or the break."""
    assert format_break(pieces, NAMES, whole_moves=True) == expected
    assert format_break(pieces, NAMES) == by_text


def test_format_break_without_action_names_takes_any_non_empty_answer() -> None:
    assert format_break(["<answer>", "Jump", "</answer>", END], ()) is None
    assert format_break(["<answer>", " ", "</answer>"], ()) == 2


@given(name=st.sampled_from(NAMES), thought=st.none() | st.text(alphabet="ab <>/", max_size=8),
       cuts=st.lists(st.integers(min_value=0, max_value=60), max_size=6))
@settings(max_examples=200, deadline=None)
def test_a_well_formed_reply_has_no_break_however_it_is_split(name: str, thought: str | None,
                                                               cuts: list[int]) -> None:
    reply = format_reply(name, thought)
    if parse_action(reply, NAMES) is None:  # the thought happened to spell a tag
        return
    bounds = sorted({0, len(reply), *(c for c in cuts if c < len(reply))})
    pieces: list[str | None] = [reply[a:b] for a, b in zip(bounds, bounds[1:])]
    assert format_break([*pieces, END], NAMES) is None
    assert format_break([*pieces, "x"], NAMES) == len(pieces)
