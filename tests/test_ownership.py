"""One owner per output while its run lives: claims raced by processes on a disk and on a bucket
(moto's S3, fake-gcs-server), renewed by a busy stage, checked before every row is written."""

from __future__ import annotations

import json
import multiprocessing
import time

import pytest

from regen.coordination import owner
from regen.coordination.owner import OutputHeld, OutputLost, check_held, claim_output, holding_output
from regen.layout import RunLayout
from support.processes import wait_until


def _claim(layout: RunLayout, run_id: str, start, results) -> None:
    start.wait()
    try:
        claim_output(layout, run_id, set(), ended_runs=[])
        results.put(run_id)
    except OutputHeld:
        results.put(None)


def _race(make_layout, trials: int) -> list[int]:
    """Winners per trial of two processes claiming one fresh output at the same instant."""
    ctx = multiprocessing.get_context("fork")
    winners = []
    for trial in range(trials):
        layout = make_layout(trial)
        start, results = ctx.Barrier(2), ctx.Queue()
        procs = [ctx.Process(target=_claim, args=(layout, f"dag/run-{trial}-{who}", start, results)) for who in "ab"]
        for proc in procs:
            proc.start()
        got = [results.get(timeout=60) for _ in procs]
        for proc in procs:
            proc.join(timeout=60)
        winners.append(sum(1 for g in got if g))
        holder = json.loads(layout.owner.read_text())["run_id"]
        assert holder in got  # the file names the one that won
    return winners


def test_of_two_preflights_claiming_one_output_at_once_exactly_one_wins(tmp_path):
    """The review's race: 187 of 200 trials had two winners (a read, then a write)."""
    assert _race(lambda trial: RunLayout(tmp_path / f"out{trial}"), 60) == [1] * 60


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_on_a_bucket_two_nodes_with_their_own_work_folders_see_one_owner(scheme, request, tmp_path):
    """Nodes sharing only the bucket: their local claims cannot see each other, the bucket's
    create-only record decides. The winner's release lets the other in; a stage of the loser
    that was already running stops at its next write."""
    server = request.getfixturevalue("s3_server" if scheme == "s3" else "gcs_server")
    buckets = {}

    def node_layout(trial: int, node: str = "x") -> RunLayout:
        url = buckets.setdefault(trial, f"{scheme}://{server.new_bucket()}/out")
        return RunLayout.for_output(url, work_dir=tmp_path / f"{node}{trial}-{len(buckets)}")

    assert _race(node_layout, 8) == [1] * 8
    url = f"{scheme}://{server.new_bucket()}/out"
    a, b = (RunLayout.for_output(url, work_dir=tmp_path / name) for name in ("node-a", "node-b"))
    claim_output(a, "dag/a", set(), ended_runs=[])
    with pytest.raises(OutputHeld, match="held by run dag/a"):
        claim_output(b, "dag/b", set(), ended_runs=[])
    owner.release_output(a, "dag/a")
    claim_output(b, "dag/b", set(), ended_runs=[])
    with pytest.raises(OutputLost, match="held by run dag/b"):
        with holding_output(a, "dag/a"):
            pass


def test_a_busy_stage_renews_its_claim_and_stops_writing_once_it_is_taken(tmp_path, monkeypatch):
    """Staging for hours renews the claim (a second run is refused however long it takes); once
    Airflow says the run ended and another takes the output, the old run's next row is refused."""
    monkeypatch.setattr(owner, "RENEW_EVERY_S", 0.05)
    layout = RunLayout(tmp_path / "out")
    claim_output(layout, "dag/a", set(), ended_runs=[])
    stale = time.time() - owner.CLAIM_STALE_S - 10
    layout.owner.write_text(json.dumps({"run_id": "dag/a", "since": stale, "renewed": stale}))
    with holding_output(layout, "dag/a"):
        wait_until(lambda: json.loads(layout.owner.read_text())["renewed"] > time.time() - 5, timeout=10)
        with pytest.raises(OutputHeld):  # no one to ask: its renewals keep it
            claim_output(layout, "dag/b", set(), ended_runs=None)
        check_held(layout)  # still its own: rows may be written
        claim_output(layout, "dag/b", set(), ended_runs=["dag/a"])  # Airflow: a has ended
        with pytest.raises(OutputLost, match="run dag/b holds it now, not this run \\(dag/a\\)"):
            check_held(layout)
    assert json.loads(layout.owner.read_text())["run_id"] == "dag/b"  # a's renewals never took it back
