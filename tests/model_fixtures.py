"""Shared fixtures for tests that need the embedded model (registered in conftest.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def sao_cache(tmp_path_factory):
    """A cache directory shared by the whole session (the embedded model is built once in it)."""
    return tmp_path_factory.mktemp("sao-cache")


@pytest.fixture(scope="session")
def tiny_model_dir(sao_cache):
    from sao_core.models import EMBEDDED_TINY, resolve_model

    return resolve_model(EMBEDDED_TINY, sao_cache).path
