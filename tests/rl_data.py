"""One builder for prepared `rl` datasets in the tests (written by hand in a dozen files before)."""

from __future__ import annotations

import json
from pathlib import Path

from sao_core.data.prepare import PrepareConfig, prepare


def prepared_rl(folder: Path, tasks, **options) -> str:
    """`sao prepare-data --kind rl` of `tasks` (environment tasks, or rows as dicts) into `folder`; the raw
    rows go to `folder`.jsonl next to it. `options`: other PrepareConfig fields. Returns the folder."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    rows = [t if isinstance(t, dict) else {"id": t.id, "prompt": t.prompt, "env": t.env, "answer": t.answer,
                                           "metadata": t.metadata} for t in tasks]
    raw = folder.parent / f"{folder.name}.jsonl"
    raw.write_text("".join(json.dumps(row) + "\n" for row in rows))
    prepare(PrepareConfig(source=str(raw), kind="rl", output=str(folder), **options))
    return str(folder)


def tool_arith_rl(folder: Path, count: int, seed: int = 3, **task_options) -> str:
    """A prepared dataset of `count` tool_arith tasks (`task_options`: p_more, max_ops, ...)."""
    from sao_core.envs.tool_arith import tool_arith_tasks

    return prepared_rl(folder, tool_arith_tasks(count, seed=seed, **task_options))
