"""CI smoke runs of the benchmarks: tiny sizes, and the last line is one JSON object with the keys
the benchmark promises (no timing assertions: figures are for people, quoted from full runs)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _run(script: str) -> dict[str, object]:
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--smoke", "--json"],
        capture_output=True, text=True, timeout=600, cwd=BENCHMARKS,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert isinstance(figures, dict)
    return figures


def test_aggregate_throughput_smoke() -> None:
    figures = _run("aggregate_throughput.py")
    keys = {"mean_s", "copy_s", "fraction_of_copy_bandwidth", "read_s", "read_fraction_of_copy_bandwidth",
            "masked_sum_s", "masked_fraction_of_copy_bandwidth",
            "ckks_sum_s", "ckks_fraction_of_copy_bandwidth", "ckks_unpack_s", "max_error_over_bound", "peak_rss_mb"}
    assert keys <= set(figures)
    assert all(float(figures[k]) > 0 for k in keys - {"max_error_over_bound"})  # type: ignore[arg-type]
    assert float(figures["max_error_over_bound"]) <= 1.0  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.xdist_group("heavy-federations")  # one at a time (docs/development.md)
def test_round_overhead_smoke() -> None:
    figures = _run("round_overhead.py")
    keys = {"flower_round_s", "flower_warm_round_s", "plain_round_s", "plain_before_round_s", "plain_after_round_s",
            "masked_round_s", "ckks_round_s", "plain_overhead_s", "quorumfl_over_flower", "quorumfl_over_flower_warm",
            "masked_over_plain", "ckks_over_plain", "server_peak_rss_mb"}
    assert keys <= set(figures)
    # the plaintext round is the median over both plaintext runs (before and after the secure ones)
    low, high = sorted(float(figures[k]) for k in ("plain_before_round_s", "plain_after_round_s"))  # type: ignore[arg-type]
    assert low <= float(figures["plain_round_s"]) <= high  # type: ignore[arg-type]
    for mode in ("flower", "flower_warm", "plain", "masked", "ckks"):  # a round includes its slowest node's training
        assert float(figures[f"{mode}_round_s"]) >= float(figures[f"{mode}_train_s"]) > 0  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.xdist_group("heavy-federations")  # one at a time (docs/development.md)
def test_secagg_smoke() -> None:
    figures = _run("secagg.py")
    keys = {"plain_round_s", "masked_round_s", "flower_secaggplus_round_s", "masked_over_plain", "overhead_ratio"}
    assert keys <= set(figures)
    assert all(float(figures[k]) > 0 for k in ("plain_round_s", "masked_round_s", "flower_secaggplus_round_s"))  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.xdist_group("heavy-federations")  # one at a time (docs/development.md)
def test_threshold_ckks_smoke() -> None:
    figures = _run("threshold_ckks.py")
    keys = {"plain_round_s", "ckks_round_s", "single_key_round_s", "ckks_over_plain", "encrypt_s_per_client",
            "bytes_per_client", "partial_decrypt_s", "combine_s", "max_abs_error", "tag_s_per_client",
            "tag_bytes_per_client", "tag_check_s", "decrypt_request_tag_bytes"}
    assert keys <= set(figures)
    assert all(float(figures[k]) > 0 for k in keys - {"max_abs_error"})  # type: ignore[arg-type]
    # the step-by-step decryption matched numpy's sum within 6σ of the documented error
    assert float(figures["max_abs_error"]) <= 6 * float(figures["predicted_error_std"])  # type: ignore[arg-type]


@pytest.mark.slow  # ~10 s: the default suite stays under its 8 minutes
def test_heterogeneity_smoke() -> None:
    figures = _run("heterogeneity.py")
    keys = {"fedavg_mean_acc", "fedprox_mean_acc", "ifca_mean_acc", "fedper_mean_acc", "ditto_mean_acc",
            "local_only_mean_acc", "fedavg_worst_acc", "best_worst_acc", "best_minus_fedavg_pts", "planted_purity"}
    assert keys <= set(figures)
    assert all(0.0 <= float(figures[k]) <= 1.0 for k in keys - {"best_minus_fedavg_pts"})  # type: ignore[arg-type]
    (reference,) = figures["fedavg_plain_torch_mean_acc_per_seed"]  # type: ignore[misc]
    (gap,) = figures["fedavg_minus_plain_torch_pts_per_seed"]  # type: ignore[misc]
    assert 0.0 <= reference <= 1.0 and gap == pytest.approx(100 * (float(figures["fedavg_mean_acc"]) - reference))
    assert isinstance(figures["goal_fedavg_matches_plain_torch_every_seed"], bool)
    (tuned,) = figures["fedavg_finetune_mean_acc_per_seed"]  # type: ignore[misc]
    (alone_extra,) = figures["local_only_extra_epochs_mean_acc_per_seed"]  # type: ignore[misc]
    bar = max(float(figures["local_only_mean_acc"]), alone_extra)
    assert 0.0 <= tuned <= 1.0 and figures["fedavg_finetune_minus_local_only_pts_per_seed"] == [
        pytest.approx(100 * (tuned - bar))]


@pytest.mark.slow  # ~10 s: the default suite stays under its 8 minutes
def test_compression_smoke() -> None:
    figures = _run("compression.py")
    keys = {"none_acc", "topk_acc", "sign_acc", "int8_acc", "shared_randk_acc", "topk_byte_reduction",
            "topk_acc_loss_pts"}
    assert keys <= set(figures)
    assert float(figures["topk_byte_reduction"]) > 20  # type: ignore[arg-type]  # 1 % of a 17k-parameter model


@pytest.mark.slow  # tens of seconds: the default suite stays under its 8 minutes
def test_dp_smoke() -> None:
    figures = _run("dp.py")
    assert {"epsilon", "dp_acc", "nondp_acc"} <= set(figures)
    assert 0 < float(figures["epsilon"]) <= 3.0 * 1.001  # type: ignore[arg-type]  # the ledger never passes the target


@pytest.mark.slow  # tens of seconds: the default suite stays under its 8 minutes
def test_gpu_check_smoke() -> None:
    figures = _run("gpu_check.py")  # without CUDA: the CPU counterparts (bf16, 2 gloo workers)
    assert {"cuda", "gpus", "step_bf16_max_diff", "step_ddp_vs_single_max_diff", "bf16_max_diff", "ok"} <= set(figures)
    assert figures["ok"] is True


@pytest.mark.slow  # ~10 s: the default suite stays under its 8 minutes
def test_selection_smoke() -> None:
    figures = _run("selection.py")
    keys = {"random_time_to_target", "oort_time_to_target", "rl_time_to_target", "rl_speedup_vs_random",
            "rl_over_oort", "random_final_acc", "oort_final_acc", "rl_final_acc", "peak_rss_mb"}
    assert keys <= set(figures)
    assert all(float(figures[k]) > 0 for k in keys)  # type: ignore[arg-type]


@pytest.mark.slow
def test_edge_smoke() -> None:
    figures = _run("edge.py")
    keys = {"fp32_acc", "int8_acc", "size_ratio", "latency_speedup_b1", "latency_speedup_b64", "delta_sync_bytes",
            "full_sync_bytes", "round_int8_acc", "server_qat_acc", "federated_qat_acc", "federated_qat_s"}
    assert keys <= set(figures)
    assert all(float(figures[k]) > 0 for k in keys)  # type: ignore[arg-type]
    assert float(figures["int8_onnx_bytes"]) < float(figures["fp32_onnx_bytes"])  # type: ignore[arg-type]
    assert float(figures["delta_sync_bytes"]) < float(figures["full_sync_bytes"])  # type: ignore[arg-type]
    table = {"table_fp32_mae", "table_int8_mae", "table_size_ratio", "table_latency_speedup_b1"}  # the non-image task
    assert table <= set(figures) and all(float(figures[k]) > 0 for k in table)  # type: ignore[arg-type]
    assert float(figures["table_int8_onnx_bytes"]) < float(figures["table_fp32_onnx_bytes"])  # type: ignore[arg-type]
    assert {"table_unread_weights", "table_size_ratio_over_fp32_download", "table_sparsity"} <= set(figures)


@pytest.mark.slow
def test_load_smoke() -> None:
    figures = _run("load.py")
    assert {"nodes", "rounds_completed", "participants", "failures", "connect_s", "run_s", "round_s",
            "federation_peak_rss_mb", "machine_used_peak_mb", "superlink_peak_rss_mb", "serverapp_peak_rss_mb"} <= set(figures)
    assert figures["rounds_completed"] == 1 and figures["participants"] == figures["nodes"] == 5


@pytest.mark.slow
def test_tasks_smoke() -> None:
    """Real Debian-packaged data (the README's test command runs ./setup.sh --city-data)."""
    figures = _run("tasks.py")
    for dataset, metric, skewed in (("ames", "mae", "natural"), ("wordnet", "accuracy", "dirichlet")):
        for split in ("iid", skewed):
            for method in ("fedavg", "best", "central", "local"):
                value = float(figures[f"{dataset}_{split}_{method}_{metric}"])  # type: ignore[arg-type]
                assert (value > 0) if metric == "mae" else (0.0 <= value <= 1.0)
        assert isinstance(figures[f"{dataset}_iid_fedavg_vs_central_ok"], bool)
        assert isinstance(figures[f"{dataset}_{skewed}_best_ok"], bool)


@pytest.mark.slow  # ~10 s: the default suite stays under its 8 minutes
def test_robustness_smoke() -> None:
    figures = _run("robustness.py")
    keys = {"clean_acc", "attacked_fedavg_acc", "attacked_norm_bound_acc", "attacked_trimmed_mean_acc",
            "attacked_median_acc", "attacked_krum_acc"}
    assert keys <= set(figures) and {"flagged_round", "false_flags"} <= set(figures)
    assert all(0.0 <= float(figures[k]) <= 1.0 for k in keys)  # type: ignore[arg-type]
    assert figures["flagged_round"] == figures["attack_from"]  # flagged in the round the attack starts


@pytest.mark.slow
def test_scale_smoke() -> None:
    figures = _run("scale.py")
    keys = {"departments", "plain_round_s", "masked_round_s", "masked_over_plain", "ckks_round_s",
            "server_peak_rss_mb", "stage_seconds", "memory_goal_mb"}
    assert keys <= set(figures)
    assert figures["errors"] == {} and figures["participants"] == {"plain": [6, 6], "masked": [6, 6], "ckks": [4, 4]}
    assert {"train", "secagg-unmask"} <= set(figures["stage_seconds"]["masked"])  # type: ignore[index]


def test_cli_start_smoke() -> None:
    figures = _run("cli_start.py")
    keys = {"help_median_s", "runs_list_median_s", "runs_list_json_median_s", "runs_show_median_s",
            "command_peak_rss_mb"}
    assert keys <= set(figures) and all(float(figures[k]) > 0 for k in keys)  # type: ignore[arg-type]


def test_big_import_smoke() -> None:
    figures = _run("big_import.py")
    keys = {"check_mb_s_5mb", "import_mb_s_5mb", "check_peak_rss_mb_5mb", "import_peak_rss_mb_5mb",
            "partition_mb_5mb", "rows_5mb"}
    assert keys <= set(figures) and all(float(figures[k]) > 0 for k in keys)  # type: ignore[arg-type]


@pytest.mark.slow
def test_own_data_smoke() -> None:
    """Real packaged data (./setup.sh --city-data), masked, the defaults: the issue's keys per data set."""
    figures = _run("own_data.py")
    datasets = figures["datasets"]
    assert isinstance(datasets, list) and [d["name"] for d in datasets] == ["salaries", "credit", "reviews", "digits"]
    for d in datasets:
        assert {"name", "metric", "higher_is_better", "federated", "local_weighted", "local_worst", "central"} <= set(d)
        assert d["statuses"] == ["completed"] and d["higher_is_better"] == (d["metric"] == "accuracy")
        for key in ("federated", "local_weighted", "local_worst", "central"):
            assert (d[key] > 0) if d["metric"] == "mae" else (0.0 <= d[key] <= 1.0)


@pytest.mark.slow
def test_tuning_smoke() -> None:
    """``quorumfl tune``'s path on the simulation engine (credit applications, masked): random search and
    TPE at the same budget of rounds, against the defaults, with the issue's keys."""
    figures = _run("tuning.py")
    assert {"tpe_over_default_pt", "tpe_over_random_pt", "rounds_to_best_fraction", "peak_rss_mb"} <= set(figures)
    (credit,) = figures["datasets"]  # type: ignore[misc]
    (seed,) = credit["per_seed"]
    assert seed["tpe_rounds"] >= seed["budget_rounds"] == 2 * 2  # two random trials of two rounds
    for key in ("default", "random", "tpe"):
        assert 0.0 <= seed[key] <= 1.0
    assert figures["tpe_over_random_pt"] == pytest.approx(100 * (seed["tpe"] - seed["random"]))
