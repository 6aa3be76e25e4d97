"""A run marked failed by hand must end failed.

Airflow 3.3 marks a run failed (the UI's "Mark as failed", a REST PATCH of its state) by failing
its running tasks and skipping the pending ones, but it leaves teardowns to run and, while one is
pending, leaves the run's state to the leaves: ``audit`` skipped and ``stop_servers`` done make a
green run with every shard failed. The teardown reads the run's task states after its cleanup and
fails, with ``on_failure_fail_dagrun``, when they show that marking.
"""

from __future__ import annotations

SHOWN = 5


def marked_failed_by_hand(states: dict[str, str | None], teardowns: set[str]) -> str | None:
    """Why the run must fail, from its task states (Airflow's ``get_task_states`` form: a mapped
    task's instance is ``TASK_MAPINDEX``), or None. The audit is skipped only by a marking or
    when the approval was rejected (nothing failed then); a natural failure leaves it
    upstream_failed. A run marked failed while no task ran (only queued ones) is not told apart
    from one marked success."""
    if states.get("audit") != "skipped":
        return None
    failed = sorted(key for key, state in states.items() if state == "failed" and key not in teardowns)
    if not failed:
        return None
    more = f" and {len(failed) - SHOWN} more" if len(failed) > SHOWN else ""
    return (f"the run was marked failed while {', '.join(failed[:SHOWN])}{more} ran: this teardown fails it, "
            "so that it does not end green (to resume, clear the whole run with 'only failed' unticked: the audit was "
            "skipped; finished rows are kept)")
