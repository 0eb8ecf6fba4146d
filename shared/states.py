"""Worker lifecycle states and the only transitions allowed between them.

A worker process walks STARTING -> LOADING -> WARMING -> READY -> DRAINING -> STOPPED; any live
state may end in DEAD. BACKOFF and FATAL describe a *slot* between incarnations: waiting to
restart after a failed start, or given up on until ``modelwarden restart``.
"""

from __future__ import annotations

import enum


class WorkerState(str, enum.Enum):
    STARTING = "STARTING"  # process spawned, has not spoken yet
    LOADING = "LOADING"  # placed on its cores/device, loading the model
    WARMING = "WARMING"  # model loaded, running warm-up iterations
    READY = "READY"  # serving
    DRAINING = "DRAINING"  # finishing what it holds; gets nothing new
    STOPPED = "STOPPED"  # exited cleanly when asked to
    DEAD = "DEAD"  # exited or was killed when it should not have
    BACKOFF = "BACKOFF"  # slot: waiting out a delay before the next start
    FATAL = "FATAL"  # slot: too many failed starts; only a restart command revives it


S = WorkerState

TRANSITIONS: dict[WorkerState, frozenset[WorkerState]] = {
    # STARTING -> LOADING: the child placed itself and said hello
    S.STARTING: frozenset({S.LOADING, S.DRAINING, S.DEAD}),
    # LOADING -> WARMING: the model loaded
    S.LOADING: frozenset({S.WARMING, S.DRAINING, S.DEAD}),
    # WARMING -> READY: warm-up done; only now does it get traffic
    S.WARMING: frozenset({S.READY, S.DRAINING, S.DEAD}),
    # READY -> DRAINING: replaced, recycled or shutting down
    S.READY: frozenset({S.DRAINING, S.DEAD}),
    # DRAINING -> STOPPED: held nothing more and exited when told
    S.DRAINING: frozenset({S.STOPPED, S.DEAD}),
    # DEAD -> STARTING (restart at once) | BACKOFF (failed start) | FATAL (gave up)
    S.DEAD: frozenset({S.STARTING, S.BACKOFF, S.FATAL, S.STOPPED}),
    # BACKOFF -> STARTING: the delay passed
    S.BACKOFF: frozenset({S.STARTING, S.STOPPED}),
    # FATAL -> STARTING: an operator asked for a restart
    S.FATAL: frozenset({S.STARTING, S.STOPPED}),
    # STOPPED -> STARTING: a stopped slot restarted by a command
    S.STOPPED: frozenset({S.STARTING}),
}

ALIVE = frozenset({S.STARTING, S.LOADING, S.WARMING, S.READY, S.DRAINING})
BOOTING = frozenset({S.STARTING, S.LOADING, S.WARMING})


class IllegalTransition(RuntimeError):
    pass


def check_transition(current: WorkerState, new: WorkerState) -> None:
    if new not in TRANSITIONS[current]:
        raise IllegalTransition(f"{current.value} -> {new.value} is not a legal transition")


# Worker exit codes: a contract between the worker and the supervisor's restart policy.
EXIT_OK = 0
EXIT_BOOT_ERROR = 3  # placement failed: bad cores, absent device, bad environment
EXIT_LOAD_ERROR = 4  # the model failed to load
EXIT_WARMUP_ERROR = 5  # the model loaded but failed during warm-up
EXIT_ORPHANED = 6  # the supervisor went away; the worker left on its own

EXIT_NAMES = {
    EXIT_OK: "exit 0 (clean)",
    EXIT_BOOT_ERROR: "exit 3 (boot error)",
    EXIT_LOAD_ERROR: "exit 4 (model load error)",
    EXIT_WARMUP_ERROR: "exit 5 (warm-up error)",
    EXIT_ORPHANED: "exit 6 (orphaned)",
}

# Exits that will fail the same way again: back off at once, whatever the uptime.
STARTUP_FAILURES = frozenset({EXIT_BOOT_ERROR, EXIT_LOAD_ERROR, EXIT_WARMUP_ERROR})
