"""A seeded scripted policy: uniformly random valid actions, no model. Stands in for an LLM in tests and demos.

Each reply is a pure function of the request's seed, so a replayed episode replays exactly.
"""

from __future__ import annotations

import asyncio

import numpy as np

from rollstream.producer.policy.base import GenerateRequest, Generation
from rollstream.shared.envs.text import format_reply


class ScriptedPolicy:
    def __init__(self, *, invalid_reply_rate: float = 0.0, delay_s: float = 0.0, turn_latency_s: float = 0.0) -> None:
        self.invalid_reply_rate = invalid_reply_rate
        """Share of replies that are deliberately garbage, to exercise the format penalty."""
        self.delay_s = delay_s
        """Mean seconds per reply (uniform in [0, 2 * delay_s]), to stand in for generation time."""
        self.turn_latency_s = turn_latency_s
        """Fixed seconds added to every reply: a generation time without jitter, for benchmarks."""
        self._version = 0

    @property
    def version(self) -> int:
        return self._version

    async def generate(self, request: GenerateRequest) -> Generation:
        if not request.action_names:
            raise ValueError("the scripted policy needs the env's action_names in the request")
        rng = np.random.default_rng(request.sampling.seed)
        delay = self.turn_latency_s + (2 * self.delay_s * rng.random() if self.delay_s else 0.0)
        if delay:
            await asyncio.sleep(delay)
        if rng.random() < self.invalid_reply_rate:
            return Generation(text="I am not sure what to do.", version=self._version)
        action = request.action_names[int(rng.integers(len(request.action_names)))]
        return Generation(text=format_reply(action), version=self._version)

    async def load_weights(self, version: int, uri: str, digest: str) -> None:
        # No weights to load; following the version keeps per-turn version tags truthful.
        self._version = version

    async def close(self) -> None:
        pass
