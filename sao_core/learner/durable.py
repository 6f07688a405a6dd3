"""Durable weight versions written off the learner's critical path.

When the rollout services take the weights in memory (`weight_transport` auto with a colocated HF engine), a
version reaches storage (``<output>/weights/vNNNNNN``, a Hugging Face folder with a sha256 manifest) only every
`publish_every` versions and at checkpoints and the end, for audits, users and `keep_weight_versions` (a LoRA
run that pushes its adapter in memory writes the adapter folder, manifest kind ``lora_adapter``). The
learner hands a snapshot (its own copy of the full weights) to `DurableWeights.submit` and goes on training; one
background thread writes it (safetensors, publish, prune). A new snapshot waits for the previous write to end
(at most one is pending, so memory stays bounded); that wait and the snapshot copy are the learner's whole cost,
reported as ``durable_wait_s``. A write that fails is raised by the next `submit` or by `flush` (the run
stops: a durable copy that silently did not happen is worse than a stopped run).
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from sao_core import storage
from sao_core.learner.errors import LearnerError

log = logging.getLogger(__name__)


def snapshot(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An owned CPU copy of a state dict (the learner trains on while it is written)."""
    return {name: tensor.detach().to("cpu", copy=True) for name, tensor in state.items()}


class DurableWeights:
    """One background writer of weight versions under `weights_uri` (see the module).

    `write(state, staging)` writes a Hugging Face folder of the full weights `state` (or a LoRA adapter folder
    of the adapter's weights `state`) at `staging`;
    `prune(weights_uri, newest)` deletes versions beyond the newest kept ones (never fails the run)."""

    def __init__(self, weights_uri: str, staging: Path, write: Callable[[dict, Path], None],
                 prune: Callable[[str, int], object]):
        self.weights_uri = weights_uri
        self.staging = staging
        self._write = write
        self._prune = prune
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.written: list[int] = []          # versions made durable by this process, in order
        self.last_version: int | None = None  # the newest version submitted

    def _raise_failure(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise LearnerError(f"writing a durable weight version under {self.weights_uri} failed: "
                               f"{type(error).__name__}: {error}") from error

    def wait(self) -> float:
        """Block until the write in progress (if any) ends; returns the seconds waited. Raises its failure."""
        began = time.monotonic()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise_failure()
        return time.monotonic() - began

    def submit(self, version: int, state: dict[str, torch.Tensor], metadata: dict) -> float:
        """Write `state` (an owned snapshot, see `snapshot`) as version `version` in the background, after the
        previous write ended. Returns the seconds the caller waited for that previous write."""
        waited = self.wait()
        self.last_version = version
        uri = storage.join(self.weights_uri, f"v{version:06d}")

        def run() -> None:
            try:
                began = time.monotonic()
                shutil.rmtree(self.staging, ignore_errors=True)
                self._write(state, self.staging)
                storage.publish_checkpoint(self.staging, uri, metadata=metadata)
                shutil.rmtree(self.staging, ignore_errors=True)
                self.written.append(version)
                log.info("weights version %d made durable at %s in %.2f s", version, uri, time.monotonic() - began)
                self._prune(self.weights_uri, version)
            except BaseException as err:   # raised in the learner by the next submit / wait
                self._error = err

        self._thread = threading.Thread(target=run, name=f"durable-weights-v{version}", daemon=True)
        self._thread.start()
        return waited
