"""Datasets: read sources (files, s3://, Hugging Face), normalise rows per kind, write them out."""

from sao_core.data.prepare import PrepareConfig, PrepareStats, prepare
from sao_core.data.prepared import PreparedDataError, PreparedDataset, open_prepared
from sao_core.data.readers import Row, RowReadError, RowSource, iter_rows
from sao_core.data.schemas import KINDS, REASONS, DataError, RowError

__all__ = [
    "KINDS",
    "REASONS",
    "DataError",
    "PrepareConfig",
    "PrepareStats",
    "PreparedDataError",
    "PreparedDataset",
    "Row",
    "RowError",
    "RowReadError",
    "RowSource",
    "iter_rows",
    "open_prepared",
    "prepare",
]
