"""Session fixtures for the policy tests: one tied and one untied tiny model, each with a published version 1."""

from __future__ import annotations

import pytest

from .helpers import TinyVersions, tiny_versions


@pytest.fixture(scope="session")
def tied_model(tmp_path_factory: pytest.TempPathFactory) -> TinyVersions:
    return tiny_versions(tmp_path_factory.mktemp("tied"), tied=True)


@pytest.fixture(scope="session")
def untied_model(tmp_path_factory: pytest.TempPathFactory) -> TinyVersions:
    return tiny_versions(tmp_path_factory.mktemp("untied"), tied=False)
