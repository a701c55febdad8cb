"""A resumed run is signed with the admin's current roster, never the one stored with the run, and
shows as running from the moment it is resumed."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from quorumfl.deploy.resume import resume_overrides, resume_run
from quorumfl.server.state.database import connect
from quorumfl.server.state.repository import INTERRUPTED, Repository, RoundStatus, RunStatus


def test_a_resumed_run_drops_the_stored_roster_and_keeps_the_rest() -> None:
    stored = SimpleNamespace(id=4, flower_run_id=123, config={
        "num-rounds": 7, "secure-aggregation": "masking", "roster": '{"revoked-dept": "ecdsa-sha2-nistp384 AAAA"}',
        "not-a-key": 1})
    values = resume_overrides(stored)  # type: ignore[arg-type]
    assert "roster" not in values and "not-a-key" not in values
    assert values["num-rounds"] == 7 and values["secure-aggregation"] == "masking"
    assert values["resume-run"] == 4 and values["node-state-key"] == "123"


class _SuperLink:
    """The two Control API calls resume_run makes, answered as a SuperLink whose old run finished."""

    def __init__(self) -> None:
        self.started: list[dict[str, object]] = []

    def list_runs(self, run_id: int | None = None) -> list[SimpleNamespace]:
        return [SimpleNamespace(run_id=run_id, status="finished")]

    def start_run(self, overrides: dict[str, object]) -> int:
        self.started.append(overrides)
        return 5150


def test_runs_resume_shows_the_run_running_at_once(tmp_path: Path) -> None:
    """Issue 20 item 2: right after `runs resume`, `runs show` says running (under the new Flower run)
    and the interrupted round is aborted, not "failed" until the ServerApp takes the run up."""
    repo = Repository(connect(f"sqlite:///{tmp_path / 'state.db'}", migrate=True))
    run = repo.create_run(flower_run_id=77, config={"num-rounds": 3}, strategy="fedavg", num_rounds=3)
    repo.start_round(run.id, 1, [1, 2])
    repo.finish_run(run.id, RunStatus.FAILED, error="SuperLink unreachable")
    link = _SuperLink()
    assert resume_run(repo, link, run.id) == 5150  # type: ignore[arg-type]
    after = repo.get_run(run.id)
    assert (after.status, after.flower_run_id, after.error) == (RunStatus.RUNNING, 5150, None)
    assert [(r.status, r.error) for r in after.rounds] == [(RoundStatus.ABORTED, INTERRUPTED)]
    assert link.started[0]["resume-run"] == run.id
    # The ServerApp's own take-up of the same run then goes through as before.
    assert repo.resume_run(run.id, flower_run_id=5150, reason=INTERRUPTED).status == RunStatus.RUNNING
