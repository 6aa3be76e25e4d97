"""Starts an engine's server module with its API key from the environment, never on its command
line (every local user of a node reads /proc/PID/cmdline; the environment only its owner).

Run by the engine's own interpreter (``engine_python``): standard library only, regen need not be
installed beside the engine. The key moves from ``REGEN_SERVER_API_KEY`` (removed from the
environment, so the server's children do not inherit it) to this process's own ``sys.argv``,
where the module's argument parser finds it; the process's command line stays as it was.

    REGEN_SERVER_API_KEY=... ENGINE_PYTHON with_key.py MODULE [ARG ...]
"""

import os
import runpy
import sys

# This file's folder holds regen's adapters sglang.py and vllm.py: off the path, or they would be
# imported in place of the engines.
sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != os.path.dirname(os.path.realpath(__file__))]


def main() -> None:
    module, args = sys.argv[1], sys.argv[2:]
    key = os.environ.pop("REGEN_SERVER_API_KEY", "")
    sys.argv = [module, *args, *(["--api-key", key] if key else [])]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
