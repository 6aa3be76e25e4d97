"""Runs a server with its output going through here into its log, the API key taken out.

SGLang logs its resolved arguments at start-up, API key included; a start-up failure's log tail is
copied into the task log. So a server's stdout and stderr never reach a file directly: this
process reads them and writes them to the log (owner-only), every occurrence of the secret given
in ``REGEN_LOG_SECRET`` replaced by ``<redacted>``. It lives in the server's session, forwards the
signals it gets, and exits with the server's status.

    python -m regen.logrelay LOG -- COMMAND [ARG ...]
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

REDACTED = b"<redacted>"


def relay(source: int, log_fd: int, secret: bytes) -> None:
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
            os.write(log_fd, pending[:cut])
            pending = pending[cut:]
    if pending:
        os.write(log_fd, pending.replace(secret, REDACTED) if secret else pending)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 3 or argv[1] != "--":
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    log_path, command = argv[0], argv[2:]
    secret = os.environ.pop("REGEN_LOG_SECRET", "").encode()
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(log_fd, 2)  # this process's own errors go to the log too
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda number, _frame: child.send_signal(number))
    relay(child.stdout.fileno(), log_fd, secret)
    return child.wait()


if __name__ == "__main__":
    sys.exit(main())
