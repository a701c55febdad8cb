"""One checkpointed training job, run as its own process by the crash-resume test (not a test module).

Usage: python engine_job.py CHECKPOINT OUT WORKERS — trains, saves the final weights to OUT and prints
the step it resumed from (0 for a fresh start) as JSON.
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


def main(checkpoint: Path, out: Path, workers: int) -> None:
    model = build_model("mlp", (1, 8, 8), 10, seed=3)
    settings = EngineSettings(device="cpu", workers=workers, checkpoint_every=20)
    result = train_model(model, job_data(), JOB, settings, checkpoint=checkpoint)
    torch.save(model.state_dict(), out)
    print(json.dumps({"resumed_from_step": result.loop.resumed_from_step, "steps": result.loop.steps}), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]))
