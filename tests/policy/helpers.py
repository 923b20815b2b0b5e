"""Tiny models for the policy tests: built offline, with a published "next version" of each."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from rollstream.producer.policy.base import GenerateRequest, Generation, SamplingParams
from rollstream.shared.bad_words import bad_word_ids
from rollstream.shared.weights_io import save_pretrained_atomically
from rollstream.tiny_model import build_tiny_model


@dataclass(frozen=True)
class TinyVersions:
    """A tiny model at version 0 and the same model perturbed as a trainer would publish it at version 1."""

    v0: Path
    v1: Path
    v1_digest: str
    tied: bool


def publish_perturbed(src: Path, dst: Path, seed: int) -> str:
    """Write `src`'s weights plus noise to `dst` as the trainer publishes a version; returns the digest."""
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return save_pretrained_atomically(model, dst)


def tiny_versions(root: Path, tied: bool) -> TinyVersions:
    v0 = build_tiny_model(root / "v0", tie_word_embeddings=tied, corpus_episodes=50)
    digest = publish_perturbed(v0, root / "v1", seed=1)
    return TinyVersions(v0, root / "v1", digest, tied)


def reference_logprobs(model_dir: Path, input_ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """log p(input_ids[t] | input_ids[:t]) at each t in `positions`, from one unpadded transformers forward."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.from_numpy(np.array(input_ids, dtype=np.int64))  # a copy: decoded arrays are read-only views
    with torch.no_grad():
        logp = model(ids[None]).logits[0].float().log_softmax(-1)
    pos = torch.from_numpy(np.array(positions, dtype=np.int64))
    return logp[pos - 1, ids[pos]].numpy()


async def until(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Wait for `condition` to hold (checked at every turn of the event loop), or fail after timeout_s."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        assert loop.time() < deadline, f"condition not met within {timeout_s} s"
        await asyncio.sleep(0.001)


async def top2_replies(generate: Callable[[GenerateRequest], Awaitable[Generation]], prompt: np.ndarray,
                       bad_words: tuple[str, ...], n: int) -> list[Generation]:
    """`n` seeded replies at top_k 2: each step a choice between two tokens, so a banned one would come up often."""
    requests = [GenerateRequest([], SamplingParams(12, top_k=2, seed=s, bad_words=bad_words), prompt_ids=prompt)
                for s in range(n)]
    return list(await asyncio.gather(*map(generate, requests)))


def banned_tokens(tokenizer: Any, word: str) -> set[int]:
    """The tokens a ban on `word` forbids: the last of each of its forms."""
    return {ids[-1] for ids in bad_word_ids(tokenizer, (word,))}


def most_common_word(tokenizer: Any, gens: list[Generation]) -> str:
    """The text of the most often sampled token that tokenizes back to itself alone, as a bad word would."""
    counts = Counter(t for g in gens for t in g.token_ids.tolist())
    for token, _ in counts.most_common():
        word = str(tokenizer.decode([token]))
        if word.strip() and bad_word_ids(tokenizer, (word,))[0] == [token]:
            return word
    raise AssertionError(f"no sampled token is a word of its own: {counts}")
