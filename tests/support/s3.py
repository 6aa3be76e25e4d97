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

from regen.servers.probe import free_port_base
from support.processes import wait_until
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


SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
             b'<Message>Please reduce your request rate.</Message><RequestId>fault</RequestId></Error>')


class FaultyProxy:
    """A loopback proxy in front of the S3 server that answers 503 SlowDown where ``fault(method,
    path, n)`` says: "before" (the request never reaches the server) or "after" (it lands and its
    answer is lost: what a retried create-only write must survive); "drop" closes the connection
    unanswered (the store unreachable). ``n`` counts requests."""

    def __init__(self, upstream: str, fault):
        import http.client
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        from urllib.parse import urlsplit

        target = urlsplit(upstream)
        proxy = self
        self.seen: list[tuple[str, str, str | None]] = []
        lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _any(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with lock:
                    n = len(proxy.seen)
                    when = fault(self.command, self.path, n)
                    proxy.seen.append((self.command, self.path, when))
                if when == "drop":
                    self.close_connection = True
                    return
                if when != "before":
                    conn = http.client.HTTPConnection(target.hostname, target.port, timeout=60)
                    conn.request(self.command, self.path, body, {k: v for k, v in self.headers.items()
                                                                 if k.lower() not in ("connection", "host")})
                    answer = conn.getresponse()
                    status, headers, payload = answer.status, answer.getheaders(), answer.read()
                    conn.close()
                if when is not None:
                    status, headers, payload = 503, [("Content-Type", "application/xml")], SLOW_DOWN
                self.send_response(status)
                head = self.command == "HEAD" and when is None  # its length is the object's
                for key, value in headers:
                    if key.lower() not in ("transfer-encoding", "connection") and (head or key.lower() != "content-length"):
                        self.send_header(key, value)
                if not head:
                    self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(payload)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
