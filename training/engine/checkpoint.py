"""Training checkpoints: model, optimizer, loss scaler, RNG and data position, written atomically.

A checkpoint belongs to one training job: its ``fingerprint`` hashes the job's settings, the starting
weights and the data, so a file left by another round or run is never resumed (it is replaced). The
file is written to a temporary name, fsynced and renamed (``files.atomic_write``): a SIGKILL at any
moment leaves the previous checkpoint or the new one, never a torn file.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from quorumfl.core.files import atomic_write
from quorumfl.errors import TrainingError

__all__ = ["Checkpoint", "CheckpointFile", "fingerprint"]


def fingerprint(parts: Iterable[object], arrays: Iterable[np.ndarray | torch.Tensor]) -> str:
    """SHA-256 over settings (their repr) and the bytes of the given arrays, in order."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(repr(part).encode())
        digest.update(b"\0")
    for array in arrays:
        data = array.detach().cpu().numpy() if isinstance(array, torch.Tensor) else np.asarray(array)
        digest.update(str(data.dtype).encode() + str(data.shape).encode())
        digest.update(np.ascontiguousarray(data).tobytes())
    return digest.hexdigest()


@dataclass
class Checkpoint:
    """Everything needed to continue a training job exactly where it stopped."""

    fingerprint: str
    epoch: int  # the epoch in progress
    next_batch: int  # the first global batch of ``epoch`` not yet trained
    steps: int  # optimizer steps done so far
    epoch_generator: torch.Tensor  # the data-order generator's state at the start of ``epoch``
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    scaler: dict[str, Any] | None
    rng: list[torch.Tensor]  # each worker's global torch RNG state, by rank
    cuda_rng: list[torch.Tensor] | None
    epoch_loss_sum: float
    epoch_seen: int
    grad_norms: list[float]


class CheckpointFile:
    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self, expected_fingerprint: str) -> Checkpoint | None:
        """The checkpoint of this job, or None when there is none (or it belongs to another job)."""
        if not self.path.exists():
            return None
        try:
            raw = torch.load(self.path, map_location="cpu", weights_only=True)
        except Exception as exc:  # torch raises several unrelated types for a bad file
            raise TrainingError(
                f"checkpoint {self.path} is unreadable ({exc}); delete it to train the round from the start"
            ) from exc
        if not isinstance(raw, dict) or raw.get("fingerprint") != expected_fingerprint:
            return None
        try:
            return Checkpoint(**raw)
        except TypeError as exc:
            raise TrainingError(f"checkpoint {self.path} has an unknown layout ({exc}); delete it") from exc

    def save(self, checkpoint: Checkpoint) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        buffer = io.BytesIO()
        torch.save(vars(checkpoint), buffer)
        atomic_write(self.path, buffer.getvalue(), mode=0o600)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
