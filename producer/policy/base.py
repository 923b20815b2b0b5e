"""The interface every inference backend implements for the env loops.

An env loop builds the conversation, asks the policy for one reply, steps the env with it and repeats.
Backends: `scripted` (seeded random valid actions, no model), `hf_infer` (transformers), `vllm`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np


@dataclass
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    """Per-request seed, so a replayed episode samples the same tokens where the backend allows it."""
    bad_words: tuple[str, ...] = ()
    """Text never to generate: a word's last token is banned right after its other tokens (vLLM's semantics)."""


@dataclass
class GenerateRequest:
    messages: list[dict[str, str]]
    """The conversation so far as chat messages (system, user, assistant, ...), ending with a user turn."""
    sampling: SamplingParams
    prompt_ids: np.ndarray | None = None
    """Token ids of the whole conversation so far, chat template applied (token-in/token-out backends)."""
    action_names: Sequence[str] = ()
    """The env's valid actions; only the scripted policy looks at them."""
    min_version: int = 0
    """The episode's admission version: a reply from older weights is refused (engine servers, which may lag)."""


@dataclass
class Generation:
    text: str
    token_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    logprobs: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    """Logprob of each sampled token under the weights that sampled it."""
    finish_reason: str = "stop"
    version: int = 0
    """Policy version of the weights that produced this reply."""


class Policy(Protocol):
    """One per worker process, shared by all of its envs."""

    @property
    def version(self) -> int:
        """The policy version currently loaded."""
        ...

    async def generate(self, request: GenerateRequest) -> Generation: ...

    async def load_weights(self, version: int, uri: str, digest: str) -> None:
        """Pause new requests, load version `version` from `uri`, check `digest`, resume."""
        ...

    async def close(self) -> None: ...
