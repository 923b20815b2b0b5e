"""Padding, target alignment, per-token advantages and the micro-batch plan."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from rollstream.consumer.learn.tensors import (
    TokenBatch,
    build_token_batch,
    microbatch_indices,
    minibatch_indices,
    plan_shards,
    token_advantages,
)

from .helpers import make_trajectory


def two_turns():
    # prompt 0-1, reply 2-3, user 4, reply 5-6
    return make_trajectory(0, 0, [10, 11, 12, 13, 14, 15, 16], [(2, 4), (5, 7)],
                           {2: -0.2, 3: -0.3, 5: -0.5, 6: -0.6}, [("a", 0.0), ("b", 1.0)])


def test_token_advantages_broadcast_or_per_turn() -> None:
    t = two_turns()
    np.testing.assert_array_equal(token_advantages(t, 2.0), [0, 0, 2, 2, 0, 2, 2])
    np.testing.assert_array_equal(token_advantages(t, np.array([1.0, -1.0])), [0, 0, 1, 1, 0, -1, -1])


def test_token_batch_is_aligned_on_targets_and_padded() -> None:
    long, short = two_turns(), make_trajectory(0, 1, [20, 21, 22], [(2, 3)], {2: -1.0}, [("a", 0.0)])
    tb = build_token_batch([long, short], [np.array([1.0, -1.0]), 3.0], pad_id=0)
    assert tb.input_ids.shape == (2, 7) and tb.response_mask.shape == (2, 6)
    # Column j is about token j + 1: the reply tokens at 2, 3, 5, 6 are targets 1, 2, 4, 5.
    np.testing.assert_array_equal(tb.response_mask[0], [0, 1, 1, 0, 1, 1])
    np.testing.assert_allclose(tb.behaviour_logprobs[0], [0, -0.2, -0.3, 0, -0.5, -0.6])
    np.testing.assert_allclose(tb.advantages[0], [0, 1, 1, 0, -1, -1])
    np.testing.assert_array_equal(tb.attention_mask[1], [1, 1, 1, 0, 0, 0, 0])
    np.testing.assert_array_equal(tb.response_mask[1], [0, 1, 0, 0, 0, 0])
    np.testing.assert_allclose(tb.advantages[1], [0, 3, 0, 0, 0, 0])
    assert tb.num_response_tokens == 5
    # Selecting rows trims the padding to the longest selected row.
    only_short = tb.rows([1])
    assert only_short.input_ids.shape == (1, 3) and only_short.advantages.shape == (1, 2)


def test_the_tokens_of_an_unparsed_reply_are_marked() -> None:
    t = two_turns()
    t.turns[1] = dataclasses.replace(t.turns[1], action_is_valid=False)  # the second reply (tokens 5-6) broke
    tb = build_token_batch([t, two_turns()], [0.0, 0.0])
    assert tb.unparsed_mask is not None
    np.testing.assert_array_equal(tb.unparsed_mask[0], [0, 0, 0, 0, 1, 1])  # targets 4, 5: tokens 5, 6
    np.testing.assert_array_equal(tb.unparsed_mask[1], [0] * 6)
    np.testing.assert_array_equal(tb.rows([0]).unparsed_mask, tb.unparsed_mask[:1])


def test_the_advantage_ends_at_a_replys_format_break() -> None:
    """`format_break_ends_advantage`: the first reply (tokens 2-3) broke at token 3: tokens 3 to the reply's end
    lose their advantage, the token before the break and the other reply keep theirs, and the break stays marked."""
    t = two_turns()
    t.turns[0] = dataclasses.replace(t.turns[0], action_is_valid=False)
    advantages = [np.array([1.0, -1.0])]
    kept = build_token_batch([t], advantages, breaks=[[3]])
    ended = build_token_batch([t], advantages, breaks=[[3]], advantage_ends_at_breaks=True)
    np.testing.assert_allclose(kept.advantages[0], [0, 1, 1, 0, -1, -1])
    np.testing.assert_allclose(ended.advantages[0], [0, 1, 0, 0, -1, -1])  # target 2 is token 3
    assert ended.break_mask is not None
    np.testing.assert_array_equal(ended.break_mask[0], [0, 0, 1, 0, 0, 0])
    longer = make_trajectory(0, 1, [10, 11, 12, 13, 14, 15], [(2, 6)], {k: -0.1 for k in range(2, 6)}, [("a", 1.0)])
    ended = build_token_batch([longer], [2.0], breaks=[[3]], advantage_ends_at_breaks=True)
    np.testing.assert_allclose(ended.advantages[0], [0, 2, 0, 0, 0])  # tokens 3, 4, 5: from the break on


def test_whitening_and_clipping_apply_to_response_tokens_only() -> None:
    long, short = two_turns(), make_trajectory(0, 1, [20, 21, 22], [(2, 3)], {2: -1.0}, [("a", 0.0)])
    tb = build_token_batch([long, short], [5.0, -5.0], whiten=True, clip=1.5)
    on = tb.advantages[tb.response_mask > 0]
    # Response-token values [5, 5, 5, 5, -5] whiten to [0.5, 0.5, 0.5, 0.5, -2.0] -> clipped at -1.5.
    np.testing.assert_allclose(on, [0.5, 0.5, 0.5, 0.5, -1.5], atol=1e-6)
    assert float(tb.advantages[tb.response_mask == 0].abs().sum()) == 0.0


def test_microbatches_by_token_budget() -> None:
    lengths = [10, 3, 7, 2]
    plan = microbatch_indices(lengths, torch.arange(4), max_tokens=14, max_rows=99)
    assert [b.tolist() for b in plan] == [[0], [2, 1], [3]]
    assert all(len(b) * max(lengths[i] for i in b.tolist()) <= 14 or len(b) == 1 for b in plan)
    by_rows = microbatch_indices(lengths, torch.tensor([3, 1, 0]), max_tokens=0, max_rows=2)
    assert [b.tolist() for b in by_rows] == [[3, 1], [0]]


def test_minibatches_cover_every_row_once() -> None:
    parts = minibatch_indices(10, 4, torch.Generator().manual_seed(0))
    assert [len(p) for p in parts] == [4, 4, 2]
    assert sorted(torch.cat(parts).tolist()) == list(range(10))


def synthetic_batch(lengths: list[int], response_tokens: int = 2) -> TokenBatch:
    """Rows of the given lengths, each ending in `response_tokens` generated tokens."""
    width = max(lengths)
    attention = torch.tensor([[1] * n + [0] * (width - n) for n in lengths])
    response = torch.zeros(len(lengths), width - 1)
    for row, n in enumerate(lengths):
        response[row, n - 1 - response_tokens:n - 1] = 1.0
    return TokenBatch(input_ids=torch.zeros(len(lengths), width, dtype=torch.long), attention_mask=attention,
                      response_mask=response, behaviour_logprobs=-response, advantages=response.clone())


def test_ranks_with_fewer_microbatches_are_padded_to_the_most() -> None:
    """One long row against three short ones: balanced by tokens, rank 0 gets the long row alone (one micro-batch)
    and rank 1 the short ones, which a 20-token budget packs into two; rank 0 must pad one backward."""
    tokens = synthetic_batch([100, 10, 10, 10])
    one, = plan_shards(tokens, 1, epochs=1, minibatch_size=4, generator=torch.Generator().manual_seed(0),
                       max_tokens=20, max_rows=99)
    rank0, rank1 = plan_shards(tokens, 2, epochs=1, minibatch_size=4, generator=torch.Generator().manual_seed(0),
                               max_tokens=20, max_rows=99)
    assert rank0.tokens.num_rows == 1 and rank1.tokens.num_rows == 3
    (step0,), (step1,) = rank0.steps, rank1.steps
    assert [len(m) for m in step0.microbatches] == [1] and [len(m) for m in step1.microbatches] == [2, 1]
    assert step0.num_microbatches == step1.num_microbatches == 2  # rank 0 runs one zero-weight backward
    assert step0.normalizer == step1.normalizer == one.steps[0].normalizer == 8.0  # the whole mini-batch's tokens
    assert rank0.num_logprob_microbatches == rank1.num_logprob_microbatches == 2


def test_skipped_rows_keep_the_steps_and_their_token_counts() -> None:
    """Rows left out (zero gradient) run no forward or backward, but every mini-batch stays a step with the whole
    mini-batch's token count; a rank (or a step) left with nothing runs one zero-weight backward."""
    tokens = synthetic_batch([30, 10, 10, 10, 20, 20])
    trained = torch.tensor([True, False, False, False, False, False])
    plan = {"epochs": 2, "minibatch_size": 2, "max_tokens": 40, "max_rows": 99}
    full, = plan_shards(tokens, 1, generator=torch.Generator().manual_seed(0), **plan)
    one, = plan_shards(tokens, 1, generator=torch.Generator().manual_seed(0), trained=trained, **plan)
    ranks = plan_shards(tokens, 2, generator=torch.Generator().manual_seed(0), trained=trained, **plan)
    assert [s.normalizer for s in one.steps] == [s.normalizer for s in full.steps] \
        == [s.normalizer for s in ranks[0].steps] == [s.normalizer for s in ranks[1].steps]
    assert len(one.steps) == 6 and all(s.num_microbatches >= 1 for s in one.steps)
    computed = [int(r) for s in one.steps for m in s.microbatches for r in m]
    assert computed == [0, 0]  # the trained row, once per epoch, by its index in the whole batch
    assert one.tokens is tokens and [m.tolist() for m in one.logprob_microbatches] == [[0]]
    assert sorted(r.tokens.num_rows for r in ranks) == [0, 1]
    for step0, step1 in zip(ranks[0].steps, ranks[1].steps):
        assert step0.num_microbatches == step1.num_microbatches >= 1
