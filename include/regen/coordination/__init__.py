"""Every lock, lease and slot regen holds, and what happens to each when its holder dies.

All of them are files held with ``flock``: the kernel drops the lock however the holder ends
(exit, SIGKILL, a lost Celery worker), so no lock outlives its process and nothing needs a
timeout to be freed. Files are opened read-write, which exclusive locks need on NFSv4 (mount
without ``local_lock``) and Lustre (mount with ``-o flock``); a mount that keeps locks local to
each client cannot coordinate several nodes. Paths are :class:`regen.layout.RunLayout`'s.

====================================  =====================================  ============================  ========================================  ==========================
lock file                             holder                                 scope                         when the holder dies                      who cleans up
====================================  =====================================  ============================  ========================================  ==========================
``work/servers/servers.lock``         whoever starts, relaunches or stops    one start or stop, blocking   the lock is free; a half-started server   the next start or teardown
(``work/nodes/NODE/``, per node)      the node's servers                                                   is in servers.json with its pid           (start_servers stops it)
``work/locks/shard-I-of-N.lock``      the one generator of shard I           its attempt; a second one     free: Airflow's retry takes it and        nothing (the file stays,
                                      (text: ``pid P on HOST``)              fails at once                 resumes from the journal                  holding the last holder)
``work/manifest.lock``,               the writer of manifest.json; the one   one write, one indexing       free; the write is atomic, so the old     nothing
``work/index.lock``                   process indexing the prompt file                                     manifest stays whole
``work/servers/leases/NAME.lease``    a shard or the canary using the        its whole use, renewed        free at once; stale after 60 s without    its retry (same name);
                                      node's servers (its demand inside)     (mtime) every rebalance       renewal (a hung holder)                   the file stays till then
``work/servers/slots/HOST-PORT/``     a process with requests in flight on   taken and given back as       free: the slots go to the other shards    nothing
``slot-NNNN`` (request slots)         that server                            fair shares change            at their next rebalance
``work/claims/NODE/slot-NNNN``        a shard generating on NODE             the shard's attempt           free: the node takes another shard        nothing
(shard claims)
``STAGING/.NAME.lock``                the process staging one model copy     the copy and its check        free; the half copy is a hidden temp      the next staging removes it
``work/servers/approval.json``        a run waiting for a person's approval  from its canary to the first  (no process: a deadline, 24 h) the        the first shard, the
(not a lock: a hold with a deadline)  (written by the canary)                shard or the teardown         servers idle out after it                 teardown
``work/owner.json``                   the DAG run that holds the output      from its preflight to its     taken over once Airflow says its run      its teardown; else the
(a claim, written under               (written by its preflight, renewed     teardown                      ended (or, with no one to ask, nothing    next run's preflight
``work/owner.lock``; on a bucket      by every stage while it works)                                       of it lives and it has not renewed for
also ``URL/_regen/owners/``)                                                                               30 min); every write checks it first
``URL/_regen/fences/SHARD/fNNNNNN``   an attempt at a shard whose output is  from its claim to its last     nothing to free: a later attempt's fence  the publish (parts and
(object-store output: not a lock, a   on an object store (regen.parts);      seal; the highest fence is    outranks it, its later parts and commits  commits go; fences stay)
fence: create-only, never released)   the local shard lock above still       the only one whose new        never count, it stops at its next seal
                                      guards one node                        commits count
====================================  =====================================  ============================  ========================================  ==========================

On an object-store output every ``work/`` file above is in the node's own ``work_dir`` (the bucket has
no lock and no rename): they coordinate the processes of one node (or of every node that shares that
``work_dir``). Nodes that share nothing but the bucket stay exactly-once through the fences; their
shard claims and request slots then no longer see each other, so place one Celery queue per node or
give the nodes a shared ``work_dir``.

The watchdog (:mod:`regen.servers.watchdog`) is the one process that outlives Airflow on purpose:
it stops a node's servers when no lease has been live (and no approval pending) for ``idle_shutdown_s``.
"""

from regen.coordination.leases import (Lease, abandoned, approval_pending, end_approval_hold, hold_for_approval,
                                      live_leases)
from regen.coordination.locks import FileLock, LockHeld, is_locked
from regen.coordination.owner import OutputHeld, OutputLost, check_held, claim_output, holding_output, release_output
from regen.coordination.shares import FairShare, water_fill
from regen.coordination.slots import SlotPool, request_slots, shard_claims

__all__ = ["FairShare", "FileLock", "Lease", "LockHeld", "OutputHeld", "OutputLost", "SlotPool", "abandoned",
           "approval_pending", "check_held", "claim_output", "end_approval_hold", "hold_for_approval",
           "holding_output", "is_locked", "live_leases", "release_output", "request_slots", "shard_claims",
           "water_fill"]
