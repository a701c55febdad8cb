"""One checkpointed training job, run as its own process by the crash-resume test (not a test module).

Usage: python engine_job.py CHECKPOINT OUT WORKERS [KIND] — trains, saves the final weights to OUT
and prints the step it resumed from (0 for a fresh start) as JSON. KIND: image (an MLP on 8×8
inputs, the default), text (the text task's embedding bag on token ids) or tabular (the tabular
task's standardised MLP on a regression target).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

from quorumfl.core.data.datasets import Dataset
from quorumfl.core.models import build_model
from quorumfl.training.engine import EngineSettings, TrainJob, train_model

JOB = TrainJob(epochs=2, batch_size=16, learning_rate=0.05, proximal_mu=0.01, seed=7, clip_norm=5.0, warmup_steps=10)


def job_data() -> Dataset:
    rng = np.random.default_rng(11)
    x = rng.normal(size=(3001, 1, 8, 8)).astype(np.float32)
    y = (x.reshape(len(x), -1)[:, :10].argmax(axis=1)).astype(np.int64)
    return Dataset("synthetic", x, y, 10)


def job(kind: str) -> tuple[torch.nn.Module, Dataset]:
    if kind == "image":
        return build_model("mlp", (1, 8, 8), 10, seed=3), job_data()
    from quorumfl.core.tasks import Regression
    from quorumfl.core.tasks.modules import HashedBag, Standardize

    rng = np.random.default_rng(11)
    torch.manual_seed(3)
    if kind == "text":
        x = rng.integers(0, 500, size=(3001, 12)).astype(np.int64)
        x[:, 0] = rng.integers(1, 500, size=len(x))  # no empty document
        return HashedBag(500, 16, 10), Dataset("text", x, (x[:, 0] % 10).astype(np.int64), 10)
    features = rng.random((3001, 6)).astype(np.float32)
    stats = Standardize(6)
    stats.set_statistics(torch.from_numpy(features))
    model = torch.nn.Sequential(stats, torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    target = (features @ rng.random(6) / 6).astype(np.float32)
    return model, Dataset("tabular", features, target, 1, Regression(scale=1000.0))


def main(checkpoint: Path, out: Path, workers: int, kind: str) -> None:
    model, data = job(kind)
    settings = EngineSettings(device="cpu", workers=workers, checkpoint_every=20)
    result = train_model(model, data, JOB, settings, checkpoint=checkpoint)
    torch.save(model.state_dict(), out)
    print(json.dumps({"resumed_from_step": result.loop.resumed_from_step, "steps": result.loop.steps}), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else "image")
