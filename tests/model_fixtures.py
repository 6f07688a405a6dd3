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


def sft_model(root, rows, sao_cache, *, steps: int, max_tokens: int) -> str:
    """The embedded model after `steps` SFT steps (batch 16, lr 3e-3) on `rows` (chat conversations), trained
    under the folder `root`; returns the exported model's path."""
    import json

    from sao_core.training.config import SFTConfig
    from sao_core.training.trainer import train

    (root / "data").mkdir()
    (root / "data" / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return train("sft", SFTConfig(data=str(root / "data"), output=str(root / "run"), steps=steps, batch_size=16,
                                  lr=3e-3, max_tokens=max_tokens, cache_dir=str(sao_cache)))["model"]


@pytest.fixture(scope="session")
def warm_tool_model(tmp_path_factory, sao_cache):
    """The embedded model after a short SFT on multi-call tool_arith conversations (it calls the tool)."""
    from sao_core.data.synthetic import tool_arith_sft_rows

    rows = tool_arith_sft_rows(400, seed=21, p_more=0.5, max_ops=4)
    return sft_model(tmp_path_factory.mktemp("warm"), rows, sao_cache, steps=100, max_tokens=256)
