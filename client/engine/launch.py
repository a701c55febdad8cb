"""Run a training job on what the node has: in-process, or one DDP worker per GPU / gloo worker.

Workers are started with ``torch.multiprocessing.spawn`` and rendezvous over TCP on 127.0.0.1 at a
free port; rank 0 hands the trained weights back through a file in a private temporary folder. DDP,
its communication hooks (``torch.distributed.algorithms.ddp_comm_hooks``) and the collectives are
torch's own; this module only wires them to ``loop.run_loop``.
"""

from __future__ import annotations

import datetime
import logging
import pickle
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from quorumfl.aggregation.errors import TrainingError

from ..data.datasets import Dataset
from .checkpoint import CheckpointFile, fingerprint
from .loop import LoopResult, TrainJob, run_loop
from .settings import CommHook, DevicePlan, EngineSettings, plan_devices

__all__ = ["EngineResult", "train_model"]

log = logging.getLogger(__name__)
_TIMEOUT = datetime.timedelta(minutes=10)


@dataclass(frozen=True)
class EngineResult:
    loop: LoopResult
    plan: DevicePlan


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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


def _worker(
    rank: int, plan: DevicePlan, port: int, payload: bytes, data: Dataset, job: TrainJob,
    settings: EngineSettings, checkpoint: Path | None, key: str, out: Path,
) -> None:
    model, anchor = pickle.loads(payload)
    torch.set_num_threads(settings.threads_per_worker)
    device = torch.device("cuda", rank) if plan.kind == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    assert plan.backend is not None
    dist.init_process_group(plan.backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=plan.world, timeout=_TIMEOUT)
    try:
        model = model.to(device)
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
        if rank == 0:
            state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
            torch.save({"state": state, "result": vars(result)}, out)
        dist.barrier()  # no rank tears gloo down while another still uses it (that aborts the process)
        if rank == 0:
            out.with_suffix(".done").touch()  # every rank finished the job
    finally:
        dist.destroy_process_group()


def train_model(
    model: nn.Module,
    data: Dataset,
    job: TrainJob,
    settings: EngineSettings | None = None,
    *,
    anchor: list[torch.Tensor] | None = None,
    checkpoint: Path | None = None,
) -> EngineResult:
    """Train ``model`` in place on ``data``; resumes from ``checkpoint`` when it holds this job's state,
    and removes it once the job is done."""
    settings = settings or EngineSettings()
    plan = plan_devices(settings, cuda_devices=torch.cuda.device_count())
    key = _job_fingerprint(model, data, job, anchor)
    if plan.world == 1:
        device = torch.device("cuda", 0) if plan.kind == "cuda" else torch.device("cpu")
        model.to(device)
        try:
            result = run_loop(model, data, job, settings, device=device, anchor=anchor,
                              checkpoint=CheckpointFile(checkpoint) if checkpoint else None, fingerprint=key)
        finally:
            model.to("cpu")
    else:
        with tempfile.TemporaryDirectory(prefix="quorumfl-ddp-") as tmp:
            out = Path(tmp) / "result.pt"
            # Plain pickle, not torch's: torch.multiprocessing would put the tensors in shared memory and
            # every worker would then step the same weights.
            payload = pickle.dumps((model, anchor))
            args = (plan, free_port(), payload, data, job, settings, checkpoint, key, out)
            try:
                mp.spawn(_worker,  # type: ignore[attr-defined,no-untyped-call]
                         args=args, nprocs=plan.world, join=True)
            except Exception as exc:  # ProcessRaisedException / ProcessExitedException carry the worker's error
                if not out.with_suffix(".done").exists():
                    raise TrainingError(f"a {plan.backend} training worker failed: {exc}") from exc
                # Every rank passed the final barrier, so the result is whole; gloo's teardown at process
                # exit occasionally aborts a worker after that.
                log.warning("a training worker failed after the job was complete (%s); using the result", exc)
            saved = torch.load(out, map_location="cpu", weights_only=True)
        model.load_state_dict(saved["state"])
        result = LoopResult(**saved["result"])
    if result.resumed_from_step:
        log.info("training resumed from checkpoint at step %s", result.resumed_from_step)
    if checkpoint is not None:
        CheckpointFile(checkpoint).remove()
    return EngineResult(result, plan)
