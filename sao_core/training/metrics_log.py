"""A run's ``metrics.jsonl``, written as the run goes, that reaches the output while the run runs.

S3 has no append, so for an ``s3://`` output the lines go to a local file and :meth:`MetricsLog.sync`
replaces ``<output>/metrics.jsonl`` with a copy of it (one PUT of the whole file). For a local output the
local file is the output file itself and syncing does nothing.

Every line also goes to the log's *sinks* (``sao_core.training.live``: TensorBoard event files, MLflow, the
learner's Prometheus endpoint), which are synced with it; a sink that fails is warned about and dropped.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from sao_core import storage
from sao_core.training.live import Sink, scalars

log = logging.getLogger(__name__)

METRICS_NAME = "metrics.jsonl"


class MetricsLog:
    """``with MetricsLog(output, local_path, resume) as metrics: metrics.append(record); metrics.sync()``.

    `local_path` is where lines are written (for a local output: ``<output>/metrics.jsonl``). With `resume`
    earlier lines are kept: for an s3:// output the object at the output (if any) is downloaded first, then
    lines are appended (a last line cut short by a kill is removed first, and with `keep_through` the lines
    of later steps, which the resumed run trains and logs again; `steps` says which steps have a line);
    without it the file starts empty. Leaving the ``with`` block syncs, also when an
    exception is leaving it, so a failed run still shows its lines. A sync that fails while the run goes on
    logs a warning (the next one sends the whole file again); the final sync of a block left normally
    raises StorageError. `enabled=False` (ranks other than 0) makes every call a no-op.

    `sinks` (``sao_core.training.live``) are opened when the block is entered (after the kept lines are
    known), given every appended line with a step, synced at every sync and closed when the block is left.
    """

    def __init__(self, output_uri: str, local_path: str | Path, resume: bool, enabled: bool = True,
                 keep_through: int | None = None, sinks: Sequence[Sink] = ()):
        self.output_uri = output_uri
        self.uri = storage.join(output_uri, METRICS_NAME)
        self.remote = storage.is_s3_uri(output_uri)
        self.path = Path(local_path)
        self.resume = resume
        self.enabled = enabled
        self.keep_through = keep_through
        self._file: IO[str] | None = None
        self._steps: set[int] = set()
        self._pending_sinks = list(sinks)
        self.sinks: list[Sink] = []

    def _each_sink(self, action: str, call) -> None:
        """`call(sink)` for every live sink; one that raises is warned about and dropped (the run goes on)."""
        for sink in list(self.sinks):
            try:
                call(sink)
            except Exception as err:  # noqa: BLE001  (a live view never stops a run)
                log.warning("%s: %s failed, the run goes on without it: %s: %s", sink.name, action,
                            type(err).__name__, err)
                self.sinks.remove(sink)
                sink.drop()

    def __enter__(self) -> MetricsLog:
        if not self.enabled:
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.resume and self.remote and storage.exists(self.uri):
            storage.download_file(self.uri, self.path)
        if self.resume and self.path.exists():
            self._keep_whole_lines()
        self._file = self.path.open("a" if self.resume else "w")
        self.sinks = self._pending_sinks
        self._each_sink("start", lambda sink: sink.open(self))
        return self

    def _keep_whole_lines(self) -> None:
        """Drop a last line a killed writer left unfinished (not JSON) and the lines after `keep_through`;
        note the steps logged."""
        text = self.path.read_text()
        lines = text.splitlines(keepends=True)
        kept = []
        for index, line in enumerate(lines):
            try:
                record = json.loads(line)
            except ValueError:
                if index == len(lines) - 1:       # cut short by a kill: that step is logged again
                    log.warning("%s: dropping an unfinished last line (%d characters)", self.path, len(line))
                    continue
                record = None                     # not ours to judge: kept as it is
            step = record.get("step") if isinstance(record, dict) else None
            if isinstance(step, int) and self.keep_through is not None and step > self.keep_through:
                continue
            kept.append(line if line.endswith("\n") else line + "\n")
            if isinstance(step, int):
                self._steps.add(step)
        if "".join(kept) != text:
            self.path.write_text("".join(kept))

    def steps(self) -> set[int]:
        """The steps that have a line (those kept when resuming, and those appended since)."""
        return set(self._steps)

    def append(self, record: dict[str, Any]) -> None:
        """Write one JSON line and flush it to the local file."""
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
            if isinstance(record.get("step"), int):
                self._steps.add(record["step"])
                if self.sinks:
                    values = scalars(record)
                    self._each_sink("logging", lambda sink: sink.write(record["step"], values, record))

    def sync(self, strict: bool = False) -> bool:
        """Copy the local file to ``<output>/metrics.jsonl`` (s3:// outputs); False, with a warning, if that
        failed (`strict`: raise StorageError instead)."""
        self._each_sink("sync", lambda sink: sink.sync())
        if not self.enabled or not self.remote:
            return True
        if self._file is not None:
            self._file.flush()
        try:
            storage.upload_file(self.path, self.uri)
        except storage.StorageError as err:
            if strict:
                raise
            log.warning("could not update %s (the run goes on; the next sync sends every line): %s", self.uri, err)
            return False
        return True

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self._each_sink("closing", lambda sink: sink.close(failed=exc_type is not None))
        self.sinks = []
        self.sync(strict=exc_type is None)  # an error already leaving the block is not masked by this one
