"""A real tiny model (offline tokenizer + random-init Qwen2, tied embeddings) shared by the learner tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollstream.tiny_model import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Tied embeddings: the harder case for saving, loading and ZeRO partitioning (one tensor, two names).
    return build_tiny_model(tmp_path_factory.mktemp("learner") / "v0", tie_word_embeddings=True, corpus_episodes=20)
