"""One worker's training loop: the same code runs alone (one process) and as a DDP rank.

The job's ``batch_size`` is the *global* batch of one optimizer step. Each step's batch is split
across the ``world`` workers and then into ``accumulation_steps`` micro-batches; every micro-batch's
summed loss is scaled by ``world / len(global batch)`` so that DDP's gradient average equals the mean
gradient of the global batch. The update therefore does not depend on how many workers or
micro-batches the node uses (up to float rounding). Micro-batches before the last run under
``no_sync`` so DDP all-reduces once per step.

The optimizer is SGD with momentum or Adam (``TrainJob.optimizer``); either starts afresh each job
(a round), as local optimizers in FedAvg do. Per step: AMP autocast (bf16, or fp16 with a GradScaler), the FedProx/Ditto proximal term, grad-norm
tracking with a spike flag, clipping, linear warm-up of the learning rate (after the linear scaling
rule for the global batch), and a checkpoint every N steps (rank 0 writes it).
"""

from __future__ import annotations

import contextlib
import math
import statistics
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from quorumfl.core.data.datasets import Dataset
from quorumfl.core.tasks.base import OPTIMIZERS
from quorumfl.errors import ConfigError
from quorumfl.training.engine.checkpoint import Checkpoint, CheckpointFile
from quorumfl.training.engine.settings import Amp, EngineSettings

__all__ = ["LoopResult", "TrainJob", "proximal_term", "run_loop"]


@dataclass(frozen=True)
class TrainJob:
    """The training math a run prescribes (the same on every node, whatever its hardware)."""

    epochs: int
    batch_size: int  # global batch per optimizer step
    learning_rate: float
    momentum: float = 0.9
    proximal_mu: float = 0.0
    seed: int = 0
    clip_norm: float = 0.0  # 0 = no clipping
    warmup_steps: int = 0  # linear warm-up over this many optimizer steps
    lr_reference_batch: int = 0  # linear scaling rule: lr × batch_size / this (0 = off)
    optimizer: str = "sgd"  # sgd (with ``momentum``) or adam (its state starts afresh each round)

    def __post_init__(self) -> None:
        problems = []
        if self.epochs < 1:
            problems.append(f"local-epochs must be >= 1, got {self.epochs}")
        if self.batch_size < 1:
            problems.append(f"batch-size must be >= 1, got {self.batch_size}")
        if not self.learning_rate > 0:
            problems.append(f"learning-rate must be > 0, got {self.learning_rate}")
        if not 0 <= self.momentum < 1:
            problems.append(f"momentum must be in [0, 1), got {self.momentum}")
        if not self.proximal_mu >= 0:
            problems.append(f"proximal-mu must be >= 0, got {self.proximal_mu}")
        if not self.clip_norm >= 0:
            problems.append(f"clip-norm must be >= 0 (0 = off), got {self.clip_norm}")
        if self.warmup_steps < 0:
            problems.append(f"warmup-steps must be >= 0, got {self.warmup_steps}")
        if self.optimizer not in OPTIMIZERS:
            problems.append(f"optimizer must be one of {list(OPTIMIZERS)}, got {self.optimizer!r}")
        if self.lr_reference_batch < 0:
            problems.append(f"lr-reference-batch must be >= 0 (0 = off), got {self.lr_reference_batch}")
        if problems:
            raise ConfigError(problems)

    def base_lr(self) -> float:
        if self.lr_reference_batch:
            return self.learning_rate * self.batch_size / self.lr_reference_batch
        return self.learning_rate

    def make_optimizer(self, parameters: Iterable[nn.Parameter], *, momentum: float | None = None) -> torch.optim.Optimizer:
        """The job's optimizer at its base rate; ``momentum`` overrides the job's (SGD)."""
        if self.optimizer == "adam":
            return torch.optim.Adam(parameters, lr=self.base_lr())
        return torch.optim.SGD(parameters, lr=self.base_lr(), momentum=self.momentum if momentum is None else momentum)

    def lr_at(self, step: int) -> float:
        """Learning rate of optimizer step ``step`` (0-based)."""
        if self.warmup_steps and step < self.warmup_steps:
            return self.base_lr() * (step + 1) / self.warmup_steps
        return self.base_lr()


@dataclass
class LoopResult:
    loss: float  # mean loss of the last epoch (data loss plus proximal term, per example)
    num_examples: int
    steps: int
    grad_norms: list[float] = field(default_factory=list)
    spikes: int = 0
    skipped_steps: int = 0  # fp16 steps skipped by the GradScaler (inf/NaN gradients)
    resumed_from_step: int = 0


def proximal_term(model: nn.Module, anchor: list[torch.Tensor], mu: float) -> torch.Tensor:
    """``mu/2 · Σ ||w − w_anchor||²`` over the trainable parameters (FedProx, Ditto)."""
    total = torch.zeros((), dtype=torch.float32, device=anchor[0].device if anchor else None)
    for w, wa in zip(model.parameters(), anchor, strict=True):
        total = total + (w.float() - wa).pow(2).sum()
    return 0.5 * mu * total


@contextlib.contextmanager
def cuda_numerics(device: torch.device, amp: Amp) -> Iterator[None]:
    """On CUDA, for the loop's duration: without AMP, float32 is float32 (no TF32 tensor-core rounding in
    matmuls or convolutions; cuDNN allows TF32 by default), and cuDNN picks deterministic algorithms
    (no autotuning). So a GPU node's update agrees with a CPU node's on the same job to float tolerance,
    and a job resumed from its checkpoint repeats its steps bit for bit. AMP (bf16, fp16) is the way to
    ask for reduced-precision speed. The process's previous flags come back afterwards."""
    if device.type != "cuda":
        yield
        return
    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    saved = (cudnn.allow_tf32, matmul.allow_tf32, cudnn.deterministic, cudnn.benchmark)
    exact = amp is Amp.OFF
    cudnn.allow_tf32, matmul.allow_tf32 = saved[0] and not exact, saved[1] and not exact
    cudnn.deterministic, cudnn.benchmark = True, False
    try:
        yield
    finally:
        cudnn.allow_tf32, matmul.allow_tf32, cudnn.deterministic, cudnn.benchmark = saved


def _is_spike(norm: float, history: list[float], factor: float) -> bool:
    return len(history) >= 5 and math.isfinite(norm) and norm > factor * statistics.median(history)


def run_loop(
    module: nn.Module,
    data: Dataset,
    job: TrainJob,
    settings: EngineSettings,
    *,
    rank: int = 0,
    world: int = 1,
    device: torch.device | None = None,
    ddp: nn.Module | None = None,
    anchor: list[torch.Tensor] | None = None,
    checkpoint: CheckpointFile | None = None,
    fingerprint: str = "",
    all_reduce: Callable[[torch.Tensor], None] | None = None,
    gather: Callable[[torch.Tensor], list[torch.Tensor]] | None = None,
    correction: list[torch.Tensor] | None = None,
) -> LoopResult:
    """Train ``module`` (wrapped in ``ddp`` when ``world > 1``) in place; every rank calls this.
    ``correction`` (one tensor per parameter) is added to each step's gradient after clipping
    (SCAFFOLD's c − c_i: the step follows g − c_i + c)."""
    device = device or torch.device("cpu")
    forward = ddp if ddp is not None else module
    if world > 1 and (ddp is None or all_reduce is None or gather is None):
        raise ConfigError("run_loop with world > 1 needs the DDP module and the collectives")
    x_all = torch.from_numpy(data.x)
    y_all = torch.from_numpy(data.y)
    n = len(y_all)
    anchor_t = [p.detach().clone() for p in module.parameters()] if anchor is None else [a.to(device) for a in anchor]
    if len(anchor_t) != len(list(module.parameters())):
        raise ConfigError(f"anchor has {len(anchor_t)} tensors, the model {len(list(module.parameters()))} parameters")
    correction_t = [c.to(device) for c in correction] if correction is not None else None
    if correction_t is not None and len(correction_t) != len(anchor_t):
        raise ConfigError(f"correction has {len(correction_t)} tensors, the model {len(anchor_t)} parameters")
    optimizer = job.make_optimizer(module.parameters())
    for group in optimizer.param_groups:
        group["lr"] = job.lr_at(0)
    amp_dtype = {Amp.BF16: torch.bfloat16, Amp.FP16: torch.float16}.get(settings.amp)
    scaler = torch.amp.GradScaler("cuda") if settings.amp is Amp.FP16 else None
    # summed over the batch (cross-entropy, or squared error for regression); torch's backward() is untyped
    loss_fn: Callable[..., Any] = data.objective.loss
    generator = torch.Generator().manual_seed(job.seed)

    epoch, next_batch, steps, loss_sum, seen = 0, 0, 0, 0.0, 0
    norms: list[float] = []
    resumed_from = 0
    state = checkpoint.load(fingerprint) if checkpoint is not None else None
    if state is not None:
        module.load_state_dict(state.model)
        optimizer.load_state_dict(state.optimizer)
        if scaler is not None and state.scaler is not None:
            scaler.load_state_dict(state.scaler)
        if len(state.rng) == world:
            torch.set_rng_state(state.rng[rank])
        if state.cuda_rng is not None and device.type == "cuda" and len(state.cuda_rng) == world:
            torch.cuda.set_rng_state(state.cuda_rng[rank], device)
        generator.set_state(state.epoch_generator)
        epoch, next_batch, steps = state.epoch, state.next_batch, state.steps
        loss_sum, seen, norms = state.epoch_loss_sum, state.epoch_seen, list(state.grad_norms)
        resumed_from = steps

    spikes = sum(_is_spike(v, norms[:i], settings.spike_factor) for i, v in enumerate(norms))
    skipped = 0
    forward.train()
    epoch_loss = math.nan
    with cuda_numerics(device, settings.amp):
        while epoch < job.epochs:
            epoch_generator = generator.get_state()
            order = torch.randperm(n, generator=generator)
            batches = list(torch.split(order, job.batch_size))
            for index in range(next_batch, len(batches)):
                batch = batches[index]
                scale = world / len(batch)
                mine = torch.tensor_split(batch, world)[rank]
                micro = torch.tensor_split(mine, settings.accumulation_steps)
                optimizer.zero_grad(set_to_none=True)
                step_loss = torch.zeros((), dtype=torch.float64)
                for m, part in enumerate(micro):
                    last = m == len(micro) - 1
                    sync = contextlib.nullcontext() if (last or ddp is None) else ddp.no_sync()  # type: ignore[operator]
                    with sync:
                        xb, yb = x_all[part].to(device), y_all[part].to(device)
                        with torch.autocast(device.type, dtype=amp_dtype or torch.bfloat16, enabled=amp_dtype is not None):
                            data_loss = loss_fn(forward(xb).float(), yb)
                        loss = data_loss * scale
                        step_loss += float(data_loss.detach())
                        if last and job.proximal_mu > 0:
                            prox = proximal_term(module, anchor_t, job.proximal_mu)
                            loss = loss + prox
                            if rank == 0:
                                step_loss += float(prox.detach()) * len(batch)
                        (scaler.scale(loss) if scaler is not None else loss).backward()
                for group in optimizer.param_groups:
                    group["lr"] = job.lr_at(steps)
                if scaler is not None:
                    scaler.unscale_(optimizer)
                max_norm = job.clip_norm if job.clip_norm > 0 else math.inf
                norm = float(torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm))
                if correction_t is not None:
                    for parameter, term in zip(module.parameters(), correction_t, strict=True):
                        if parameter.grad is not None:
                            parameter.grad.add_(term)
                if scaler is not None:
                    before = scaler.get_scale()
                    scaler.step(optimizer)
                    scaler.update()
                    skipped += int(scaler.get_scale() < before)
                else:
                    optimizer.step()
                if all_reduce is not None:
                    all_reduce(step_loss)
                spikes += _is_spike(norm, norms, settings.spike_factor)
                norms.append(norm)
                loss_sum += float(step_loss)
                seen += len(batch)
                steps += 1
                if checkpoint is not None and settings.checkpoint_every and steps % settings.checkpoint_every == 0:
                    _save(checkpoint, fingerprint, module, optimizer, scaler, epoch, index + 1, steps, epoch_generator,
                          loss_sum, seen, norms, rank, device, gather)
            epoch_loss = loss_sum / max(seen, 1)
            epoch, next_batch, loss_sum, seen = epoch + 1, 0, 0.0, 0
    return LoopResult(epoch_loss, n, steps, norms, int(spikes), skipped, resumed_from)


def _save(
    checkpoint: CheckpointFile, fingerprint: str, module: nn.Module, optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None, epoch: int, next_batch: int, steps: int, epoch_generator: torch.Tensor,
    loss_sum: float, seen: int, norms: list[float], rank: int, device: torch.device,
    gather: Callable[[torch.Tensor], list[torch.Tensor]] | None,
) -> None:
    rng = gather(torch.get_rng_state()) if gather is not None else [torch.get_rng_state()]
    cuda_rng = None
    if device.type == "cuda":
        state = torch.cuda.get_rng_state(device)
        cuda_rng = gather(state) if gather is not None else [state]
    if rank != 0:
        return
    checkpoint.save(Checkpoint(
        fingerprint=fingerprint, epoch=epoch, next_batch=next_batch, steps=steps, epoch_generator=epoch_generator,
        model={k: v.detach().cpu().clone() for k, v in module.state_dict().items()},
        optimizer=optimizer.state_dict(), scaler=scaler.state_dict() if scaler is not None else None,
        rng=rng, cuda_rng=cuda_rng, epoch_loss_sum=loss_sum, epoch_seen=seen, grad_norms=list(norms),
    ))
