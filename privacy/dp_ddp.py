"""DP-SGD on several workers: Opacus' DPDDP over gloo (CPU) or NCCL (one worker per GPU).

The same planned schedule as one process (Opacus gives every worker the whole data set and samples
each worker's shard at rate q, so the union is one Poisson batch; only rank 0 adds the noise), so the
ledger entry and the accounting do not depend on the number of workers. Workers start and meet as
in the training engine (``client.engine.launch``); rank 0 hands the weights back through a file.
"""

from __future__ import annotations

import datetime
import pickle
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from quorumfl.aggregation.errors import TrainingError
from quorumfl.client.data.datasets import Dataset
from quorumfl.client.engine import DevicePlan, LoopResult, TrainJob
from quorumfl.client.engine.launch import free_port

from .dp_sgd import DpPlan, prepare_module, private_loop

__all__ = ["train_private_ddp"]


def _worker(rank: int, devices: DevicePlan, port: int, payload: bytes, data: Dataset, job: TrainJob, plan: DpPlan,
            threads: int, out: Path) -> None:
    from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP

    torch.set_num_threads(threads)
    model, anchor = pickle.loads(payload)
    assert devices.backend is not None
    dist.init_process_group(devices.backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=devices.world, timeout=datetime.timedelta(minutes=10))
    try:
        if devices.kind == "cuda":
            torch.cuda.set_device(rank)
            model = model.to(torch.device("cuda", rank))
        result = private_loop(model, DPDDP(model), data, job, plan, anchor=anchor)
        if rank == 0:
            torch.save({"state": {k: v.detach().cpu() for k, v in model.state_dict().items()},
                        "result": vars(result)}, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def train_private_ddp(model: nn.Module, data: Dataset, job: TrainJob, plan: DpPlan, devices: DevicePlan, *,
                      threads: int = 1, anchor: list[torch.Tensor] | None = None) -> LoopResult:
    """Train ``model`` in place with DP-SGD on ``devices.world`` workers."""
    if devices.kind == "cuda":
        raise TrainingError("DP-SGD on several GPUs has not been run on a GPU machine yet; use train-workers = 1 "
                            "for DP runs on GPUs")
    fixed = prepare_module(model, job)
    with tempfile.TemporaryDirectory(prefix="quorumfl-dpddp-") as tmp:
        out = Path(tmp) / "result.pt"
        payload = pickle.dumps((fixed, anchor))  # plain pickle: no shared-memory tensors between workers
        try:
            mp.spawn(_worker, args=(devices, free_port(), payload, data, job, plan, threads, out),  # type: ignore[attr-defined,no-untyped-call]
                     nprocs=devices.world, join=True)
        except Exception as exc:
            if not out.exists():
                raise TrainingError(f"a DP-SGD worker failed: {exc}") from exc
        saved: dict[str, Any] = torch.load(out, map_location="cpu", weights_only=True)
    fixed.load_state_dict(saved["state"])
    if fixed is not model:
        model.load_state_dict(fixed.state_dict())
    return LoopResult(**saved["result"])
