"""The admin CLI against a real state DB: output formats, exit codes, node and model commands."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from quorumfl.cli.main import main
from quorumfl.server.model_store import ModelStore
from quorumfl.server.state.database import connect
from quorumfl.server.state.repository import Repository, RoundStatus, RunStatus


def quorumfl(*args: str, db: str | None = None) -> subprocess.CompletedProcess[str]:
    """The ``quorumfl`` command in this process: the console script's own ``main`` with this argv,
    its standard streams captured (test_cli_truth runs it in fresh processes where that matters)."""
    argv = ["quorumfl", *(["--db", db] if db else []), *args]
    out, err = io.StringIO(), io.StringIO()
    saved = sys.argv
    sys.argv = argv
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main()
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    finally:
        sys.argv = saved
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


@pytest.fixture
def seeded(tmp_path: Path) -> tuple[str, Repository, Path]:
    url = f"sqlite:///{tmp_path / 'state.db'}"
    repo = Repository(connect(url, migrate=True))
    run = repo.create_run(flower_run_id=2**63 + 11, config={"dataset": "digits", "model": "mlp"}, strategy="fedprox", num_rounds=2)
    store = ModelStore(tmp_path / "models")
    parent = None
    for number in (1, 2):
        rnd = repo.start_round(run.id, number, [7, 8])
        if number == 2:
            repo.add_failure(rnd.id, 8, stage="train", reason="no reply within the round timeout (30s)")
        repo.finish_round(rnd.id, RoundStatus.COMPLETED, participants=[7, 8] if number == 1 else [7], timings={"train": 2.0})
        repo.add_metrics(run.id, number, {"accuracy": 0.5 + 0.2 * number})
        stored = store.save({"w": np.full(3, number, np.float32)}, f"r{number}")
        parent = repo.add_model_version(run_id=run.id, round_number=number, parent_id=parent.id if parent else None,
                                        architecture="mlp:1x8x8:10", path=str(stored.path), sha256=stored.sha256,
                                        size_bytes=stored.size_bytes, metrics={"accuracy": 0.5}).id and repo.list_model_versions()[-1]
    repo.add_metrics(run.id, 2, {"final-accuracy": 0.88, "final-num-examples": 40}, node_id=7)
    repo.touch_node(7, department="tax-office")
    repo.touch_node(8, department="parks")
    repo.finish_run(run.id, RunStatus.COMPLETED)
    return url, repo, tmp_path


def test_runs_list_json(seeded: tuple[str, Repository, Path]) -> None:
    url, _, _ = seeded
    result = quorumfl("runs", "list", "--format", "json", db=url)
    assert result.returncode == 0, result.stderr
    [run] = json.loads(result.stdout)
    assert run["status"] == "completed" and run["rounds_completed"] == 2
    assert run["final_accuracy"] == pytest.approx(0.9) and run["flower_run_id"] == str(2**63 + 11)


def test_runs_show_and_rounds(seeded: tuple[str, Repository, Path]) -> None:
    url, _, _ = seeded
    shown = quorumfl("runs", "show", str(2**63 + 11), db=url)
    assert shown.returncode == 0, shown.stderr
    assert "tax-office" in shown.stdout and "0.88" in shown.stdout
    rounds = json.loads(quorumfl("rounds", "list", "1", "--format", "json", db=url).stdout)
    assert rounds[1]["failures"] == [{"node": "parks", "node_id": "8", "stage": "train", "reason": "no reply within the round timeout (30s)"}]
    table = quorumfl("rounds", "list", "1", db=url)
    assert "parks (train): no reply" in table.stdout.replace("\n", " ").replace("│", " ") or "parks" in table.stdout


def test_nodes_disable_enable(seeded: tuple[str, Repository, Path]) -> None:
    url, repo, _ = seeded
    assert quorumfl("nodes", "disable", "parks", db=url).returncode == 0
    assert repo.disabled_node_ids() == {8}
    nodes = json.loads(quorumfl("nodes", "list", "--format", "json", db=url).stdout)
    assert {n["department"]: n["enabled"] for n in nodes} == {"parks": False, "tax-office": True}
    assert quorumfl("nodes", "enable", "8", db=url).returncode == 0
    assert repo.disabled_node_ids() == set()


def test_models_rollback_export_and_tamper(seeded: tuple[str, Repository, Path]) -> None:
    url, repo, tmp = seeded
    listed = json.loads(quorumfl("models", "list", "--format", "json", db=url).stdout)
    assert [m["head"] for m in listed] == [False, True]
    assert quorumfl("models", "rollback", "1", db=url).returncode == 0
    assert repo.heads() == {"mlp:1x8x8:10": 1}
    out = tmp / "exported.npz"
    assert quorumfl("models", "export", "1", "--out", str(out), db=url).returncode == 0
    assert np.load(out)["w"].tolist() == [1.0, 1.0, 1.0]

    path = Path(repo.get_model_version(2).path)
    path.write_bytes(path.read_bytes() + b"x")
    for args in (("models", "export", "2", "--out", str(tmp / "x.npz")), ("models", "rollback", "2")):
        result = quorumfl(*args, db=url)
        assert result.returncode == 7
        assert "does not match its recorded SHA-256" in result.stderr and "Traceback" not in result.stderr
    assert repo.heads() == {"mlp:1x8x8:10": 1}  # a damaged version never becomes the head


def test_errors_are_one_line_with_documented_codes(seeded: tuple[str, Repository, Path], tmp_path: Path) -> None:
    url, _, _ = seeded
    missing = quorumfl("runs", "show", "77", db=url)
    assert missing.returncode == 5 and "run 77 does not exist" in missing.stderr and "Traceback" not in missing.stderr
    unmigrated = quorumfl("runs", "list", db=f"sqlite:///{tmp_path / 'fresh.db'}")
    assert unmigrated.returncode == 6 and "quorumfl db upgrade" in unmigrated.stderr
    unreachable = quorumfl("runs", "list", db="postgresql+psycopg://nobody@127.0.0.1:1/none")
    assert unreachable.returncode == 6 and "cannot reach the state database" in unreachable.stderr
    bad_url = quorumfl("runs", "list", db="notadb://")
    assert bad_url.returncode == 3
    debug = quorumfl("--debug", "runs", "show", "77", db=url)
    assert debug.returncode == 5 and "Traceback" in debug.stderr


def test_an_error_message_is_printed_as_written_never_as_rich_markup(tmp_path: Path) -> None:
    """The input an error names is the user's own text: ``lognormal:x`` once came out as
    ``lognormal❌`` (Rich's emoji code ``:x:``), and a ``[tag]`` would have vanished as markup."""
    speeds = quorumfl("--home", str(tmp_path / "home"), "simulate", "--departments", "2", "--speeds", "lognormal:x")
    assert speeds.returncode == 3
    assert "error: --speeds lognormal:x: σ must be a number in (0, 4]" in speeds.stderr, speeds.stderr
    (tmp_path / "[run].json").write_text("[1]")
    tagged = quorumfl("--home", str(tmp_path / "home"), "simulate", "--departments", "2", "--speeds",
                      str(tmp_path / "[run].json"))
    assert tagged.returncode == 3 and f"--speeds {tmp_path / '[run].json'}: the file must hold" in tagged.stderr


def test_runs_start_validates_config_before_submitting(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text('strategy = "fedsgd"\nmodel = "resnet"\n')
    result = quorumfl("runs", "start", str(config), "--superlink", "127.0.0.1:1")
    assert result.returncode == 3
    assert "strategy must be one of" in result.stderr and "model must be one of" in result.stderr


def test_runs_start_with_no_superlink_is_a_federation_error(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text("num-rounds = 1\n")
    result = quorumfl("runs", "start", str(config), "--superlink", "127.0.0.1:1", "--insecure")
    assert result.returncode == 8 and "SuperLink" in result.stderr and "warning: --insecure" in result.stderr
    no_ca = quorumfl("--home", str(tmp_path / "home"), "runs", "start", str(config), "--superlink", "127.0.0.1:1")
    assert no_ca.returncode == 11 and "no CA certificate" in no_ca.stderr and "certs init" in no_ca.stderr


def test_server_and_node_refuse_to_start_without_credentials(tmp_path: Path) -> None:
    home = str(tmp_path / "home")
    server = quorumfl("--home", home, "server", "start", "--port", "1")
    assert server.returncode == 11 and "certs init" in server.stderr, server.stderr
    node = quorumfl("--home", home, "node", "start", "--department", "parks", "--data", str(tmp_path))
    assert node.returncode == 11 and "parks.key does not exist" in node.stderr, node.stderr
    assert "'quorumfl certs add-node parks'" in node.stderr and "certs init" not in node.stderr, node.stderr


def test_data_split_and_node_start_errors(tmp_path: Path) -> None:
    result = quorumfl("data", "split", "--out", str(tmp_path / "parts"), "--departments", "tax-office,parks", "--method", "iid")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "parts" / "parks" / "partition.json").exists()
    node = quorumfl("node", "start", "--department", "x", "--data", str(tmp_path / "missing"), "--insecure")
    assert node.returncode == 4 and "does not exist" in node.stderr
    unknown = quorumfl("data", "split", "--out", str(tmp_path / "p2"), "--departments", "a", "--dataset", "cifar")
    assert unknown.returncode == 3 and "unknown dataset 'cifar'" in unknown.stderr


def test_keys_status_and_ceremony(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'state.db'}"
    repo = Repository(connect(url, migrate=True))
    run = repo.create_run(flower_run_id=2**63 + 12, config={"secure-aggregation": "ckks"}, strategy="fedavg", num_rounds=2)
    repo.touch_node(7, department="tax-office")
    ceremony = repo.start_ceremony(run.id, members=[7, 8, 9], threshold=2, params={"poly_degree": 8192})
    repo.finish_ceremony(ceremony, key_id="ab" * 16, holders=[7, 8, 9])
    rnd = repo.start_round(run.id, 1, [7, 8, 9])
    decryption = repo.add_decryption(rnd.id, key_id="ab" * 16, contributors=[7, 8, 9], decryptors=[7, 9])
    repo.finish_decryption(decryption)

    shown = quorumfl("keys", "status", str(run.id), "--format", "json", db=url)
    assert shown.returncode == 0, shown.stderr
    view = json.loads(shown.stdout)
    assert view["ceremonies"][0]["threshold"] == "2 of 3" and view["ceremonies"][0]["holders"] == ["tax-office", "8", "9"]
    assert view["decryptions"] == [{"round": 1, "status": "complete", "key_id": "ab" * 16, "contributors": 3,
                                    "decryptors": ["tax-office", "9"], "error": None}]
    assert "Threshold decryptions" in quorumfl("keys", "status", str(run.id), db=url).stdout

    requested = quorumfl("keys", "ceremony", str(run.id), db=url)
    assert requested.returncode == 0 and "requested" in requested.stdout
    assert repo.ceremony_requested(run.id)
    repo.finish_run(run.id, RunStatus.COMPLETED)
    refused = quorumfl("keys", "ceremony", str(run.id), db=url)
    assert refused.returncode == 3 and "running run" in refused.stderr
    assert quorumfl("keys", "status", "999", db=url).returncode == 5


def test_per_run_node_view_shows_cluster_and_personal_accuracy(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'state.db'}"
    repo = Repository(connect(url, migrate=True))
    run = repo.create_run(flower_run_id=5, config={"dataset": "digits", "model": "mlp"}, strategy="ifca", num_rounds=2)
    for number, cluster in ((1, 0), (2, 1)):  # the node moved to cluster 1 in round 2
        repo.add_metrics(run.id, number, {"cluster": float(cluster)}, node_id=7)
    repo.add_metrics(run.id, 2, {"final-accuracy": 0.81, "final-personal-accuracy": 0.93, "final-cluster": 1.0}, node_id=7)
    repo.touch_node(7, department="tax-office")
    repo.touch_node(8, department="parks")  # not in this run

    [row] = json.loads(quorumfl("nodes", "list", str(run.id), "--format", "json", db=url).stdout)
    assert row["department"] == "tax-office" and row["cluster"] == 1
    assert row["accuracy"] == pytest.approx(0.81) and row["personal-accuracy"] == pytest.approx(0.93)
    table = quorumfl("runs", "show", str(run.id), db=url).stdout
    assert "personal-accuracy" in table.replace("\n", " ") or "personal" in table
    assert "0.93" in table
    split = quorumfl("data", "split", "--out", str(tmp_path / "parts"), "--departments", "a,b,c,d", "--method", "iid",
                     "--planted-groups", "2")
    assert split.returncode == 0 and split.stdout.count("planted group") == 4, split.stderr


@pytest.mark.parametrize("source", ["raise KeyboardInterrupt", "exec('raise KeyboardInterrupt')"])
def test_interrupt_exits_130_under_python_m(tmp_path: Path, source: str) -> None:
    """An interrupt that unwinds through exec'd code (dataclasses and SQLAlchemy generate code that
    way) still exits with the documented 130 when run as ``python -m``, where CPython 3.11 would
    otherwise end the process by SIGINT (-2) after ``sys.exit(130)``."""
    (tmp_path / "interrupted_cli.py").write_text(
        "import sys\n"
        "from quorumfl.cli import main as cli\n"
        f"cli.app.command('interrupt-me')(lambda: exec({source!r}))\n"
        "sys.argv = ['quorumfl', 'interrupt-me']\n"
        "cli.main()\n"
    )
    done = subprocess.run([sys.executable, "-m", "interrupted_cli"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 130, done.stderr
    assert "interrupted" in done.stderr


