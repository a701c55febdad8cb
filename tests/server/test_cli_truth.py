"""The admin CLI tells the truth: exit codes of failed runs, read-only commands that create nothing,
idempotent stops, a checked `models show`, "did you mean" for config keys, `--version`.

Run in-process through the command's own entry point (``main``: the same error boundary and exit
codes as the installed ``quorumfl``), which spares a cold start per call.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from quorumfl.cli.errors import exit_code
from quorumfl.cli.main import main
from quorumfl.errors import FederationError, ModelStoreError
from quorumfl.server.model_store import ModelStore
from quorumfl.server.services import run_outcome_error
from quorumfl.server.state.database import connect
from quorumfl.server.state.repository import Repository, RunStatus

from .test_cli import seeded  # noqa: F401  (a fixture: a state DB with one completed run)


def cli(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["quorumfl", *args])
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_read_only_commands_on_a_missing_database_create_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    typo = tmp_path / "hmoe"
    code, _, err = cli(monkeypatch, capsys, "--home", str(typo), "runs", "list")
    assert code == 6 and f"no state database at {typo / 'quorumfl.db'}" in err
    assert len(err.strip().splitlines()) == 1
    assert not typo.exists()
    missing = tmp_path / "no" / "such" / "dir" / "q.db"
    for args in (["runs", "list"], ["nodes", "list"], ["models", "list"], ["rounds", "list", "1"], ["runs", "show", "1"]):
        code, _, err = cli(monkeypatch, capsys, "--db", f"sqlite:///{missing}", *args)
        assert code == 6 and "no state database" in err, (args, err)
    assert not (tmp_path / "no").exists()
    # The commands that set a database up still create it.
    code, _, err = cli(monkeypatch, capsys, "--db", f"sqlite:///{missing}", "db", "upgrade")
    assert code == 0, err
    assert missing.is_file()
    assert cli(monkeypatch, capsys, "--db", f"sqlite:///{missing}", "runs", "list")[0] == 0


def test_an_unreachable_database_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    url = "postgresql+psycopg://nobody@127.0.0.1:1/none"  # nothing listens on port 1
    for args in (["runs", "list"], ["db", "upgrade"]):
        code, _, err = cli(monkeypatch, capsys, "--db", url, *args)
        assert code == 6 and "state database" in err and "sqlalche.me" not in err, err
        assert len(err.strip().splitlines()) == 1, err


def test_stopping_a_run_that_is_not_running_is_a_no_op(
    seeded: tuple[str, Repository, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]  # noqa: F811
) -> None:
    url, _, _ = seeded
    code, out, err = cli(monkeypatch, capsys, "--db", url, "runs", "stop", "1")
    assert code == 0, err
    assert "run 1 is not running (it is completed); nothing to stop" in out


def test_models_show_checks_the_file_and_formats_metrics(
    seeded: tuple[str, Repository, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]  # noqa: F811
) -> None:
    url, repo, _ = seeded
    code, out, err = cli(monkeypatch, capsys, "--db", url, "models", "show", "2")
    assert code == 0, err
    assert "file_ok: True" in out and "metrics: accuracy 0.5" in out and "{" not in out
    version = repo.get_model_version(2)
    data = bytearray(Path(version.path).read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte changed
    Path(version.path).write_bytes(bytes(data))
    code, out, err = cli(monkeypatch, capsys, "--db", url, "models", "show", "2")
    assert code == 7 and "file_ok: False" in out
    assert "does not match its recorded SHA-256" in err and len(err.strip().splitlines()) == 1


def test_a_failed_run_maps_to_the_exit_code_of_its_cause(tmp_path: Path) -> None:
    repo = Repository(connect(f"sqlite:///{tmp_path / 'state.db'}", migrate=True))
    causes = {"ModelStoreError: cannot write model file /x": (ModelStoreError, 7),
              "FederationError: none of the 2 round(s) completed": (FederationError, 8),
              "ValueError: something unexpected": (FederationError, 8)}
    for reason, (kind, code) in causes.items():
        run = repo.create_run(flower_run_id=None, config={}, strategy="fedavg", num_rounds=1)
        repo.finish_run(run.id, RunStatus.FAILED, error=reason)
        error = run_outcome_error(repo.get_run(run.id))
        assert type(error) is kind and exit_code(error) == code and reason in str(error)
    stopped = repo.create_run(flower_run_id=None, config={}, strategy="fedavg", num_rounds=1)
    repo.finish_run(stopped.id, RunStatus.STOPPED, error="stopped by the admin")
    assert exit_code(run_outcome_error(repo.get_run(stopped.id))) == 8  # type: ignore[arg-type]
    done = repo.create_run(flower_run_id=None, config={}, strategy="fedavg", num_rounds=1)
    repo.finish_run(done.id, RunStatus.COMPLETED)
    assert run_outcome_error(repo.get_run(done.id)) is None


def test_an_unknown_config_key_gets_a_did_you_mean(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "run.toml"
    config.write_text("[run]\nlocal-epoch = 3\n")
    code, _, err = cli(monkeypatch, capsys, "--home", str(tmp_path / "home"), "runs", "start", str(config))
    assert code == 3 and "did you mean 'local-epochs'?" in err and "proximal-mu" not in err


def test_version(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(monkeypatch, capsys, "--version")
    assert code == 0 and out.startswith("quorumfl ") and "flwr 1.42" in out


def test_model_store_write_errors_are_model_store_errors(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(ModelStoreError, match="cannot write model file .* model-dir"):
        ModelStore(tmp_path / "file").save({"w": np.zeros(2, np.float32)}, "r1")


def test_server_start_on_a_busy_port_says_so_before_starting_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, out, err = cli(monkeypatch, capsys, "--home", str(tmp_path / "home"), "server", "start", "--insecure",
                             "--port", str(port))
    assert code == 3 and f"port {port} on 127.0.0.1 is not free" in err and "listening" not in out
    assert not (tmp_path / "home" / "quorumfl.db").exists()


def test_the_exit_code_reference_has_every_code_of_the_cli() -> None:
    from quorumfl.cli.errors import EXIT_CODES

    page = (Path(__file__).resolve().parents[2] / "docs" / "reference" / "exit-codes.md").read_text()
    table = page.split("# CLI exit codes", 1)[1].split("\n## ", 1)[0]
    documented = {int(code) for code in re.findall(r"`(\d+)` ", table)}
    assert documented == {0, 1, 2, 130} | {code for _, code in EXIT_CODES}


def test_an_aborted_round_does_not_show_its_redos_accuracy(tmp_path: Path) -> None:
    from quorumfl.server.services import run_view
    from quorumfl.server.state.repository import RoundStatus

    repo = Repository(connect(f"sqlite:///{tmp_path / 'state.db'}", migrate=True))
    run = repo.create_run(flower_run_id=77, config={"dataset": "digits", "model": "mlp"}, strategy="fedavg", num_rounds=1)
    repo.start_round(run.id, 1, [1, 2])
    repo.abort_running_rounds(run.id, "interrupted: the server stopped during this round; redone after resume")
    redo = repo.start_round(run.id, 1, [1, 2])
    repo.finish_round(redo.id, RoundStatus.COMPLETED, participants=[1, 2], timings={"train": 1.0})
    repo.add_metrics(run.id, 1, {"accuracy": 0.8})
    rows = run_view(repo, run.id)["rounds"]
    assert [(r["status"], r["metrics"].get("accuracy")) for r in rows] == [("aborted", None), ("completed", 0.8)]


def test_a_node_given_another_departments_partition_is_refused_naming_both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from quorumfl.core.data import prepare_partitions

    parts = prepare_partitions(tmp_path / "parts", ["tax-office", "parks"], seed=0, method="iid")
    code, out, err = cli(monkeypatch, capsys, "--home", str(tmp_path / "home"), "node", "start", "--insecure",
                         "--department", "parks", "--data", str(parts["tax-office"]))
    assert code == 4 and "partition of department 'tax-office'" in err and "not 'parks'" in err
    assert "connecting" not in out  # nothing was started


def test_a_node_that_gets_no_answer_says_so_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    import signal
    import subprocess
    import time

    from quorumfl.core.data import prepare_partitions
    from quorumfl.deploy.processes import free_port

    parts = prepare_partitions(tmp_path / "parts", ["parks"], seed=0, method="iid")
    closed = free_port()  # nothing listens there: a mistyped --superlink port
    out_file, err_file = tmp_path / "out.txt", tmp_path / "err.txt"
    with open(out_file, "w") as out_f, open(err_file, "w") as err_f:
        node = subprocess.Popen(
            [sys.executable, "-m", "quorumfl.cli", "--home", str(tmp_path / "home"), "node", "start", "--insecure",
             "--department", "parks", "--data", str(parts["parks"]), "--superlink", f"127.0.0.1:{closed}",
             "--warn-after", "2"],
            stdout=out_f, stderr=err_f, env={**os.environ, "COLUMNS": "200"},
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as in a terminal
    try:
        deadline = time.monotonic() + 90
        while "no answer from the SuperLink" not in err_file.read_text():
            assert node.poll() is None and time.monotonic() < deadline, out_file.read_text() + err_file.read_text()
            time.sleep(0.5)
        node.send_signal(signal.SIGINT)
        node.wait(timeout=60)
    finally:
        if node.poll() is None:
            node.kill()
    out, err = out_file.read_text(), err_file.read_text()
    assert node.returncode == 130, out + err
    assert f"connecting to the SuperLink at 127.0.0.1:{closed}" in out
    assert f"no answer from the SuperLink at 127.0.0.1:{closed} yet: check --superlink" in err
    assert "connected" not in out.replace("connecting", "")


def test_list_tables_fit_80_columns_one_line_per_row(
    seeded: tuple[str, Repository, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]  # noqa: F811
) -> None:
    url, repo, _ = seeded
    from quorumfl.cli import output

    repo.touch_node(2**64 - 5, department="urban-planning")  # a real Flower node id: 20 digits
    # The console's width, as COLUMNS=80 sets it when the command starts (Rich reads COLUMNS once).
    monkeypatch.setattr(output.console, "_width", 80)
    for args, rows in ((["runs", "list"], 1), (["rounds", "list", "1"], 2), (["nodes", "list"], 3),
                       (["models", "list"], 2)):
        code, out, err = cli(monkeypatch, capsys, "--db", url, *args)
        assert code == 0, err
        lines = out.rstrip("\n").splitlines()
        table_lines = [line for line in lines if line[:1] in "┏┃┡│└"]
        assert all(len(line) <= 80 for line in lines), (args, out)
        assert len(table_lines) == rows + 4, (args, out)  # top, header, separator, one per row, bottom
        assert "…" not in out, (args, out)  # nothing cut: columns are left out instead
    _, out, _ = cli(monkeypatch, capsys, "--db", url, "nodes", "list")
    assert str(2**64 - 5) in out  # the whole id that 'nodes disable' takes
    _, out, _ = cli(monkeypatch, capsys, "--db", url, "rounds", "list", "1")
    assert "round 2: parks (train): no reply within the round timeout (30s)" in out
    monkeypatch.setattr(output.console, "_width", 200)  # a wide terminal shows more
    _, out, _ = cli(monkeypatch, capsys, "--db", url, "runs", "list")
    assert str(2**63 + 11) in out


# What a read-only command must not import: each costs a noticeable part of a second at start-up.
HEAVY = ("flwr", "torch", "alembic", "cryptography", "tenseal", "opacus", "fastapi")


def _modules_after(args: list[str], env: dict[str, str]) -> set[str]:
    """Top-level packages imported by one fresh `quorumfl ARGS` run."""
    import subprocess

    probe = (
        "import sys\n"
        "from quorumfl.cli.main import main\n"
        f"sys.argv = ['quorumfl', *{args!r}]\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print('MODULES', ' '.join(sorted({m.split('.')[0] for m in sys.modules})))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120).stdout
    line = next(line for line in out.splitlines() if line.startswith("MODULES "))
    return set(line.split()[1:])


def test_help_and_read_only_commands_import_no_heavy_package(
    seeded: tuple[str, Repository, Path], tmp_path: Path,  # noqa: F811
) -> None:
    """`quorumfl --help` and `runs list` start fast (issue 20: ≤ 0.5 s) because each command imports
    only what it needs; checked by what is imported, not by timing (this machine is noisy)."""
    env = {**os.environ, "QUORUMFL_HOME": str(tmp_path / "home"), "QUORUMFL_DB_URL": seeded[0]}
    help_modules = _modules_after(["--help"], env)
    assert not help_modules & {*HEAVY, "sqlalchemy", "numpy"}, help_modules & {*HEAVY, "sqlalchemy", "numpy"}
    for args in (["runs", "list"], ["rounds", "list", "1"], ["nodes", "list"], ["models", "list"]):
        modules = _modules_after(args, env)
        assert "sqlalchemy" in modules, args  # it did read the database
        assert not modules & set(HEAVY), (args, modules & set(HEAVY))


def test_every_command_loads_with_the_help_line_the_root_lists() -> None:
    """The root lists placeholders from COMMANDS; each loads to a real command with that help."""
    import click

    from quorumfl.cli.cmd_federation import demo
    from quorumfl.cli.main import COMMANDS, app, load_command

    for name, (_where, help_line) in COMMANDS.items():
        command = load_command(name)
        assert command.name == name
        if isinstance(command, click.Group):
            assert command.help == help_line and command.commands, name
    assert (demo.__doc__ or "").split("\n\n")[0].replace("\n", " ").strip() == COMMANDS["demo"][1]
    import typer

    assert set(typer.main.get_command(app).commands) == set(COMMANDS)  # type: ignore[attr-defined]


def test_follow_shows_the_running_stage_and_closes_with_a_summary(tmp_path: Path) -> None:
    """Issue 20 item 11: while a round runs, the follower sees its stage and nodes (asked, replied,
    failed, awaited, time left); at the end one summary line (outcome, rounds, nodes, failures)."""
    from quorumfl.server.services import follow_run, progress_line, run_closing
    from quorumfl.server.state.repository import RoundStatus

    repo = Repository(connect(f"sqlite:///{tmp_path / 'state.db'}", migrate=True))
    run = repo.create_run(flower_run_id=77, config={}, strategy="fedavg", num_rounds=1)
    rnd = repo.start_round(run.id, 1, [1, 2, 3, 4])
    repo.set_round_progress(rnd.id, {"stage": "secagg-unmask", "asked": 4, "replied": 2, "failed": 1, "waiting": 1,
                                     "started": 1000.0, "deadline": 1030.0})
    lines: list[str] = []

    def on_progress(_run: object, running: object) -> None:
        lines.append(progress_line(running, now=1010.0))  # type: ignore[arg-type]
        repo.add_failure(rnd.id, 4, stage="secagg-unmask", reason="no reply within the secagg-unmask deadline (30s)")
        repo.finish_round(rnd.id, RoundStatus.COMPLETED, participants=[1, 2, 3], timings={"train": 1.0})
        repo.add_metrics(run.id, 1, {"accuracy": 0.75})
        repo.finish_run(run.id, RunStatus.COMPLETED)

    finished = follow_run(repo, 77, timeout=30, poll=0.05, on_progress=on_progress)
    assert lines == ["round 1 · secagg-unmask: 2/4 replied, 1 failed, 1 awaited (20 s left)"]
    # After the deadline the awaited node is shown late; with no progress yet, "starting".
    late = repo.get_run(77).rounds[0]
    assert progress_line(late, now=1040.0).endswith("1 awaited (late by 10 s)")
    late.progress = None
    assert progress_line(late) == "round 1: starting"
    assert run_closing(repo, finished, 12.4) == (
        "run 1 completed in 12 s (plaintext): 1/1 rounds, 3 node(s) took part, 1 node failure(s); accuracy 0.750")
    # A set_round_progress after the round ended changes nothing.
    repo.set_round_progress(rnd.id, {"stage": "late-write"})
    assert repo.get_run(77).rounds[0].progress["stage"] == "secagg-unmask"  # type: ignore[index]
