"""Edge INT8: accuracy, size and onnxruntime latency of the QAT INT8 artifact against the fp32 model.

The fp32 model (``cnn-wide`` by default) is trained on Fashion-MNIST's training set with a plain
torch loop, standing in for a promoted federation model; the edge path then runs exactly what
``quorumfl models promote --edge`` runs (``quorumfl.edge.qat.quantize_aware``: pt2e QAT with the
XNNPACK quantizer, per-channel INT8 weights, then ``convert_pt2e``; ``quorumfl.edge.export``).
Both models are exported to ONNX the same way and measured in onnxruntime on the official test set:

- accuracy: top-1 on the 10,000 test images (fp32 and INT8 both through onnxruntime);
- size: bytes of the fp32 ONNX file over the bytes a device downloads for the INT8 artifact (the
  file as one zlib stream, as ``edge sync`` fetches it: ``size_ratio``), and over the INT8 file
  itself (``file_size_ratio``); with ``--sparsity S`` each layer's smallest S of weights are pruned
  before QAT and kept zero (``quorumfl.edge.qat``), which the zlib stream shrinks with;
- latency: median wall time of one ``session.run`` at batch 1 and at batch 64, one intra-op thread
  (an edge CPU), both sessions warmed up and timed alternately in the same loop;
- federated QAT (``qat-rounds``): instead of fine-tuning on the server, ten IID departments (tenths of the
  pool) each fine-tune the fp32 model with fake quantisation for ``--qat-epochs`` on their own tenth,
  ``--qat-rounds`` times, through the node's round function; the example-weighted mean of their
  weights and activation ranges is converted as ``models promote --edge`` does for such a version.
  ``federated_qat_acc`` (its INT8 accuracy in onnxruntime) against ``server_qat_acc`` (= ``int8_acc``:
  QAT on the server's ``--qat-samples`` images);
- delta sync: the fp32 model then trains one more federated round (one local epoch of SGD at lr 0.05
  on each of 10 IID departments' tenth of the pool, averaged: FedAvg), goes through the same QAT
  and export, and the bytes a device holding the first artifact downloads for the second
  (``quorumfl.edge.delta``, as ``edge sync`` fetches it) are compared with the whole file.

- a non-image task (``table_figures``, skipped with ``--no-table``): Ames housing sales, the tabular
  task's ``mlp`` predicting the sale price, metric MAE in dollars; the same QAT (``--table-qat-epochs``,
  its own ``--table-sparsity``, 0 by default: each model is promoted with its own setting), export
  and measures on the department's own test rows. QAT first zeroes
  the first layer's weights for the one-hot slots the model never reads (``zero_unread_inputs``:
  categories below their floor; no output changes), which most of that layer is
  (``table_unread_weights``); ``table_size_ratio_over_fp32_download`` compares with an fp32 download
  that has the same zeros, to show what INT8 itself adds.

    python benchmarks/edge.py            # Fashion-MNIST, cnn-wide, 3 fp32 epochs, 1 QAT epoch; Ames
    python benchmarks/edge.py --smoke    # digits, small cnn, tiny sizes; 400 Ames sales
    python benchmarks/edge.py --json     # last line: one JSON object

Keys: fp32_acc, int8_acc, acc_drop_pts, server_qat_acc, federated_qat_acc, federated_qat_rounds,
federated_qat_departments, federated_qat_s, size_ratio, file_size_ratio, int8_download_bytes, sparsity,
int8_weight_sparsity, latency_speedup_b1, latency_speedup_b64, the
latencies in ms, file sizes, the .pte size, delta_sync_bytes, full_sync_bytes, delta_over_full,
round_int8_acc, times of each step and peak RSS; the table task's table_fp32_mae, table_int8_mae,
table_mae_change_pct, table_size_ratio, table_file_size_ratio, table_sparsity, table_unread_weights,
table_fp32_zeroed_download_bytes, table_size_ratio_over_fp32_download, table_latency_speedup_b1 and its
sizes and latencies (``table_*``).
"""

from __future__ import annotations

import copy
import time
from typing import Any

import numpy as np
import torch
from torch import nn

from _cli import parser, peak_rss_mb, report
from quorumfl.core.data.datasets import holdout_split
from quorumfl.core.models import arrays_to_model, build_model, model_to_arrays
from quorumfl.edge.delta import decode, encode
from quorumfl.edge.export import ArtifactFormat, onnx_bytes, pte_bytes
from quorumfl.edge.qat import QatSettings, quantize_aware, weight_sparsity, zero_unread_inputs
from quorumfl.edge.runtime import load_model


def train_fp32(model: nn.Module, x: np.ndarray, y: np.ndarray, *, epochs: int, batch: int, lr: float, seed: int,
               schedule: bool = True) -> None:
    generator = torch.Generator().manual_seed(seed)
    features, labels = torch.from_numpy(x), torch.from_numpy(y)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    steps = epochs * ((len(x) + batch - 1) // batch) if schedule else 10**9  # no schedule: lr stays as given
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    model.train()
    for _ in range(epochs):
        order = torch.randperm(len(x), generator=generator)
        for i in range(0, len(x), batch):
            idx = order[i : i + batch]
            opt.zero_grad()
            nn.functional.cross_entropy(model(features[idx]), labels[idx]).backward()
            opt.step()
            sched.step()
    model.eval()


def median_latency(sessions: list[Any], x: np.ndarray, repeats: int) -> list[float]:
    for session in sessions:
        for _ in range(5):
            session(x)
    times: list[list[float]] = [[] for _ in sessions]
    for _ in range(repeats):
        for k, session in enumerate(sessions):
            start = time.perf_counter()
            session(x)
            times[k].append(time.perf_counter() - start)
    return [float(np.median(t)) for t in times]


def federated_qat(model: nn.Module, pool: Any, parts: list[np.ndarray], *, model_name: str, rounds: int,
                  epochs: int, learning_rate: float, seed: int) -> tuple[Any, float]:
    """``rounds`` federated QAT rounds (run config ``qat-rounds``) of the departments holding ``parts`` of
    ``pool``, through the node's own round function (``client.node_round.train_round`` with a QAT
    round's train config), FedAvg of what comes back (weights and activation ranges, by example
    count); then the INT8 graph the promotion builds from them (``training.qat.calibrated``). Returns
    (INT8 graph, seconds)."""
    from quorumfl.client.node_round import train_round
    from quorumfl.protocol.wire import TrainConfig
    from quorumfl.training.qat import calibrated, decode_ranges, range_template

    start = time.perf_counter()
    arrays = {**model_to_arrays(model), **range_template(model, pool.input_shape)}
    for number in range(1, rounds + 1):
        config = TrainConfig(server_round=number, model=model_name, local_epochs=epochs, batch_size=64,
                             learning_rate=learning_rate, proximal_mu=0.0, seed=seed, qat=True)
        replies = []
        for part in parts:
            data = pool.subset(np.sort(part))
            replies.append(train_round(config, [arrays], None, data, data.subset(np.arange(min(len(data), 256)))))
        total = sum(r.num_examples for r in replies)
        arrays = {k: sum(r.shared[k].astype(np.float64) * (r.num_examples / total) for r in replies).astype(np.float32)
                  for k in arrays}
    final = copy.deepcopy(model)
    arrays_to_model(final, {k: v for k, v in arrays.items() if k in model_to_arrays(model)})
    final.eval()
    graph = calibrated(final, torch.from_numpy(pool.x[:2]), decode_ranges(arrays))
    return graph, time.perf_counter() - start


def table_figures(*, rows: int, epochs: int, qat_epochs: int, sparsity: float, repeats: int, seed: int) -> dict[str, Any]:
    """The same edge path on a non-image task: Ames housing sales (Debian-packaged, ``./setup.sh
    --city-data``), the tabular task's ``mlp`` predicting the sale price, metric MAE in dollars (lower is
    better). The rows go through the product's import path (schema, ``import_partition``: the
    department's own train/test split); the fp32 model is trained by a plain torch loop with the
    federation's standardisation set from the training rows; QAT fine-tunes on the training rows;
    both are exported to ONNX and measured in onnxruntime on the test rows. Keys are prefixed
    ``table_``."""
    import json
    import tempfile
    from pathlib import Path

    from quorumfl.core.data import import_partition, propose_schema, read_partition
    from quorumfl.core.data.packaged import write_department_files
    from quorumfl.core.tasks import ModelSpec
    from quorumfl.core.tasks.modules import find_statistics
    from quorumfl.training.local import train

    with tempfile.TemporaryDirectory(prefix="edge-table-") as tmp:
        root = Path(tmp)
        [source], pool = write_department_files("ames", root / "files", 1, split="iid", seed=seed, limit=rows)
        schema = propose_schema(pool, "tabular", {"label": "Sale_Price"})
        part = read_partition(import_partition(source, root / "part", department="assessor", schema=schema,
                                               seed=seed).directory)
    spec = ModelSpec("tabular", "mlp", json.dumps(schema, sort_keys=True))
    objective = spec.objective()
    data, test = part.train, part.test
    model = spec.build(seed=seed)
    stats = find_statistics(model)
    if stats is not None:
        stats.set_statistics(torch.from_numpy(np.asarray(data.x, dtype=np.float32)))
    t0 = time.perf_counter()
    train(model, data, epochs=epochs, batch_size=32, learning_rate=0.02, seed=seed)
    model.eval()
    train_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    quantized = quantize_aware(model, data.x, data.y, data.input_shape, objective=objective,
                               settings=QatSettings(epochs=qat_epochs, batch_size=32, seed=seed,
                                                   sparsity=sparsity))
    qat_s = time.perf_counter() - t0
    fp32_file = onnx_bytes(model, torch.from_numpy(data.x[:2]))
    int8_file = onnx_bytes(quantized.module, quantized.example)
    fp32 = load_model(fp32_file, ArtifactFormat.ONNX, data.input_shape, threads=1)
    int8 = load_model(int8_file, ArtifactFormat.ONNX, data.input_shape, threads=1)
    unit = objective.unit

    def mae(runner: Any) -> float:
        return float(np.mean(np.abs(runner(test.x)[:, 0] - test.y)) * unit)

    fp32_mae, int8_mae = mae(fp32), mae(int8)
    b1 = median_latency([fp32, int8], test.x[:1], repeats)
    download = len(encode(int8_file, b""))
    # What quantize_aware zeroed first (exact: inputs the model never reads), and the fp32 download a
    # promotion at --precision fp32 would serve with the same zeros: how much of the ratio is INT8's.
    zeroed = copy.deepcopy(model)
    unread = zero_unread_inputs(zeroed)
    fp32_zeroed_download = len(encode(onnx_bytes(zeroed, torch.from_numpy(data.x[:2])), b""))
    return {
        "table_dataset": "ames",
        "table_model": "mlp",
        "table_params": sum(p.numel() for p in model.parameters()),
        "table_train_rows": len(data),
        "table_test_rows": len(test),
        "table_fp32_mae": fp32_mae,
        "table_int8_mae": int8_mae,
        "table_mae_change_pct": (int8_mae - fp32_mae) / fp32_mae * 100,
        "table_target_mean_abs_dev": float(np.mean(np.abs(test.y - test.y.mean()))) * unit,
        "table_fp32_onnx_bytes": len(fp32_file),
        "table_int8_onnx_bytes": len(int8_file),
        "table_int8_download_bytes": download,
        "table_size_ratio": len(fp32_file) / download,
        "table_file_size_ratio": len(fp32_file) / len(int8_file),
        "table_sparsity": sparsity,
        "table_int8_weight_sparsity": weight_sparsity(quantized.module.buffers()),
        "table_unread_weights": unread,
        "table_fp32_zeroed_download_bytes": fp32_zeroed_download,
        "table_size_ratio_over_fp32_download": fp32_zeroed_download / download,
        "table_fp32_ms_b1": b1[0] * 1e3,
        "table_int8_ms_b1": b1[1] * 1e3,
        "table_latency_speedup_b1": b1[0] / b1[1],
        "table_train_s": train_s,
        "table_qat_s": qat_s,
    }


def main() -> None:
    p = parser(__doc__ or "")
    p.add_argument("--dataset", default="fashion-mnist")
    p.add_argument("--model", default="cnn-wide")
    p.add_argument("--epochs", type=int, default=3, help="fp32 training epochs")
    p.add_argument("--qat-epochs", type=int, default=1)
    p.add_argument("--qat-samples", type=int, default=20000, help="training images used for QAT")
    p.add_argument("--qat-rounds", type=int, default=1, help="federated QAT rounds (of --qat-epochs each)")
    p.add_argument("--repeats", type=int, default=300, help="timed runs per batch size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sparsity", type=float, default=0.0, help="prune this fraction of each layer before QAT")
    p.add_argument("--table-sparsity", type=float, default=0.0, help="--sparsity for the table model")
    p.add_argument("--table-rows", type=int, default=0, help="Ames sales used for the table task (0: all 2,930)")
    p.add_argument("--table-epochs", type=int, default=120, help="fp32 training epochs of the table model")
    p.add_argument("--table-qat-epochs", type=int, default=10, help="QAT epochs of the table model (2,344 rows: cheap)")
    p.add_argument("--no-table", action="store_true", help="skip the table task (it needs ./setup.sh --city-data)")
    args = p.parse_args()
    if args.smoke:
        args.dataset, args.model, args.epochs, args.qat_samples, args.repeats = "digits", "cnn", 2, 400, 20
        args.table_rows, args.table_epochs, args.table_qat_epochs = 400, 5, 1
    torch.manual_seed(args.seed)

    t0 = time.perf_counter()
    pool, test = holdout_split(args.dataset, seed=args.seed)
    model = build_model(args.model, pool.input_shape, pool.num_classes, seed=args.seed)
    train_fp32(model, pool.x, pool.y, epochs=args.epochs, batch=64, lr=0.05, seed=args.seed)
    train_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    rng = np.random.default_rng(args.seed)
    chosen = np.sort(rng.permutation(len(pool))[: args.qat_samples])
    quantized = quantize_aware(model, pool.x[chosen], pool.y[chosen], pool.input_shape,
                               settings=QatSettings(epochs=args.qat_epochs, batch_size=64, seed=args.seed,
                                                   sparsity=args.sparsity))
    qat_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    fp32_file = onnx_bytes(model, torch.from_numpy(pool.x[:2]))
    int8_file = onnx_bytes(quantized.module, quantized.example)
    pte_file = pte_bytes(quantized.module, quantized.example)
    export_s = time.perf_counter() - t0

    fp32 = load_model(fp32_file, ArtifactFormat.ONNX, pool.input_shape, threads=1)
    int8 = load_model(int8_file, ArtifactFormat.ONNX, pool.input_shape, threads=1)
    fp32_acc = float(np.mean(np.concatenate([fp32(test.x[i : i + 500]).argmax(1) for i in range(0, len(test), 500)]) == test.y))
    int8_acc = float(np.mean(np.concatenate([int8(test.x[i : i + 500]).argmax(1) for i in range(0, len(test), 500)]) == test.y))
    b1 = median_latency([fp32, int8], test.x[:1], args.repeats)
    b64 = median_latency([fp32, int8], test.x[:64], max(10, args.repeats // 5))

    # Federated QAT: the departments fine-tune with fake quantisation on their own tenths of the pool
    parts = np.array_split(rng.permutation(len(pool)), 10)
    qat_parts = parts[:3] if args.smoke else parts  # the smoke run checks the path, with three departments
    fed_graph, fed_qat_s = federated_qat(model, pool, qat_parts, model_name=args.model, rounds=args.qat_rounds,
                                         epochs=args.qat_epochs, learning_rate=0.005, seed=args.seed)
    fed_int8 = load_model(onnx_bytes(fed_graph, quantized.example), ArtifactFormat.ONNX, pool.input_shape, threads=1)
    fed_acc = float(np.mean(np.concatenate([fed_int8(test.x[i : i + 500]).argmax(1)
                                            for i in range(0, len(test), 500)]) == test.y))

    # One more federated round (FedAvg of 10 departments' one-epoch updates), promoted the same way
    t0 = time.perf_counter()
    updates = []
    for part in parts:
        local = copy.deepcopy(model)
        train_fp32(local, pool.x[part], pool.y[part], epochs=1, batch=64, lr=0.05, seed=args.seed, schedule=False)
        updates.append((model_to_arrays(local), len(part)))
    total = sum(n for _, n in updates)
    averaged = {k: sum(a[k] * (n / total) for a, n in updates).astype(np.float32) for k in updates[0][0]}
    next_model = copy.deepcopy(model)
    arrays_to_model(next_model, averaged)
    next_model.eval()
    next_quantized = quantize_aware(next_model, pool.x[chosen], pool.y[chosen], pool.input_shape,
                                    settings=QatSettings(epochs=args.qat_epochs, batch_size=64, seed=args.seed,
                                                         sparsity=args.sparsity))
    next_file = onnx_bytes(next_quantized.module, next_quantized.example)
    patch = encode(next_file, int8_file)
    assert decode(patch, int8_file, len(next_file)) == next_file
    next_int8 = load_model(next_file, ArtifactFormat.ONNX, pool.input_shape, threads=1)
    round_acc = float(np.mean(np.concatenate([next_int8(test.x[i : i + 500]).argmax(1)
                                              for i in range(0, len(test), 500)]) == test.y))
    round_s = time.perf_counter() - t0

    table = {} if args.no_table else table_figures(rows=args.table_rows, epochs=args.table_epochs,
                                                   qat_epochs=args.table_qat_epochs, sparsity=args.table_sparsity,
                                                   repeats=args.repeats, seed=args.seed)
    report({
        "dataset": args.dataset,
        "model": args.model,
        "fp32_epochs": args.epochs,
        "qat_epochs": args.qat_epochs,
        "qat_samples": int(len(chosen)),
        "fp32_acc": fp32_acc,
        "int8_acc": int8_acc,
        "acc_drop_pts": round((fp32_acc - int8_acc) * 100, 3),
        "server_qat_acc": int8_acc,
        "federated_qat_acc": fed_acc,
        "federated_qat_rounds": args.qat_rounds,
        "federated_qat_departments": len(qat_parts),
        "federated_qat_s": fed_qat_s,
        "fp32_onnx_bytes": len(fp32_file),
        "int8_onnx_bytes": len(int8_file),
        "int8_pte_bytes": len(pte_file),
        "size_ratio": len(fp32_file) / len(encode(int8_file, b"")),  # what a device downloads: one zlib stream
        "file_size_ratio": len(fp32_file) / len(int8_file),
        "int8_download_bytes": len(encode(int8_file, b"")),
        "sparsity": args.sparsity,
        "int8_weight_sparsity": weight_sparsity(quantized.module.buffers()),
        "fp32_ms_b1": b1[0] * 1e3,
        "int8_ms_b1": b1[1] * 1e3,
        "fp32_ms_b64": b64[0] * 1e3,
        "int8_ms_b64": b64[1] * 1e3,
        "latency_speedup_b1": b1[0] / b1[1],
        "latency_speedup_b64": b64[0] / b64[1],
        "full_sync_bytes": len(encode(next_file, b"")),  # a device holding nothing: the file as one zlib stream
        "delta_sync_bytes": len(patch),
        "delta_over_full": len(patch) / len(encode(next_file, b"")),
        "round_int8_onnx_bytes": len(next_file),
        "round_int8_acc": round_acc,
        "round_s": round_s,
        "train_s": train_s,
        "qat_s": qat_s,
        "export_s": export_s,
        **table,
        "peak_rss_mb": peak_rss_mb(),
    }, as_json=args.json)


if __name__ == "__main__":
    main()
