"""The learner's error: a run that cannot start or continue."""

from __future__ import annotations


class LearnerError(ValueError):
    """The run cannot start or continue; the message says what to change."""
