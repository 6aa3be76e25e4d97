"""A run marked failed by hand must end failed, and a run must not end green unaudited.

Airflow 3.3 marks a run failed (the UI's "Mark as failed", a REST PATCH of its state) by failing
its running tasks and skipping the pending ones, but it leaves teardowns to run and, while one is
pending, leaves the run's state to the leaves: ``audit`` skipped and ``stop_servers`` done make a
green run with every shard failed. The same run cleared with "only failed" ticked resumes its
failed shards but not the skipped audit, and would end green unaudited. The teardown reads the
run's task states after its cleanup and fails, with ``on_failure_fail_dagrun``, on either.
"""

from __future__ import annotations

SHOWN = 5
RESUME = ("this teardown fails the run so that it does not end green unaudited; to resume, clear the whole run "
          "with 'only failed' unticked: finished rows are kept")


def marked_failed_by_hand(states: dict[str, str | None], teardowns: set[str],
                          approval: str | None = None) -> str | None:
    """Why the run must fail, from its task states (Airflow's ``get_task_states`` form: a mapped
    task's instance is ``TASK_MAPINDEX``) and the approval's answer, or None. Only a person's
    marking skips the audit of a run whose servers started, except a rejected approval (which
    skips the shards and fails nothing); a shard that fails by itself leaves the audit
    upstream_failed. A marking while shards only waited for a slot (a pool the run shares) skips
    them without failing any: the run ends failed too, unaudited, as it does when marked success."""
    if states.get("audit") != "skipped":
        return None
    failed = sorted(key for key, state in states.items() if state == "failed" and key not in teardowns)
    if failed:
        more = f" and {len(failed) - SHOWN} more" if len(failed) > SHOWN else ""
        return f"the run was marked failed while {', '.join(failed[:SHOWN])}{more} ran: {RESUME}"
    shards = {key: state for key, state in states.items() if key.rpartition("_")[0] == "generate"}
    if any(state == "success" for state in shards.values()):
        return f"the audit was skipped though shards ran (the run was marked failed, then cleared with 'only failed'): {RESUME}"
    if approval != "Reject" and any(state == "skipped" for state in shards.values()):
        return f"the run was marked failed (or success) by hand while its shards waited to start: {RESUME}"
    return None
