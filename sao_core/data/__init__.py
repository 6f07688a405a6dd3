"""Datasets: read sources (files, s3://, Hugging Face), normalise rows per kind, write them out."""

from sao_core.data.prepare import PrepareConfig, PrepareStats, prepare
from sao_core.data.readers import Row, RowReadError, RowSource, iter_rows
from sao_core.data.schemas import KINDS, REASONS, DataError, RowError

__all__ = [
    "KINDS",
    "REASONS",
    "DataError",
    "PrepareConfig",
    "PrepareStats",
    "Row",
    "RowError",
    "RowReadError",
    "RowSource",
    "iter_rows",
    "prepare",
]
