"""PostgreSQL and Redis for the Airflow deployments of the tests: the ones the machine runs on their standard ports,
or, on a machine that has none (or with REGEN_TEST_SERVICES=own), private ones started here
from Debian's binaries (`make system` installs them) on free ports, and removed afterwards."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from regen.servers.probe import free_port_base
from support.processes import wait_until


@dataclass
class Services:
    postgres_port: int
    redis_port: int
    own: bool  # started here (False: the machine's)

    def sql_url(self, db: str) -> str:
        return f"postgresql+psycopg2://postgres@127.0.0.1:{self.postgres_port}/{db}"

    def redis_url(self, db: int) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/{db}"

    def psql(self, sql: str) -> None:
        subprocess.run(["psql", "-h", "127.0.0.1", "-p", str(self.postgres_port), "-U", "postgres", "-c", sql],
                       check=True, capture_output=True, timeout=60)

    @contextlib.contextmanager
    def database(self) -> Iterator[str]:
        """A database of its own for one deployment, dropped afterwards."""
        name = f"regen_test_{uuid.uuid4().hex[:8]}"
        self.psql(f"CREATE DATABASE {name}")
        try:
            yield name
        finally:
            self.psql(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def answers(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def postgres_bin(name: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    if not found:
        raise RuntimeError(f"no PostgreSQL server binaries (/usr/lib/postgresql/*/bin/{name}): run `make system`")
    return found[-1]


def as_postgres(argv: list[str]) -> list[str]:
    """PostgreSQL refuses to run as root: as the `postgres` user Debian's package creates."""
    return ["runuser", "-u", "postgres", "--", *argv] if os.geteuid() == 0 else argv


@contextlib.contextmanager
def own_services(root: Path) -> Iterator[Services]:
    """A private PostgreSQL (trust auth, loopback only) and Redis (nothing kept on disk)."""
    if shutil.which("redis-server") is None:
        raise RuntimeError("no redis-server: run `make system`")
    # A folder of its own in /tmp: the postgres user must reach it (pytest's folders are root's only).
    pg_root = Path(tempfile.mkdtemp(prefix="regen-pg-"))
    data = pg_root / "data"
    data.mkdir()
    if os.geteuid() == 0:
        shutil.chown(pg_root, "postgres")
        shutil.chown(data, "postgres")
    subprocess.run(as_postgres([postgres_bin("initdb"), "-D", str(data), "-U", "postgres", "--auth=trust"]),
                   check=True, capture_output=True, timeout=120)
    pg_port, redis_port = free_port_base(1), free_port_base(1)
    postgres = subprocess.Popen(as_postgres([postgres_bin("postgres"), "-D", str(data), "-p", str(pg_port),
                                             "-h", "127.0.0.1", "-k", str(pg_root)]),
                                stdout=subprocess.DEVNULL, stderr=open(root / "postgres.log", "wb"))
    redis = subprocess.Popen(["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                              "--appendonly", "no", "--dir", str(root)], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: answers(pg_port) and answers(redis_port), 60, "own PostgreSQL and Redis")
        wait_until(lambda: subprocess.run([postgres_bin("pg_isready"), "-h", "127.0.0.1", "-p", str(pg_port)],
                                          capture_output=True).returncode == 0, 60, "PostgreSQL ready")
        yield Services(pg_port, redis_port, own=True)
    finally:
        for proc in (postgres, redis):
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(pg_root, ignore_errors=True)


@contextlib.contextmanager
def services(root: Path) -> Iterator[Services]:
    """The machine's PostgreSQL (5432) and Redis (6379) when both answer, else private ones;
    REGEN_TEST_SERVICES=own|machine forces either."""
    wanted = os.environ.get("REGEN_TEST_SERVICES", "auto")
    if wanted == "machine" or (wanted == "auto" and answers(5432) and answers(6379)):
        yield Services(5432, 6379, own=False)
        return
    with own_services(root) as own:
        yield own
