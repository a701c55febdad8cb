"""A resumed run is signed with the admin's current roster, never the one stored with the run."""

from __future__ import annotations

from types import SimpleNamespace

from quorumfl.server.resume import resume_overrides


def test_a_resumed_run_drops_the_stored_roster_and_keeps_the_rest() -> None:
    stored = SimpleNamespace(id=4, flower_run_id=123, config={
        "num-rounds": 7, "secure-aggregation": "masking", "roster": '{"revoked-dept": "ecdsa-sha2-nistp384 AAAA"}',
        "not-a-key": 1})
    values = resume_overrides(stored)  # type: ignore[arg-type]
    assert "roster" not in values and "not-a-key" not in values
    assert values["num-rounds"] == 7 and values["secure-aggregation"] == "masking"
    assert values["resume-run"] == 4 and values["node-state-key"] == "123"
