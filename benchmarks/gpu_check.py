"""GPU check of the node training engine: the CUDA path, AMP fp16 (GradScaler) and bf16 steps, and DDP
over NCCL when the machine has two or more GPUs. Run it whenever a GPU machine is available and quote
its output.

Each check trains the same job (synthetic 28×28 images, the ``cnn`` model, fixed seeds) with
``training.engine.train_model`` and compares the weights with an fp32 single-device run of the same job:
fp32 on CUDA must agree with fp32 on the CPU to float tolerance; AMP runs must stay close and finite;
NCCL DDP (all GPUs) must agree with one GPU on the same global batch. Without CUDA the script runs the
CPU counterparts (bf16 autocast, 2 gloo workers) so its logic is exercised anywhere.

    python benchmarks/gpu_check.py            # 4000 examples, 2 epochs
    python benchmarks/gpu_check.py --smoke    # 256 examples, 1 epoch
    python benchmarks/gpu_check.py --json     # last line: one JSON object

Keys: cuda, gpus, device_name, fp32_cuda_vs_cpu_max_diff, fp16_max_diff, fp16_skipped_steps, bf16_max_diff,
ddp_world, ddp_backend, ddp_vs_single_max_diff, steps_per_s_fp32, steps_per_s_fp16, steps_per_s_bf16, ok.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import numpy as np
import torch

from _cli import parser, report
from quorumfl.core.data.datasets import Dataset
from quorumfl.core.models import build_model
from quorumfl.training.engine import Amp, EngineSettings, TrainJob, train_model


def _diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(float((u.float() - v.float()).abs().max())
               for u, v in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def _timed(model: torch.nn.Module, data: Dataset, job: TrainJob, settings: EngineSettings) -> tuple[Any, float]:
    started = time.perf_counter()
    result = train_model(model, data, job, settings)
    elapsed = time.perf_counter() - started
    return result, result.loop.steps / elapsed


def main() -> None:
    args = parser(__doc__).parse_args()
    n, epochs = (256, 1) if args.smoke else (4000, 2)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 1, 28, 28)).astype(np.float32)
    y = (x.reshape(n, -1)[:, :10].argmax(axis=1)).astype(np.int64)
    data = Dataset("synthetic", x, y, 10)
    job = TrainJob(epochs=epochs, batch_size=64, learning_rate=0.05, seed=3)
    base = build_model("cnn", (1, 28, 28), 10, seed=1)
    gpus = torch.cuda.device_count()
    figures: dict[str, Any] = {"cuda": gpus > 0, "gpus": gpus,
                               "device_name": torch.cuda.get_device_name(0) if gpus else "cpu",
                               "torch": torch.__version__}
    cpu = copy.deepcopy(base)
    _, figures["steps_per_s_cpu_fp32"] = _timed(cpu, data, job, EngineSettings(device="cpu"))
    ok = True
    if gpus:
        one = EngineSettings(device="cuda", workers=1)
        fp32 = copy.deepcopy(base)
        _, figures["steps_per_s_fp32"] = _timed(fp32, data, job, one)
        figures["fp32_cuda_vs_cpu_max_diff"] = _diff(fp32, cpu)
        fp16 = copy.deepcopy(base)
        result, figures["steps_per_s_fp16"] = _timed(fp16, data, job, EngineSettings(device="cuda", workers=1,
                                                                                       amp=Amp.FP16))
        figures["fp16_max_diff"] = _diff(fp16, fp32)
        figures["fp16_skipped_steps"] = result.loop.skipped_steps
        bf16 = copy.deepcopy(base)
        _, figures["steps_per_s_bf16"] = _timed(bf16, data, job, EngineSettings(device="cuda", workers=1,
                                                                                amp=Amp.BF16))
        figures["bf16_max_diff"] = _diff(bf16, fp32)
        ok &= figures["fp32_cuda_vs_cpu_max_diff"] < 1e-3 and figures["fp16_max_diff"] < 0.05
        ok &= figures["bf16_max_diff"] < 0.1 and all(torch.isfinite(p).all() for p in fp16.parameters())
        reference = fp32
        ddp_settings = EngineSettings(device="cuda", workers=0) if gpus >= 2 else None
    else:
        bf16 = copy.deepcopy(base)
        _, figures["steps_per_s_bf16"] = _timed(bf16, data, job, EngineSettings(device="cpu", amp=Amp.BF16))
        figures["bf16_max_diff"] = _diff(bf16, cpu)
        ok &= figures["bf16_max_diff"] < 0.1
        reference = cpu
        ddp_settings = EngineSettings(device="cpu", workers=2)
    if ddp_settings is not None:
        ddp = copy.deepcopy(base)
        result, figures["steps_per_s_ddp"] = _timed(ddp, data, job, ddp_settings)
        figures["ddp_world"], figures["ddp_backend"] = result.plan.world, result.plan.backend
        figures["ddp_vs_single_max_diff"] = _diff(ddp, reference)
        ok &= figures["ddp_vs_single_max_diff"] < (1e-3 if gpus else 1e-5)
    figures["ok"] = bool(ok)
    report(figures, as_json=args.json)


if __name__ == "__main__":
    main()
