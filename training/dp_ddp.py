"""DP-SGD on several workers: Opacus' DPDDP over gloo (CPU) or NCCL (one worker per GPU).

The same planned schedule as one process (Opacus gives every worker the whole data set and samples
each worker's shard at rate q, so the union is one Poisson batch; only rank 0 adds the noise), so the
ledger entry and the accounting do not depend on the number of workers. Workers start and meet as
in the training engine (``training.engine.workers``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from quorumfl.core.data.datasets import Dataset
from quorumfl.errors import TrainingError
from quorumfl.training.dp_sgd import DpPlan, prepare_module, private_loop
from quorumfl.training.engine import DevicePlan, LoopResult, TrainJob
from quorumfl.training.engine.workers import run_workers

__all__ = ["train_private_ddp"]


def _private_rank(rank: int, model: nn.Module, anchor: list[torch.Tensor] | None, device: torch.device,
                  data: Dataset, job: TrainJob, plan: DpPlan) -> dict[str, Any]:
    from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP

    result = private_loop(model, DPDDP(model), data, job, plan, anchor=anchor)
    return {"state": {k: v.detach().cpu() for k, v in model.state_dict().items()}, "result": vars(result)}


def train_private_ddp(model: nn.Module, data: Dataset, job: TrainJob, plan: DpPlan, devices: DevicePlan, *,
                      threads: int = 1, anchor: list[torch.Tensor] | None = None) -> LoopResult:
    """Train ``model`` in place with DP-SGD on ``devices.world`` workers."""
    if devices.kind == "cuda":
        raise TrainingError("DP-SGD on several GPUs has not been run on a GPU machine yet; use train-workers = 1 "
                            "for DP runs on GPUs")
    fixed = prepare_module(model, job)
    saved = run_workers(_private_rank, devices, fixed, anchor, data, job, plan, threads=threads)
    fixed.load_state_dict(saved["state"])
    if fixed is not model:
        model.load_state_dict(fixed.state_dict())
    return LoopResult(**saved["result"])
