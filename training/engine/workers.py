"""Start ``world`` worker processes that meet over torch.distributed, and collect rank 0's result.

Used by the training engine's DDP path and by DP-SGD with Opacus' DPDDP. Workers are started with
``torch.multiprocessing.spawn`` and rendezvous over TCP on 127.0.0.1 at a free port. The model goes
to them with plain pickle: torch's own pickler would put its tensors in shared memory, and every
worker would then step the same weights. Rank 0's result comes back through a file in a private
temporary folder; every rank passes a final barrier before tearing the process group down.
"""

from __future__ import annotations

import datetime
import logging
import pickle
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from quorumfl.errors import TrainingError
from quorumfl.training.engine.settings import DevicePlan

__all__ = ["RankTask", "free_port", "run_workers"]

log = logging.getLogger(__name__)
_TIMEOUT = datetime.timedelta(minutes=10)

# (rank, model on its device, anchor, device, *task args) -> what rank 0 hands back (other ranks: ignored)
RankTask = Callable[..., dict[str, Any]]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _entry(rank: int, task: RankTask, plan: DevicePlan, port: int, payload: bytes, threads: int, out: Path,
           args: tuple[Any, ...]) -> None:
    torch.set_num_threads(threads)
    model, anchor = pickle.loads(payload)
    device = torch.device("cuda", rank) if plan.kind == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    assert plan.backend is not None
    dist.init_process_group(plan.backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=plan.world, timeout=_TIMEOUT)
    try:
        result = task(rank, model.to(device), anchor, device, *args)
        if rank == 0:
            torch.save(result, out)
        dist.barrier()  # no rank tears gloo down while another still uses it (that aborts the process)
        if rank == 0:
            out.with_suffix(".done").touch()  # every rank finished the job
    finally:
        dist.destroy_process_group()


def run_workers(task: RankTask, plan: DevicePlan, model: nn.Module, anchor: list[torch.Tensor] | None, *args: Any,
                threads: int = 1) -> dict[str, Any]:
    """Run ``task`` on ``plan.world`` ranks; returns rank 0's result (tensors on the CPU)."""
    with tempfile.TemporaryDirectory(prefix="quorumfl-workers-") as tmp:
        out = Path(tmp) / "result.pt"
        spawn_args = (task, plan, free_port(), pickle.dumps((model, anchor)), threads, out, args)
        try:
            mp.spawn(_entry, args=spawn_args, nprocs=plan.world, join=True)  # type: ignore[attr-defined,no-untyped-call]
        except Exception as exc:  # ProcessRaisedException / ProcessExitedException carry the worker's error
            if not out.with_suffix(".done").exists():
                raise TrainingError(f"a {plan.backend} training worker failed: {exc}") from exc
            # Every rank passed the final barrier, so the result is whole; gloo's teardown at process
            # exit occasionally aborts a worker after that.
            log.warning("a training worker failed after the job was complete (%s); using the result", exc)
        saved: dict[str, Any] = torch.load(out, map_location="cpu", weights_only=True)
    return saved
