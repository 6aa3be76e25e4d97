"""The suite runs on pytest-xdist workers (Makefile: TEST_WORKERS): what two of them allocate side by
side never meets, and a test that runs Airflow's tasks in its process keeps its time limit."""

import json
import os
import subprocess
import sys

from support.paths import ROOT
from support.workers import PORTS, port_range, worker_count, worker_name

# One worker's allocations, as its conftest makes them: its scratch and Airflow home, then port
# bases through regen's own picker, each range held bound so the worker's next pick is another.
ALLOCATE = """
import json, socket, sys
from support.paths import AIRFLOW_HOME, TEST_VAR
from regen.servers.probe import free_port_base
import os
held, ports = [], []
while len(ports) < 120:
    base, socks = free_port_base(3), []
    try:
        for port in range(base, base + 3):
            socks.append(socket.socket())
            socks[-1].bind(("127.0.0.1", port))
    except OSError:  # taken between the pick and the bind by a process outside the two workers
        for sock in socks:  # (another test's connection): pick again, as a server's start does
            sock.close()
        continue
    held += socks
    ports += range(base, base + 3)
print(json.dumps({"range": os.environ["REGEN_PORT_RANGE"], "home": str(AIRFLOW_HOME), "var": str(TEST_VAR),
                  "ports": ports}))
"""


def test_two_workers_never_share_a_port_a_home_or_a_scratch_folder():
    """Two workers' allocations run at once, as xdist runs them: each stays in its own port slice,
    and their ports, Airflow homes and scratch folders are disjoint (a shared port would fail a
    server at bind; a shared SQLite home would lock `dag.test()`)."""
    # The two split this worker's own slice: the suite's other workers bind in theirs meanwhile.
    own = port_range(worker_name(), worker_count())
    env = {k: v for k, v in os.environ.items() if k not in ("REGEN_PORT_RANGE", "AIRFLOW_HOME")}
    procs = [subprocess.Popen([sys.executable, "-c", ALLOCATE], cwd=ROOT / "tests", stdout=subprocess.PIPE,
                              env={**env, "PYTEST_XDIST_WORKER": name, "PYTEST_XDIST_WORKER_COUNT": "2",
                                   "REGEN_SUITE_PORTS": "%d-%d" % own, "PYTHONPATH": str(ROOT / "tests")})
             for name in ("gw0", "gw1")]
    seen = [json.loads(proc.communicate(timeout=120)[0]) for proc in procs]
    assert all(proc.returncode == 0 for proc in procs)
    for name, got in zip(("gw0", "gw1"), seen):
        low, high = port_range(name, 2, own)
        assert got["range"] == f"{low}-{high}"
        assert all(low <= port <= high for port in got["ports"]) and len(set(got["ports"])) == 120
    assert not set(seen[0]["ports"]) & set(seen[1]["ports"])
    assert seen[0]["home"] != seen[1]["home"] and seen[0]["var"] != seen[1]["var"]
    slices = sorted(port_range(f"gw{i}", 8) for i in range(8))
    assert all(a[1] < b[0] for a, b in zip(slices, slices[1:])) and PORTS[0] <= slices[0][0] and slices[-1][1] <= PORTS[1]


# Two tests that end a task as `dag.test()` does (its execution_timeout's timer set, then cleared),
# then overrun their 5 s limit: one without an in-process Airflow fixture, one with.
OVERRUNS = """
import time, pytest

@pytest.fixture
def airflow_db():
    return None

def a_task_ran():
    from airflow.sdk.execution_time.timeout import TimeoutPosix
    with TimeoutPosix(600):
        pass

@pytest.mark.timeout(5)
def test_overruns_without_the_fixture():
    a_task_ran()
    time.sleep(8)

@pytest.mark.timeout(5)
def test_overruns_with_airflow_in_process(airflow_db):
    a_task_ran()
    time.sleep(60)
"""


def test_a_test_running_airflows_tasks_in_process_still_ends_at_its_limit(tmp_path):
    """Without support.timeouts the first overrun passes (Airflow's timer cancelled
    pytest-timeout's); with it the second is ended at its limit, its stacks printed (about 20 s)."""
    (tmp_path / "test_overruns.py").write_text(OVERRUNS)
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "support.timeouts", "-p", "no:cacheprovider",
                           "-v", "test_overruns.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "tests")})
    out = done.stdout + done.stderr
    assert "test_overruns_without_the_fixture PASSED" in out, out[-3000:]
    assert done.returncode != 0 and "Timeout" in out and "time.sleep(60)" in out, out[-3000:]
    assert "test_overruns_with_airflow_in_process PASSED" not in out
