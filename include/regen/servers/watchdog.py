"""The watchdog of a node's servers: restarts the ones that die, stops them all when idle.

It runs on the node beside the servers, in a session of its own, started by whoever starts them
(``start_servers``), so it outlives whatever happens to Airflow: a lost scheduler, a run marked
failed from outside, a killed worker, a teardown that never ran. Every ``poll_s``:

- while some shard or canary holds a live lease (:mod:`regen.coordination`), a server whose process
  died is restarted in place, with its recorded arguments, at most ``MAX_RESTARTS`` times with
  growing pauses, each restart logged and alerted; the shards go on with the other servers and
  take the restarted one back when their probe finds it healthy;
- when no lease has been live for ``idle_shutdown_s``, it stops every recorded server and exits; a
  run waiting for a person's approval after its canary counts as using them (until it is
  answered, at most a day); when their start was killed while they loaded (its lease left
  behind, held by nobody: Airflow will not run the teardown of a setup that failed), at once.

It is started before the first server, so a starter killed at any moment leaves nothing
unwatched; it exits when no server is recorded any more (a teardown ran), or none ever was and
nobody holds a lease (the starter died before launching one).

    python -m regen.servers.watchdog --output DIR [--idle-shutdown-s S]
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from regen.alerts import send
from regen.coordination import abandoned, approval_pending, live_leases
from regen.layout import RunLayout
from regen.servers.lifecycle import START_LEASE, relaunch, stop_recorded
from regen.servers.records import read_state

log = logging.getLogger("regen.watchdog")

MAX_RESTARTS = 3
FIRST_PAUSE_S = 5.0


def watch(layout: RunLayout, idle_shutdown_s: float | None, poll_s: float = 1.0) -> str:
    last_active = time.monotonic()
    restarts: dict[int, tuple[int, float]] = {}  # server index -> (restarts so far, not before)
    seen = False
    while True:
        recorded = read_state(layout)
        if not recorded:
            if seen or not live_leases(layout):
                return "no server recorded any more"
            time.sleep(poll_s)  # started before the first server: its starter (a lease) records it
            continue
        seen = True
        records = [r for r in recorded if r.is_here()]
        if not records:  # started on a node that is not this one: nothing here to watch
            return f"the servers are recorded on node {', '.join(sorted({r.node for r in recorded}))}"
        now = time.monotonic()
        if live_leases(layout) or approval_pending(layout):
            last_active = now
            for record in records:
                if record.running():
                    continue
                count, not_before = restarts.get(record.index, (0, 0.0))
                if count >= MAX_RESTARTS or now < not_before:
                    continue
                restarts[record.index] = (count + 1, now + FIRST_PAUSE_S * 2 ** count)
                message = (f"server {record.index} (port {record.port}) died; restart "
                           f"{count + 1} of {MAX_RESTARTS}")
                log.warning(message)
                try:
                    relaunch(layout, record.index)
                except Exception as exc:  # a failed restart is reported, then tried again later
                    message += f" failed: {exc}"
                    log.error(message)
                send("servers", message, output=str(layout.root))
        elif not any(record.running() for record in records):
            return "no server running and no shard needs one"
        elif abandoned(layout, START_LEASE):  # its starter died while they loaded: no task will use them
            stopped, _ = stop_recorded(layout, every=True, keep_watchdog=True)
            reason = f"the start of the servers was killed before they were up: stopped {stopped} at once"
            log.info(reason)
            return reason
        elif idle_shutdown_s and now - last_active >= idle_shutdown_s:
            stopped, _ = stop_recorded(layout, every=True, keep_watchdog=True)
            reason = f"no shard used the servers for {idle_shutdown_s:.0f} s: stopped {stopped}"
            log.info(reason)
            return reason
        time.sleep(poll_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m regen.servers.watchdog", description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True, help="the output directory whose servers to watch")
    parser.add_argument("--node", default=None, help="the node of a run over several nodes")
    parser.add_argument("--idle-shutdown-s", type=float, default=None)
    parser.add_argument("--poll-s", type=float, default=1.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.info("watching the servers of %s (idle shutdown: %s)", args.output,
             f"{args.idle_shutdown_s:.0f} s" if args.idle_shutdown_s else "never")
    log.info("exiting: %s", watch(RunLayout(args.output, args.node), args.idle_shutdown_s, args.poll_s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
