"""A real S3 API on loopback: moto's server mode (`moto_server`), started once per session.

Clients find it as they find AWS: AWS_ENDPOINT_URL and the key pair in the environment, which
every regen process a test starts inherits.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from support.processes import free_port_base, wait_until
from support.services import answers

MOTO_SERVER = Path(sys.executable).parent / "moto_server"


@dataclass
class S3Server:
    endpoint: str
    env: dict[str, str]

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id=self.env["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=self.env["AWS_SECRET_ACCESS_KEY"])

    def new_bucket(self) -> str:
        name = f"regen-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))


@contextlib.contextmanager
def moto_server(log: Path) -> Iterator[S3Server]:
    port = free_port_base(1)
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(MOTO_SERVER), "-H", "127.0.0.1", "-p", str(port)], stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: answers(port) or proc.poll() is not None, 60, "moto_server listening")
        if proc.poll() is not None:
            raise RuntimeError(f"moto_server exited: {log.read_text()[-2000:]}")
        endpoint = f"http://127.0.0.1:{port}"
        env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "regen-test",
               "AWS_SECRET_ACCESS_KEY": "regen-test-secret", "AWS_DEFAULT_REGION": "us-east-1"}
        yield S3Server(endpoint, env)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
