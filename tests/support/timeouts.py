"""pytest-timeout's limit kept for tests that run Airflow's tasks in their own process.

Every regen task has an execution_timeout, and Airflow enforces it with the process's one
real-time timer (``airflow.sdk.execution_time.timeout``): set on a task's start, cleared on its
end. pytest-timeout's default ``signal`` method uses the same timer, so after a ``dag.test()``'s
first task the test had no limit left (the vLLM end-to-end test ran 690 s past a 600 s limit),
and a hang would have run into CI's. Such tests keep their limit as a watchdog thread instead;
when it fires it prints every thread's stack and ends the xdist worker, which fails the test.
"""

from __future__ import annotations

import pytest

# The fixtures of the tests that run Airflow's tasks in the test's own process.
IN_PROCESS_AIRFLOW = ("airflow_db", "deployed_dag")


def pytest_collection_modifyitems(items):
    for item in items:
        if any(name in item.fixturenames for name in IN_PROCESS_AIRFLOW):
            own = item.get_closest_marker("timeout")
            seconds = (own.args[0] if own.args else own.kwargs.get("timeout")) if own else None
            item.add_marker(pytest.mark.timeout(seconds, method="thread"), append=False)
