"""What a department's machine offers the training engine, and how the engine will use it.

These are node settings (node config), not run settings: the same run trains on a laptop or on an
8-GPU server and sends the same kind of update. ``plan_devices`` turns them into a device plan:
with more than one GPU, one DDP worker per GPU over NCCL; on CPU, ``train-workers`` gloo workers
(so the multi-process path runs, and is tested, without a GPU).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from quorumfl.errors import ConfigError

__all__ = ["Amp", "CommHook", "DevicePlan", "EngineSettings", "plan_devices"]


class Amp(StrEnum):
    OFF = "off"
    BF16 = "bf16"  # autocast to bfloat16; no loss scaling needed (CPU or CUDA)
    FP16 = "fp16"  # autocast to float16 with torch.amp.GradScaler (CUDA only)


class CommHook(StrEnum):
    """DDP communication hooks from ``torch.distributed.algorithms.ddp_comm_hooks`` (intra-node traffic)."""

    NONE = "none"
    FP16 = "fp16"  # fp16_compress_hook: gradients travel as float16
    POWERSGD = "powersgd"  # PowerSGD rank-1 low-rank gradients with error feedback


@dataclass(frozen=True)
class EngineSettings:
    device: str = "auto"  # auto | cpu | cuda
    workers: int = 0  # CPU: gloo worker processes (0 = 1); CUDA: GPUs to use (0 = every visible GPU)
    amp: Amp = Amp.OFF
    accumulation_steps: int = 1  # micro-batches per optimizer step on each worker (memory, not math)
    comm_hook: CommHook = CommHook.NONE
    checkpoint_every: int = 0  # optimizer steps between checkpoints; 0 = no checkpoints
    threads_per_worker: int = 1
    spike_factor: float = 10.0  # a step's grad norm above this × the running median is a spike

    def __post_init__(self) -> None:
        problems = []
        for name, enum in (("amp", Amp), ("comm_hook", CommHook)):
            try:
                object.__setattr__(self, name, enum(getattr(self, name)))
            except ValueError:
                problems.append(f"{name.replace('_', '-')} must be one of {[e.value for e in enum]}, "
                                f"got {getattr(self, name)!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            problems.append(f"train-device must be auto, cpu or cuda, got {self.device!r}")
        if self.workers < 0:
            problems.append(f"train-workers must be >= 0 (0 = every GPU, or 1 process on CPU), got {self.workers}")
        if self.accumulation_steps < 1:
            problems.append(f"accumulation-steps must be >= 1, got {self.accumulation_steps}")
        if self.checkpoint_every < 0:
            problems.append(f"checkpoint-every must be >= 0 steps (0 = off), got {self.checkpoint_every}")
        if self.threads_per_worker < 1:
            problems.append(f"torch-threads must be >= 1, got {self.threads_per_worker}")
        if not self.spike_factor > 1:
            problems.append(f"grad-spike-factor must be > 1, got {self.spike_factor}")
        if problems:
            raise ConfigError(problems)

    @classmethod
    def from_node_config(cls, config: Mapping[str, object]) -> EngineSettings:
        """Read the node config keys ``train-device``, ``train-workers``, ``amp``, ``accumulation-steps``,
        ``comm-hook``, ``checkpoint-every``, ``torch-threads``, ``grad-spike-factor``; all problems at once."""
        problems: list[str] = []

        def get(key: str, kind: type, default: object) -> object:
            value = config.get(key, default)
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if not isinstance(value, kind) or isinstance(value, bool):
                problems.append(f"node config '{key}' must be {kind.__name__}, got {value!r}")
                return default
            return value

        def choice(key: str, enum: type[StrEnum], default: StrEnum) -> StrEnum:
            value = get(key, str, default.value)
            try:
                return enum(str(value))
            except ValueError:
                problems.append(f"node config '{key}' must be one of {[e.value for e in enum]}, got {value!r}")
                return default

        values = dict(
            device=get("train-device", str, "auto"),
            workers=get("train-workers", int, 0),
            amp=choice("amp", Amp, Amp.OFF),
            accumulation_steps=get("accumulation-steps", int, 1),
            comm_hook=choice("comm-hook", CommHook, CommHook.NONE),
            checkpoint_every=get("checkpoint-every", int, 0),
            threads_per_worker=get("torch-threads", int, 1),
            spike_factor=get("grad-spike-factor", float, 10.0),
        )
        if problems:
            raise ConfigError(problems)
        return cls(**values)  # type: ignore[arg-type]


@dataclass(frozen=True)
class DevicePlan:
    kind: str  # "cpu" | "cuda"
    world: int  # worker processes (1 = in-process, no torch.distributed)
    backend: str | None  # "gloo" | "nccl" | None for one worker


def plan_devices(settings: EngineSettings, *, cuda_devices: int) -> DevicePlan:
    """Where and how many workers train, given how many CUDA devices the machine shows."""
    if settings.device == "cuda" and cuda_devices == 0:
        raise ConfigError("train-device is 'cuda' but no CUDA device is visible; use train-device='auto' or 'cpu'")
    use_cuda = cuda_devices > 0 and settings.device != "cpu"
    if settings.amp is Amp.FP16 and not use_cuda:
        raise ConfigError("amp='fp16' needs a CUDA device (it uses a GradScaler); use amp='bf16' on CPU")
    if use_cuda:
        world = cuda_devices if settings.workers == 0 else min(settings.workers, cuda_devices)
        return DevicePlan("cuda", world, "nccl" if world > 1 else None)
    world = max(settings.workers, 1)
    return DevicePlan("cpu", world, "gloo" if world > 1 else None)
