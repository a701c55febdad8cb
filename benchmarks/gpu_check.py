"""GPU check of the node training engine: the CUDA path, AMP fp16 (GradScaler) and bf16 steps, and DDP
over NCCL when the machine has two or more GPUs. Run it whenever a GPU machine is available and quote
its output.

Each check trains the same job (synthetic 28×28 images: a class template in noise; the ``cnn`` model,
fixed seeds) with
``training.engine.train_model`` against an fp32 single-device run of it, twice:

- one SGD step (the first batch alone): the weights after it must agree to float tolerance (fp32 on
  CUDA with fp32 on the CPU: 1e-4; fp16 and bf16 with fp32: 1e-2; DDP with one device: 1e-4 on CUDA,
  1e-6 on the CPU);
- the whole job (``--smoke``: 256 examples, 1 epoch; else 4000 examples, 2 epochs): every weight must
  stay finite and, in the full run, every precision must learn (final loss under half of ln 10, the
  loss of a uniform guess). The weights themselves are reported, not checked: over a hundred steps SGD
  amplifies last-bit differences (another summation order: cuDNN's convolutions against the CPU's, two
  DDP halves against one batch) into differences of order 0.01 to 1, at any precision.

DDP runs NCCL over all GPUs (two or more), else 2 gloo workers on the CPU. Without CUDA the script runs the
CPU counterparts (bf16 autocast, 2 gloo workers) so its logic is exercised anywhere.

    python benchmarks/gpu_check.py            # 4000 examples, 2 epochs
    python benchmarks/gpu_check.py --smoke    # 256 examples, 1 epoch
    python benchmarks/gpu_check.py --json     # last line: one JSON object

Keys: cuda, gpus, device_name, torch, step_fp32_cuda_vs_cpu_max_diff, step_fp16_max_diff,
step_bf16_max_diff, step_ddp_vs_single_max_diff, fp32_cuda_vs_cpu_max_diff, fp16_max_diff, fp16_skipped_steps, bf16_max_diff,
loss_cpu_fp32, loss_fp32, loss_fp16, loss_bf16, ddp_world, ddp_backend, ddp_vs_single_max_diff,
steps_per_s_cpu_fp32, steps_per_s_fp32, steps_per_s_fp16, steps_per_s_bf16, steps_per_s_ddp, ok.
"""

from __future__ import annotations

import copy
import math
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


def _sound(model: torch.nn.Module, loss: float, *, learned: bool) -> bool:
    """Finite weights and loss; with ``learned``, a loss under half of a uniform guess's (ln 10)."""
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters()) and bool(np.isfinite(loss))
    return finite and (not learned or loss < 0.5 * math.log(10))


def main() -> None:
    args = parser(__doc__).parse_args()
    n, epochs = (256, 1) if args.smoke else (4000, 2)
    rng = np.random.default_rng(0)
    y = rng.integers(0, 10, size=n).astype(np.int64)  # a noisy template per class: learnable in 2 epochs
    templates = rng.normal(size=(10, 1, 28, 28)).astype(np.float32)
    x = (rng.normal(size=(n, 1, 28, 28)) + 0.5 * templates[y]).astype(np.float32)
    data = Dataset("synthetic", x, y, 10)
    job = TrainJob(epochs=epochs, batch_size=64, learning_rate=0.05, seed=3)
    step_data = Dataset("synthetic", x[:64], y[:64], 10)  # one batch: one SGD step
    step_job = TrainJob(epochs=1, batch_size=64, learning_rate=0.05, seed=3)
    base = build_model("cnn", (1, 28, 28), 10, seed=1)
    gpus = torch.cuda.device_count()
    figures: dict[str, Any] = {"cuda": gpus > 0, "gpus": gpus,
                               "device_name": torch.cuda.get_device_name(0) if gpus else "cpu",
                               "torch": torch.__version__}

    def step(settings: EngineSettings) -> torch.nn.Module:
        model = copy.deepcopy(base)
        train_model(model, step_data, step_job, settings)
        return model

    def whole(settings: EngineSettings, name: str) -> tuple[torch.nn.Module, Any]:
        model = copy.deepcopy(base)
        result, figures[f"steps_per_s_{name}"] = _timed(model, data, job, settings)
        return model, result

    cpu_settings = EngineSettings(device="cpu")
    cpu_step = step(cpu_settings)
    cpu, cpu_result = whole(cpu_settings, "cpu_fp32")
    figures["loss_cpu_fp32"] = cpu_result.loop.loss
    ok = _sound(cpu, cpu_result.loop.loss, learned=not args.smoke)
    if gpus:
        one = EngineSettings(device="cuda", workers=1)
        fp16 = EngineSettings(device="cuda", workers=1, amp=Amp.FP16)
        bf16 = EngineSettings(device="cuda", workers=1, amp=Amp.BF16)
        fp32_step = step(one)
        figures["step_fp32_cuda_vs_cpu_max_diff"] = _diff(fp32_step, cpu_step)
        figures["step_fp16_max_diff"] = _diff(step(fp16), fp32_step)
        figures["step_bf16_max_diff"] = _diff(step(bf16), fp32_step)
        ok &= figures["step_fp32_cuda_vs_cpu_max_diff"] < 1e-4
        ok &= figures["step_fp16_max_diff"] < 1e-2 and figures["step_bf16_max_diff"] < 1e-2
        fp32, result = whole(one, "fp32")
        figures["fp32_cuda_vs_cpu_max_diff"], figures["loss_fp32"] = _diff(fp32, cpu), result.loop.loss
        half, result = whole(fp16, "fp16")
        figures["fp16_max_diff"], figures["loss_fp16"] = _diff(half, fp32), result.loop.loss
        figures["fp16_skipped_steps"] = result.loop.skipped_steps
        bfloat, result = whole(bf16, "bf16")
        figures["bf16_max_diff"], figures["loss_bf16"] = _diff(bfloat, fp32), result.loop.loss
        ok &= all(_sound(m, figures[f"loss_{k}"], learned=not args.smoke)
                  for m, k in ((fp32, "fp32"), (half, "fp16"), (bfloat, "bf16")))
        reference, reference_step = fp32, fp32_step
        ddp_settings = EngineSettings(device="cuda", workers=0) if gpus >= 2 else None
    else:
        bf16 = EngineSettings(device="cpu", amp=Amp.BF16)
        figures["step_bf16_max_diff"] = _diff(step(bf16), cpu_step)
        bfloat, result = whole(bf16, "bf16")
        figures["bf16_max_diff"], figures["loss_bf16"] = _diff(bfloat, cpu), result.loop.loss
        ok &= figures["step_bf16_max_diff"] < 1e-2 and _sound(bfloat, figures["loss_bf16"], learned=not args.smoke)
        reference, reference_step = cpu, cpu_step
        ddp_settings = EngineSettings(device="cpu", workers=2)
    if ddp_settings is not None:
        figures["step_ddp_vs_single_max_diff"] = _diff(step(ddp_settings), reference_step)
        ok &= figures["step_ddp_vs_single_max_diff"] < (1e-4 if gpus else 1e-6)
        ddp, result = whole(ddp_settings, "ddp")
        figures["ddp_world"], figures["ddp_backend"] = result.plan.world, result.plan.backend
        figures["ddp_vs_single_max_diff"] = _diff(ddp, reference)
        ok &= _sound(ddp, result.loop.loss, learned=not args.smoke)
    figures["ok"] = bool(ok)
    report(figures, as_json=args.json)


if __name__ == "__main__":
    main()
