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


@pytest.fixture(scope="session")
def warm_tool_model(tmp_path_factory, sao_cache):
    """The embedded model after a short SFT on multi-call tool_arith conversations (it calls the tool)."""
    import json

    from sao_core.data.synthetic import tool_arith_sft_rows
    from sao_core.training.config import SFTConfig
    from sao_core.training.trainer import train

    root = tmp_path_factory.mktemp("warm")
    (root / "data").mkdir()
    rows = tool_arith_sft_rows(400, seed=21, p_more=0.5, max_ops=4)
    (root / "data" / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = train("sft", SFTConfig(data=str(root / "data"), output=str(root / "run"), steps=100, batch_size=16,
                                     lr=3e-3, max_tokens=256, cache_dir=str(sao_cache)))
    return summary["model"]
