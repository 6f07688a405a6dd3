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


#: A folder `make test` (scripts/run_tests.py) shares between its workers and both phases for the duration of the
#: run: a warm-start model trained by one process is read by the others instead of being trained again (each is
#: 10-17 s of SFT). Unset (a plain pytest), every session trains its own.
SHARED_DIR_ENV = "SAO_TEST_SHARED_DIR"


def sft_model(root, rows, sao_cache, *, steps: int, max_tokens: int) -> str:
    """The embedded model after `steps` SFT steps (batch 16, lr 3e-3) on `rows` (chat conversations), trained
    under the folder `root`; returns the exported model's path. Tests only read it. With $SAO_TEST_SHARED_DIR the
    first process to need a recipe trains it (under a file lock) and publishes the export there; the others wait
    for it and get that path."""
    import fcntl
    import hashlib
    import json
    import os
    import shutil
    from pathlib import Path

    text = "".join(json.dumps(r) + "\n" for r in rows)
    shared = os.environ.get(SHARED_DIR_ENV)
    if not shared:
        return _train_sft(root, text, sao_cache, steps, max_tokens)
    recipe = hashlib.sha256(f"{steps}:{max_tokens}:{text}".encode()).hexdigest()[:16]
    published = Path(shared) / f"sft-{recipe}"
    with open(Path(shared) / f"sft-{recipe}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # released when the file closes, also if this process dies
        if not published.is_dir():
            exported = _train_sft(root, text, sao_cache, steps, max_tokens)
            shutil.copytree(exported, published.with_suffix(".partial"), dirs_exist_ok=True)
            os.replace(published.with_suffix(".partial"), published)
    return str(published)


def _train_sft(root, text: str, sao_cache, steps: int, max_tokens: int) -> str:
    from sao_core.training.config import SFTConfig
    from sao_core.training.trainer import train

    (root / "data").mkdir()
    (root / "data" / "data.jsonl").write_text(text)
    return train("sft", SFTConfig(data=str(root / "data"), output=str(root / "run"), steps=steps, batch_size=16,
                                  lr=3e-3, max_tokens=max_tokens, cache_dir=str(sao_cache)))["model"]


@pytest.fixture(scope="session")
def warm_tool_model(tmp_path_factory, sao_cache):
    """The embedded model after a short SFT on multi-call tool_arith conversations (it calls the tool)."""
    from sao_core.data.synthetic import tool_arith_sft_rows

    rows = tool_arith_sft_rows(400, seed=21, p_more=0.5, max_ops=4)
    return sft_model(tmp_path_factory.mktemp("warm"), rows, sao_cache, steps=100, max_tokens=256)
