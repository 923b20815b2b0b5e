"""The transformers backend: concurrent requests are batched, logprobs are those of a plain forward pass."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import numpy as np
import pytest
import torch

from rollstream.producer.policy.base import GenerateRequest, Generation, SamplingParams
from rollstream.producer.policy.hf import HFPolicy, _ban_bad_words
from rollstream.shared.weights_io import WeightsDigestError

from .helpers import TinyVersions, banned_tokens, most_common_word, reference_logprobs, top2_replies, until

T = TypeVar("T")
MESSAGES = [
    {"role": "system", "content": "FrozenLake: walk from P to the goal G."},
    {"role": "user", "content": "Turn 1\nState:\nP..\n.O.\n..G\nActions left: 3. Reply in at most 16 tokens."},
]


def run_with(model_dir: Path, body: Callable[[HFPolicy], Awaitable[T]]) -> T:
    """Run `body` against a fresh policy inside one event loop (the batcher task belongs to that loop)."""

    async def main() -> T:
        policy = HFPolicy(model_dir, batch_wait_s=0.02)
        try:
            return await body(policy)
        finally:
            await policy.close()

    return asyncio.run(main())


def assert_logprobs_match(model_dir: Path, prompt: np.ndarray, gen: Generation) -> None:
    ids = np.concatenate([prompt, gen.token_ids])
    positions = np.arange(len(prompt), len(ids))
    ref = reference_logprobs(model_dir, ids, positions)
    np.testing.assert_allclose(gen.logprobs, ref, atol=1e-4, rtol=0)


def test_concurrent_requests_are_batched_and_logprobs_match_a_forward_pass(tied_model: TinyVersions) -> None:
    async def body(policy: HFPolicy) -> list[tuple[np.ndarray, Generation, SamplingParams]]:
        base = np.asarray(policy.prompt_token_ids(GenerateRequest(MESSAGES, SamplingParams(8))))
        # Different prompt lengths (left padding), budgets and sampling settings share one batch.
        cases = [
            (base[: len(base) - i % 5], SamplingParams(max_tokens=4 + i % 6, temperature=(1.0, 0.7, 0.0)[i % 3],
                                                       top_k=(-1, 20)[i % 2], top_p=(1.0, 0.9)[i % 2], seed=i))
            for i in range(24)
        ]
        gens = await asyncio.gather(*[policy.generate(GenerateRequest(MESSAGES, s, prompt_ids=p)) for p, s in cases])
        assert max(policy.batch_sizes) > 1, policy.batch_sizes
        return [(p, g, s) for (p, s), g in zip(cases, gens)]

    for prompt, gen, sampling in run_with(tied_model.v0, body):
        assert 0 < len(gen.token_ids) <= sampling.max_tokens
        assert gen.finish_reason in ("stop", "length") and gen.version == 0
        assert_logprobs_match(tied_model.v0, prompt, gen)


def test_seeds_reproduce_and_temperature_zero_is_greedy(tied_model: TinyVersions) -> None:
    async def body(policy: HFPolicy) -> tuple[list[Generation], list[Generation], np.ndarray]:
        prompt = np.asarray(policy.prompt_token_ids(GenerateRequest(MESSAGES, SamplingParams(8))))
        seeded = [GenerateRequest(MESSAGES, SamplingParams(12, seed=7), prompt_ids=prompt) for _ in range(2)]
        greedy = GenerateRequest(MESSAGES, SamplingParams(12, temperature=0.0), prompt_ids=prompt)
        first = [await policy.generate(r) for r in (*seeded, greedy)]
        # The same requests again, now batched with other traffic.
        noise = [GenerateRequest(MESSAGES, SamplingParams(12), prompt_ids=prompt) for _ in range(5)]
        second = await asyncio.gather(*[policy.generate(r) for r in (*seeded, greedy, *noise)])
        return first, list(second[:3]), prompt

    first, second, prompt = run_with(tied_model.v0, body)
    assert [g.token_ids.tolist() for g in first] == [g.token_ids.tolist() for g in second]
    assert first[0].token_ids.tolist() == first[1].token_ids.tolist()
    # Greedy: every token is the argmax of the model's next-token distribution.
    greedy = first[2]
    ids = np.concatenate([prompt, greedy.token_ids])
    policy_model = HFPolicy(tied_model.v0).model
    with torch.no_grad():
        logits = policy_model(torch.as_tensor(ids[None], dtype=torch.long)).logits[0]
    argmax = logits[len(prompt) - 1 : len(ids) - 1].argmax(-1).tolist()
    assert greedy.token_ids.tolist() == argmax


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_reload_checks_the_digest_then_swaps_weights(
    tied: bool, tied_model: TinyVersions, untied_model: TinyVersions
) -> None:
    m = tied_model if tied else untied_model

    async def body(policy: HFPolicy) -> tuple[np.ndarray, Generation]:
        with pytest.raises(WeightsDigestError):
            await policy.load_weights(1, str(m.v1), "sha256:" + "0" * 64)
        assert policy.version == 0
        await policy.load_weights(1, m.v1.as_uri(), m.v1_digest)
        assert policy.version == 1
        prompt = np.asarray(policy.prompt_token_ids(GenerateRequest(MESSAGES, SamplingParams(8))))
        return prompt, await policy.generate(GenerateRequest(MESSAGES, SamplingParams(16, seed=3), prompt_ids=prompt))

    prompt, gen = run_with(m.v0, body)
    assert gen.version == 1
    assert_logprobs_match(m.v1, prompt, gen)


def test_garbage_in_and_out_never_crashes(tied_model: TinyVersions) -> None:
    garbage = [{"role": "user", "content": "\x00\ufffd<answer><think>漢字 \U0001f600 </answer>" * 5}]

    async def body(policy: HFPolicy) -> list[Generation]:
        return [await policy.generate(GenerateRequest(garbage, SamplingParams(24, seed=s))) for s in range(3)]

    for gen in run_with(tied_model.v0, body):
        assert isinstance(gen.text, str) and len(gen.token_ids) == len(gen.logprobs) > 0


def test_close_fails_waiting_requests_instead_of_hanging(tied_model: TinyVersions) -> None:
    async def body(policy: HFPolicy) -> list[BaseException | Generation]:
        requests = [GenerateRequest(MESSAGES, SamplingParams(200, seed=s)) for s in range(4)]
        pending = [asyncio.ensure_future(policy.generate(r)) for r in requests]
        await until(lambda: policy.generating)  # the first batch is on the model
        await policy.close()
        return await asyncio.wait_for(asyncio.gather(*pending, return_exceptions=True), timeout=30)

    for outcome in run_with(tied_model.v0, body):
        assert isinstance(outcome, RuntimeError) and "closed" in str(outcome)


def test_a_bad_word_is_never_generated_and_logprobs_stay_the_policys_own(tied_model: TinyVersions) -> None:
    """The token the policy samples most often, once banned, is never sampled; the logprobs stay those of the
    whole distribution (the policy's own, as vLLM's raw_logprobs)."""

    async def body(policy: HFPolicy) -> tuple[np.ndarray, set[int], list[Generation]]:
        prompt = np.asarray(policy.prompt_token_ids(GenerateRequest(MESSAGES, SamplingParams(8))))
        word = most_common_word(policy.tokenizer, await top2_replies(policy.generate, prompt, (), 8))
        return prompt, banned_tokens(policy.tokenizer, word), await top2_replies(policy.generate, prompt, (word,), 8)

    prompt, banned, gens = run_with(tied_model.v0, body)
    for gen in gens:
        assert not banned & set(gen.token_ids.tolist())
        assert_logprobs_match(tied_model.v0, prompt, gen)


def test_a_words_last_token_is_banned_only_right_after_its_others() -> None:
    logits = torch.zeros(3, 6)
    words = [[[4], [1, 2, 3]]] * 3
    _ban_bad_words(logits, words, [[], [5, 1, 2], [1, 2, 0]])
    assert torch.isinf(logits).nonzero().tolist() == [[0, 4], [1, 3], [1, 4], [2, 4]]
