"""The training engine against a plain torch loop: one process, 2 gloo DDP workers, accumulation,
clipping, warm-up; device planning; checkpoints that survive SIGKILL and resume to the same weights."""

from __future__ import annotations

import copy
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from quorumfl.core.data.datasets import Dataset
from quorumfl.core.models import build_model
from quorumfl.errors import ConfigError, TrainingError
from quorumfl.training.engine import (
    Amp,
    CheckpointFile,
    CommHook,
    EngineSettings,
    TrainJob,
    plan_devices,
    train_model,
)
from quorumfl.training.engine.loop import _is_spike, cuda_numerics

HERE = Path(__file__).parent


def _data(n: int = 203, seed: int = 0) -> Dataset:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 1, 8, 8)).astype(np.float32)
    return Dataset("synthetic", x, rng.integers(0, 10, n).astype(np.int64), 10)


def _plain_loop(model: nn.Module, data: Dataset, job: TrainJob) -> None:
    """The obviously-correct reference: one process, the whole global batch at once."""
    x, y = torch.from_numpy(data.x), torch.from_numpy(data.y)
    anchor = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=job.learning_rate, momentum=job.momentum)
    gen = torch.Generator().manual_seed(job.seed)
    step = 0
    for _ in range(job.epochs):
        order = torch.randperm(len(y), generator=gen)
        for start in range(0, len(y), job.batch_size):
            batch = order[start : start + job.batch_size]
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x[batch]), y[batch])
            loss = loss + 0.5 * job.proximal_mu * sum((p - a).pow(2).sum() for p, a in zip(model.parameters(), anchor, strict=False))
            loss.backward()
            if job.clip_norm > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), job.clip_norm)
            for g in opt.param_groups:
                g["lr"] = job.lr_at(step)
            opt.step()
            step += 1


def _max_diff(a: nn.Module, b: nn.Module) -> float:
    return max(float((u - v).abs().max()) for u, v in zip(a.state_dict().values(), b.state_dict().values(), strict=False))


JOB = TrainJob(epochs=2, batch_size=32, learning_rate=0.05, proximal_mu=0.1, seed=3, clip_norm=1.0, warmup_steps=4)


def test_single_process_matches_plain_loop() -> None:
    model = build_model("mlp", (1, 8, 8), 10, seed=1)
    reference = copy.deepcopy(model)
    _plain_loop(reference, _data(), JOB)
    result = train_model(model, _data(), JOB, EngineSettings(device="cpu"))
    assert result.plan.world == 1
    assert result.loop.steps == 2 * math.ceil(203 / 32)
    assert _max_diff(model, reference) < 1e-6


def test_two_gloo_workers_match_single_process() -> None:
    # 203 examples: the last global batch (11) splits unevenly over 2 workers × 3 micro-batches.
    data = _data()
    single = build_model("mlp", (1, 8, 8), 10, seed=1)
    ddp = copy.deepcopy(single)
    reference = copy.deepcopy(single)
    _plain_loop(reference, data, JOB)
    train_model(single, data, JOB, EngineSettings(device="cpu"))
    result = train_model(ddp, data, JOB, EngineSettings(device="cpu", workers=2, accumulation_steps=3))
    assert (result.plan.world, result.plan.backend) == (2, "gloo")
    assert _max_diff(ddp, single) < 1e-5
    assert _max_diff(ddp, reference) < 1e-5
    assert _max_diff(ddp, build_model("mlp", (1, 8, 8), 10, seed=1)) > 1e-3  # it did train


def test_comm_hooks_and_bf16_stay_close_to_fp32() -> None:
    data = _data()
    base = build_model("mlp", (1, 8, 8), 10, seed=1)
    exact = copy.deepcopy(base)
    train_model(exact, data, JOB, EngineSettings(device="cpu"))
    fp16 = copy.deepcopy(base)
    train_model(fp16, data, JOB, EngineSettings(device="cpu", workers=2, comm_hook=CommHook.FP16))
    assert _max_diff(fp16, exact) < 1e-3
    bf16 = copy.deepcopy(base)
    result = train_model(bf16, data, JOB, EngineSettings(device="cpu", amp=Amp.BF16))
    assert 0 < _max_diff(bf16, exact) < 2e-2  # bf16 keeps ~3 significant digits
    assert math.isfinite(result.loop.loss)


def test_learning_rate_schedule() -> None:
    job = TrainJob(epochs=1, batch_size=256, learning_rate=0.1, warmup_steps=4, lr_reference_batch=64)
    assert job.base_lr() == pytest.approx(0.4)  # linear scaling: 0.1 × 256 / 64
    assert [job.lr_at(s) for s in range(6)] == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.4, 0.4])
    with pytest.raises(ConfigError) as err:
        TrainJob(epochs=0, batch_size=0, learning_rate=0.0, clip_norm=-1.0)
    assert len(err.value.problems) == 4


def test_spike_rule() -> None:
    history = [1.0, 1.1, 0.9, 1.0, 1.05]
    assert not _is_spike(50.0, history[:4], 10.0)  # too little history to judge
    assert _is_spike(50.0, history, 10.0)
    assert not _is_spike(9.0, history, 10.0)
    assert not _is_spike(math.inf, history, 10.0)  # an fp16 overflow is a skipped step, not a spike


def test_device_plan() -> None:
    assert plan_devices(EngineSettings(), cuda_devices=0) == plan_devices(EngineSettings(workers=1), cuda_devices=0)
    assert plan_devices(EngineSettings(workers=2), cuda_devices=0).backend == "gloo"
    gpus = plan_devices(EngineSettings(), cuda_devices=4)
    assert (gpus.kind, gpus.world, gpus.backend) == ("cuda", 4, "nccl")
    assert plan_devices(EngineSettings(workers=2), cuda_devices=4).world == 2
    assert plan_devices(EngineSettings(), cuda_devices=1).backend is None
    assert plan_devices(EngineSettings(device="cpu"), cuda_devices=4).kind == "cpu"
    with pytest.raises(ConfigError, match="amp='fp16' needs a CUDA device"):
        plan_devices(EngineSettings(amp=Amp.FP16), cuda_devices=0)
    with pytest.raises(ConfigError, match="no CUDA device"):
        plan_devices(EngineSettings(device="cuda"), cuda_devices=0)


def test_node_config_errors_are_reported_together() -> None:
    settings = EngineSettings.from_node_config({"train-workers": 2, "amp": "bf16", "checkpoint-every": 50})
    assert (settings.workers, settings.amp, settings.checkpoint_every) == (2, Amp.BF16, 50)
    with pytest.raises(ConfigError) as err:
        EngineSettings.from_node_config({"train-workers": "two", "amp": "fp8", "comm-hook": "zip"})
    assert len(err.value.problems) == 3
    assert "amp" in str(err.value) and "comm-hook" in str(err.value)


def test_a_checkpoint_of_another_job_is_not_resumed(tmp_path: Path) -> None:
    data = _data()
    ckpt = tmp_path / "train.pt"
    first = build_model("mlp", (1, 8, 8), 10, seed=1)
    other_job = TrainJob(epochs=1, batch_size=32, learning_rate=0.05, seed=99)
    settings = EngineSettings(device="cpu", checkpoint_every=2)
    # A stale checkpoint of a different job sits in the file: it must be ignored, then replaced.
    from quorumfl.training.engine import launch
    stale = launch._job_fingerprint(first, data, other_job, None)
    CheckpointFile(ckpt).save(_fake_checkpoint(stale, first))
    result = train_model(first, data, JOB, settings, checkpoint=ckpt)
    assert result.loop.resumed_from_step == 0
    assert not ckpt.exists()  # removed once the job finished
    reference = build_model("mlp", (1, 8, 8), 10, seed=1)
    _plain_loop(reference, data, JOB)
    assert _max_diff(first, reference) < 1e-6


def _fake_checkpoint(key: str, model: nn.Module):  # type: ignore[no-untyped-def]
    from quorumfl.training.engine.checkpoint import Checkpoint

    return Checkpoint(fingerprint=key, epoch=0, next_batch=3, steps=3, epoch_generator=torch.Generator().get_state(),
                      model={k: v + 1 for k, v in model.state_dict().items()}, optimizer={}, scaler=None,
                      rng=[torch.get_rng_state()], cuda_rng=None, epoch_loss_sum=0.0, epoch_seen=0, grad_norms=[])


def test_unreadable_checkpoint_fails_with_the_fix(tmp_path: Path) -> None:
    ckpt = tmp_path / "train.pt"
    ckpt.write_bytes(b"not a checkpoint")
    with pytest.raises(TrainingError, match="delete it"):
        train_model(build_model("mlp", (1, 8, 8), 10), _data(), JOB,
                    EngineSettings(device="cpu", checkpoint_every=2), checkpoint=ckpt)
    assert ckpt.read_bytes() == b"not a checkpoint"  # nothing stored is overwritten on the way out


def _run_job(ckpt: Path, out: Path, workers: int, *, kill_at_checkpoint: bool, kind: str = "image") -> dict[str, int] | None:
    scratch = out.parent / "tmp"  # a SIGKILL leaves the job's temporary folders behind: here, not in /tmp
    scratch.mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
           "TMPDIR": str(scratch)}
    proc = subprocess.Popen([sys.executable, str(HERE / "engine_job.py"), str(ckpt), str(out), str(workers), kind],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        if kill_at_checkpoint:
            deadline = time.monotonic() + 120
            while not ckpt.exists():
                assert proc.poll() is None, f"job ended before its first checkpoint: {proc.communicate()}"
                assert time.monotonic() < deadline, "no checkpoint within 120 s"
                time.sleep(0.005)
            os.killpg(proc.pid, signal.SIGKILL)  # the node and its DDP workers die mid-training
            proc.wait(timeout=30)
            return None
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr
        return json.loads(stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.slow  # three training processes each (27-37 s): the default suite stays under its 8 minutes
@pytest.mark.parametrize(("workers", "kind"), [(1, "image"), (2, "image"), (1, "text"), (1, "tabular")])
def test_sigkill_mid_training_resumes_to_the_same_weights(tmp_path: Path, workers: int, kind: str) -> None:
    """Also for the text task's embedding bag (int64 ids) and the tabular task's standardised MLP,
    whose buffers (the federation's statistics) must come back with the weights."""
    uninterrupted = _run_job(tmp_path / "a.pt", tmp_path / "a-out.pt", workers, kill_at_checkpoint=False, kind=kind)
    assert uninterrupted is not None and uninterrupted["resumed_from_step"] == 0

    ckpt = tmp_path / "b.pt"
    assert _run_job(ckpt, tmp_path / "b-out.pt", workers, kill_at_checkpoint=True, kind=kind) is None
    assert ckpt.exists() and not (tmp_path / "b-out.pt").exists()
    resumed = _run_job(ckpt, tmp_path / "b-out.pt", workers, kill_at_checkpoint=False, kind=kind)
    assert resumed is not None
    assert 0 < resumed["resumed_from_step"] < uninterrupted["steps"]
    assert resumed["steps"] == uninterrupted["steps"]
    a = torch.load(tmp_path / "a-out.pt", weights_only=True)
    b = torch.load(tmp_path / "b-out.pt", weights_only=True)
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=0, atol=0)
    assert not ckpt.exists()


def _task_data(kind: str, n: int = 203) -> tuple[nn.Module, Dataset]:
    """The text task's embedding bag on int64 token ids, or the tabular task's standardised MLP on a
    regression target (float32, squared error)."""
    from quorumfl.core.tasks import Regression
    from quorumfl.core.tasks.modules import HashedBag, Standardize

    rng = np.random.default_rng(4)
    torch.manual_seed(1)
    if kind == "text":
        x = rng.integers(0, 60, size=(n, 9)).astype(np.int64)
        x[:, 0] = rng.integers(1, 60, size=n)  # no empty document
        return HashedBag(60, 8, 4), Dataset("text", x, rng.integers(0, 4, n).astype(np.int64), 4)
    stats = Standardize(6)
    features = rng.random((n, 6)).astype(np.float32)
    stats.set_statistics(torch.from_numpy(features))
    model = nn.Sequential(stats, nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 1))
    target = (features @ rng.random(6)).astype(np.float32) / 6
    return model, Dataset("tabular", features, target, 1, Regression(scale=1000.0))


@pytest.mark.parametrize("kind", ["text", "tabular"])
def test_two_gloo_workers_match_one_process_on_the_text_and_tabular_tasks(kind: str) -> None:
    model, data = _task_data(kind)
    job = TrainJob(epochs=2, batch_size=32, learning_rate=0.05, proximal_mu=0.0, seed=3)
    single, ddp, reference = model, copy.deepcopy(model), copy.deepcopy(model)
    x, y = torch.from_numpy(data.x), torch.from_numpy(data.y)  # the plain loop, with the task's own loss
    opt = torch.optim.SGD(reference.parameters(), lr=job.learning_rate, momentum=job.momentum)
    gen = torch.Generator().manual_seed(job.seed)
    for _ in range(job.epochs):
        order = torch.randperm(len(y), generator=gen)
        for start in range(0, len(y), job.batch_size):
            batch = order[start : start + job.batch_size]
            opt.zero_grad()
            data.objective.loss(reference(x[batch]), y[batch], reduction="mean").backward()
            opt.step()
    train_model(single, data, job, EngineSettings(device="cpu"))
    result = train_model(ddp, data, job, EngineSettings(device="cpu", workers=2, accumulation_steps=2))
    assert (result.plan.world, result.plan.backend) == (2, "gloo")
    assert _max_diff(single, reference) < 1e-5
    assert _max_diff(ddp, reference) < 1e-5
    assert _max_diff(ddp, _task_data(kind)[0]) > 1e-3  # it did train


def test_cuda_numerics_keeps_float32_exact_unless_amp_and_restores_the_process_flags() -> None:
    """The flags are plain process settings (no GPU needed to set them): without AMP a CUDA loop runs
    with TF32 off and deterministic cuDNN; with AMP TF32 stays as it was; on the CPU nothing changes;
    afterwards the process has its own settings back."""
    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    saved = (cudnn.allow_tf32, matmul.allow_tf32, cudnn.deterministic, cudnn.benchmark)
    try:
        cudnn.allow_tf32, matmul.allow_tf32, cudnn.deterministic, cudnn.benchmark = True, True, False, True
        with cuda_numerics(torch.device("cuda"), Amp.OFF):
            assert (cudnn.allow_tf32, matmul.allow_tf32, cudnn.deterministic, cudnn.benchmark) == (False, False, True, False)
        with cuda_numerics(torch.device("cuda"), Amp.BF16):
            assert (cudnn.allow_tf32, matmul.allow_tf32, cudnn.deterministic, cudnn.benchmark) == (True, True, True, False)
        with cuda_numerics(torch.device("cpu"), Amp.OFF):
            assert (cudnn.allow_tf32, matmul.allow_tf32, cudnn.deterministic, cudnn.benchmark) == (True, True, False, True)
        assert (cudnn.allow_tf32, matmul.allow_tf32, cudnn.deterministic, cudnn.benchmark) == (True, True, False, True)
    finally:
        cudnn.allow_tf32, matmul.allow_tf32, cudnn.deterministic, cudnn.benchmark = saved
