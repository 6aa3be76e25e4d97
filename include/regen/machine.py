"""This machine, as regen names it: the node servers.json records a server on, the node a
one-node run runs on."""

from __future__ import annotations

import os
import socket


def node_name() -> str:
    """REGEN_NODE_NAME when the deployment sets it (a worker per node, or a container whose
    hostname means nothing), else the host name."""
    return os.environ.get("REGEN_NODE_NAME") or socket.gethostname()
