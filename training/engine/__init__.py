"""The department node's training engine: one process, or DDP workers (NCCL per GPU, gloo on CPU).

``train_model`` runs a ``TrainJob`` (the run's training math) with ``EngineSettings`` (what the
node's machine offers): AMP, gradient accumulation, clipping, warm-up and linear LR scaling, DDP
communication hooks, grad-norm spike tracking, and checkpoints that resume after a crash.
"""

from quorumfl.training.engine.checkpoint import CheckpointFile
from quorumfl.training.engine.launch import EngineResult, train_model
from quorumfl.training.engine.loop import LoopResult, TrainJob, proximal_term
from quorumfl.training.engine.settings import (
    Amp,
    CommHook,
    DevicePlan,
    EngineSettings,
    plan_devices,
)

__all__ = [
    "Amp", "CheckpointFile", "CommHook", "DevicePlan", "EngineResult", "EngineSettings", "LoopResult", "TrainJob",
    "plan_devices", "proximal_term", "train_model",
]
