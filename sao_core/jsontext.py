"""Reading one JSON object from text a user wrote (an environment variable, a line of a file), with an error
that names where the text came from."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["json_object"]


def json_object(text: str, where: str) -> dict[str, Any]:
    """The JSON object in `text`; ValueError "<where> is not valid JSON (<why>)" or "<where> must be a JSON
    object, got <type>" otherwise (`where` names the source: a variable, "file:line")."""
    try:
        value = json.loads(text)
    except ValueError as err:
        raise ValueError(f"{where} is not valid JSON ({err})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a JSON object, got {type(value).__name__}")
    return value
