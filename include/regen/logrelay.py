"""Writes a server's output into its log, the API key taken out.

SGLang logs its resolved arguments at start-up, API key included; a start-up failure's log tail is
copied into the task log. So a server's stdout and stderr never reach a file directly: they go
through a pipe to this process, which writes them to the log (owner-only), every occurrence of the
secret given in ``REGEN_LOG_SECRET`` replaced by ``<redacted>``.

It is the server's companion, not its parent: the server leads its own session and its own PID is
the one recorded, so whatever happens here (a full disk, this process killed) never makes a
healthy server look dead. A write that fails drops that output and says so in the log once
writing works again; the relay keeps reading, so the server never blocks on a full pipe. It exits
when the last process holding the pipe's other end (the server's whole tree) has.

    python -m regen.logrelay LOG < server output
"""

from __future__ import annotations

import os
import sys

REDACTED = b"<redacted>"


class LogWriter:
    """Appends to the log; output it could not write is counted, never retried, and reported
    in the log at the next write that succeeds."""

    def __init__(self, log_fd: int):
        self.log_fd = log_fd
        self.lost = 0
        self.error = ""

    def write(self, data: bytes) -> None:
        if self.lost:
            note = f"\n[regen.logrelay: {self.lost} bytes of server output lost: {self.error}]\n".encode()
            if not self._write_all(note):
                self.lost += len(data)
                return
            self.lost = 0
        if not self._write_all(data):
            self.lost += len(data)

    def _write_all(self, data: bytes) -> bool:
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self.log_fd, view):]
        except OSError as exc:
            self.error = exc.strerror or str(exc)
            return False
        return True


def relay(source: int, out: LogWriter, secret: bytes) -> None:
    """Copy until end of file; a secret split between two reads is still caught, since the
    last len(secret) - 1 bytes wait for the next read."""
    keep = max(len(secret) - 1, 0)
    pending = b""
    while chunk := os.read(source, 1 << 16):
        pending += chunk
        if secret:
            pending = pending.replace(secret, REDACTED)
        cut = len(pending) - keep if secret else len(pending)
        if cut > 0:
            out.write(pending[:cut])
            pending = pending[cut:]
    if pending:
        out.write(pending.replace(secret, REDACTED) if secret else pending)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    secret = os.environ.pop("REGEN_LOG_SECRET", "").encode()
    log_fd = os.open(argv[0], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    relay(sys.stdin.fileno(), LogWriter(log_fd), secret)
    return 0


if __name__ == "__main__":
    sys.exit(main())
