"""Run a training job on what the node has: in-process, or one DDP worker per GPU / gloo worker.

Workers start and meet through ``workers.run_workers``. DDP, its communication hooks
(``torch.distributed.algorithms.ddp_comm_hooks``) and the collectives are torch's own; this module
only wires them to ``loop.run_loop``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from quorumfl.core.data.datasets import Dataset
from quorumfl.errors import ConfigError
from quorumfl.training.engine.checkpoint import CheckpointFile, fingerprint
from quorumfl.training.engine.loop import LoopResult, TrainJob, run_loop
from quorumfl.training.engine.settings import CommHook, DevicePlan, EngineSettings, plan_devices
from quorumfl.training.engine.workers import run_workers

__all__ = ["EngineResult", "train_model"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineResult:
    loop: LoopResult
    plan: DevicePlan


def _register_hook(ddp: nn.parallel.DistributedDataParallel, hook: CommHook) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if hook is CommHook.FP16:
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook is CommHook.POWERSGD:
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)


def _job_fingerprint(model: nn.Module, data: Dataset, job: TrainJob, anchor: list[torch.Tensor] | None) -> str:
    tensors: list[Any] = [*model.state_dict().values(), data.x, data.y, *(anchor or [])]
    return fingerprint([job, type(model).__name__], tensors)


def _train_rank(
    rank: int, model: nn.Module, anchor: list[torch.Tensor] | None, device: torch.device, plan: DevicePlan,
    data: Dataset, job: TrainJob, settings: EngineSettings, checkpoint: Path | None, key: str,
) -> dict[str, Any]:
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[rank] if device.type == "cuda" else None)
    _register_hook(ddp, settings.comm_hook)

    def all_reduce(t: torch.Tensor) -> None:
        moved = t.to(device)
        dist.all_reduce(moved)
        t.copy_(moved.cpu())

    def gather(t: torch.Tensor) -> list[torch.Tensor]:
        items: list[Any] = [None] * plan.world
        dist.all_gather_object(items, t.cpu())
        return [torch.as_tensor(i) for i in items]

    result = run_loop(model, data, job, settings, rank=rank, world=plan.world, device=device, ddp=ddp,
                      anchor=anchor, checkpoint=CheckpointFile(checkpoint) if checkpoint else None,
                      fingerprint=key, all_reduce=all_reduce, gather=gather)
    return {"state": {k: v.detach().cpu() for k, v in model.state_dict().items()}, "result": vars(result)}


def train_model(
    model: nn.Module,
    data: Dataset,
    job: TrainJob,
    settings: EngineSettings | None = None,
    *,
    anchor: list[torch.Tensor] | None = None,
    checkpoint: Path | None = None,
    correction: list[torch.Tensor] | None = None,
) -> EngineResult:
    """Train ``model`` in place on ``data``; resumes from ``checkpoint`` when it holds this job's state,
    and removes it once the job is done. ``correction`` (one tensor per parameter, SCAFFOLD's c − c_i)
    is added to every step's gradient; it runs on one device."""
    settings = settings or EngineSettings()
    plan = plan_devices(settings, cuda_devices=torch.cuda.device_count())
    if correction is not None and plan.world > 1:
        raise ConfigError(f"SCAFFOLD's gradient correction runs on one device; this node's engine plans {plan.world} "
                          "DDP workers: set the node config 'train-workers' to 1 for this run")
    key = _job_fingerprint(model, data, job, [*(anchor or []), *(correction or [])])
    if plan.world == 1:
        device = torch.device("cuda", 0) if plan.kind == "cuda" else torch.device("cpu")
        model.to(device)
        try:
            result = run_loop(model, data, job, settings, device=device, anchor=anchor,
                              checkpoint=CheckpointFile(checkpoint) if checkpoint else None, fingerprint=key,
                              correction=correction)
        finally:
            model.to("cpu")
    else:
        saved = run_workers(_train_rank, plan, model, anchor, plan, data, job, settings, checkpoint, key,
                            threads=settings.threads_per_worker)
        model.load_state_dict(saved["state"])
        result = LoopResult(**saved["result"])
    if result.resumed_from_step:
        log.info("training resumed from checkpoint at step %s", result.resumed_from_step)
    if checkpoint is not None:
        CheckpointFile(checkpoint).remove()
    return EngineResult(result, plan)
