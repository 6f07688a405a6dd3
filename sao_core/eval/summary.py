"""An evaluation run's ``summary.json``: its name and its reader (used by the runner, which writes it, and by the
report, which compares with a previous one)."""

from __future__ import annotations

import json
from typing import Any

from sao_core import storage
from sao_core.eval.config import EvalError

SUMMARY_FILE = "summary.json"


def load_summary(uri: str) -> dict[str, Any]:
    """A ``summary.json`` (path, run folder or s3:// URI) written by :func:`evaluate`."""
    target = uri if uri.endswith(".json") else storage.join(uri, SUMMARY_FILE)
    try:
        data = json.loads(storage.read_text(target))
    except (storage.StorageError, OSError) as err:
        raise EvalError(f"cannot read the previous summary {target}: {err}") from err
    except ValueError as err:
        raise EvalError(f"the previous summary {target} is not JSON: {err}") from err
    if not isinstance(data, dict) or not isinstance(data.get("metrics"), dict):
        raise EvalError(f"{target} is not an evaluation summary (no 'metrics' mapping)")
    return data
