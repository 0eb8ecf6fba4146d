"""Two state machines, each an enum with its table of legal transitions, and every exit code.

A **worker** (``WorkerState``) is one process, one incarnation: it walks STARTING -> LOADING ->
WARMING -> READY -> DRAINING -> STOPPED, and any live state may end in DEAD. STOPPED and DEAD are
final: a process is never restarted, a new incarnation is a new worker. A *standby* worker
(``standby = N``, supervisor/fleet/standby.py) stops after warm-up in STANDBY, holding no slot; it goes
READY only when promoted into a slot.

A **slot** (``SlotState``) is a place for one worker (fixed cores/device) that outlives its
incarnations. While it has a current worker, the slot's state *follows* that worker's
(``SLOT_FOLLOWS``: booting -> STARTING, READY -> READY, DRAINING -> DRAINING, STOPPED -> STOPPED,
DEAD -> DEAD). Between incarnations it is what the restart policy chose: STARTING again,
BACKOFF (waiting out a delay), FATAL (given up on until ``modelwarden restart`` or the next
``fatal_retry``) or STOPPED.
Every edge a current worker can take maps onto a legal slot edge (a unit test checks it), so
following never raises.
"""

from __future__ import annotations

import enum


class WorkerState(str, enum.Enum):
    STARTING = "STARTING"  # process spawned, has not spoken yet
    LOADING = "LOADING"  # placed on its cores/device, loading the model
    WARMING = "WARMING"  # model loaded, running warm-up iterations
    STANDBY = "STANDBY"  # warmed up, holds no slot, serves nothing: waits to be promoted
    READY = "READY"  # serving
    DRAINING = "DRAINING"  # finishing what it holds; gets nothing new
    STOPPED = "STOPPED"  # exited cleanly when asked to
    DEAD = "DEAD"  # exited or was killed when it should not have


class SlotState(str, enum.Enum):
    STOPPED = "STOPPED"  # no worker and none to come: not started yet, or stopped
    STARTING = "STARTING"  # its current worker is booting (STARTING, LOADING or WARMING)
    READY = "READY"  # its current worker serves
    DRAINING = "DRAINING"  # its current worker drains (shutdown)
    DEAD = "DEAD"  # its current worker died; the restart policy decides what comes next
    BACKOFF = "BACKOFF"  # no worker: waiting out a delay before the next start
    FATAL = "FATAL"  # no worker: too many failed starts or probe replacements; waits for a
    # restart command or its ``fatal_retry``


W = WorkerState
S = SlotState

WORKER_TRANSITIONS: dict[WorkerState, frozenset[WorkerState]] = {
    # STARTING -> LOADING: the child placed itself and said hello
    W.STARTING: frozenset({W.LOADING, W.DRAINING, W.DEAD}),
    # LOADING -> WARMING: the model loaded
    W.LOADING: frozenset({W.WARMING, W.DRAINING, W.DEAD}),
    # WARMING -> READY: warm-up done; only now does it get traffic
    # WARMING -> STANDBY: warm-up done, but it was started as a standby: it waits, slotless
    W.WARMING: frozenset({W.READY, W.STANDBY, W.DRAINING, W.DEAD}),
    # STANDBY -> READY: promoted into a slot (re-pinned to the slot's cores) and said so
    # STANDBY -> DRAINING: no longer wanted (reload to a new version, fewer standbys, shutdown)
    W.STANDBY: frozenset({W.READY, W.DRAINING, W.DEAD}),
    # READY -> DRAINING: replaced, recycled or shutting down
    W.READY: frozenset({W.DRAINING, W.DEAD}),
    # DRAINING -> STOPPED: held nothing more and exited when told
    W.DRAINING: frozenset({W.STOPPED, W.DEAD}),
    # final: the slot starts a new incarnation instead
    W.STOPPED: frozenset(),
    W.DEAD: frozenset(),
}

SLOT_TRANSITIONS: dict[SlotState, frozenset[SlotState]] = {
    # STOPPED -> STARTING: first start, or a stopped slot restarted by a command
    # STOPPED -> FATAL: its worker, given up on for failing probes, drained and left
    S.STOPPED: frozenset({S.STARTING, S.FATAL}),
    # STARTING -> READY | DRAINING | DEAD: its booting worker did so
    S.STARTING: frozenset({S.READY, S.DRAINING, S.DEAD}),
    # READY -> STARTING: a replacement boots (the old worker serves on as `previous`)
    # READY -> DRAINING | DEAD: its serving worker did so
    S.READY: frozenset({S.STARTING, S.DRAINING, S.DEAD}),
    # DRAINING -> STOPPED | DEAD: its draining worker did so
    S.DRAINING: frozenset({S.STOPPED, S.DEAD}),
    # DEAD -> STARTING (restart at once) | BACKOFF (failed start) | FATAL (gave up) | STOPPED
    S.DEAD: frozenset({S.STARTING, S.BACKOFF, S.FATAL, S.STOPPED}),
    # BACKOFF -> STARTING: the delay passed
    S.BACKOFF: frozenset({S.STARTING, S.STOPPED}),
    # FATAL -> STARTING: an operator asked for a restart, or fatal_retry came due
    S.FATAL: frozenset({S.STARTING, S.STOPPED}),
}

# The slot's state while ``worker`` is its current incarnation.
SLOT_FOLLOWS: dict[WorkerState, SlotState] = {
    W.STARTING: S.STARTING, W.LOADING: S.STARTING, W.WARMING: S.STARTING,
    W.STANDBY: S.STARTING,  # a promoted standby is the slot's current from the promote message on
    W.READY: S.READY,
    W.DRAINING: S.DRAINING, W.STOPPED: S.STOPPED, W.DEAD: S.DEAD,
}

ALIVE = frozenset({W.STARTING, W.LOADING, W.WARMING, W.STANDBY, W.READY, W.DRAINING})
BOOTING = frozenset({W.STARTING, W.LOADING, W.WARMING})

_TABLES: dict[type, dict] = {WorkerState: WORKER_TRANSITIONS, SlotState: SLOT_TRANSITIONS}


class IllegalTransition(RuntimeError):
    pass


def check_transition(current: WorkerState | SlotState, new: WorkerState | SlotState) -> None:
    """Raise unless ``current -> new`` is an edge of the machine both states belong to."""
    if type(new) is not type(current):  # the enums are str-valued: "READY" == "READY" across them
        raise IllegalTransition(f"{current!r} -> {new!r} crosses two state machines")
    if new not in _TABLES[type(current)][current]:
        raise IllegalTransition(f"{current.value} -> {new.value} is not a legal transition")


# -- exit codes: one table for every process of ours ------------------------------------------
# Three processes exit, and each code means something only for its own process: a worker's 4 (its
# model did not load) and the daemon's 4 (a model is all FATAL) are read by different readers
# (the supervisor's restart policy; systemd and the operator).
#
#   process              code  name                 meaning
#   worker, gateway      0     EXIT_OK              clean
#   worker, gateway      3     EXIT_BOOT_ERROR      placement or environment failed
#   worker               4     EXIT_LOAD_ERROR      the model failed to load
#   worker               5     EXIT_WARMUP_ERROR    the model loaded but failed during warm-up
#   worker, gateway      6     EXIT_ORPHANED        the supervisor went away; it left on its own
#   worker               7     EXIT_PREPARE_ERROR   a prepare step failed, or missed the FP32 answers
#   daemon (serve)       1     EXIT_RUNTIME         cannot run: runtime directory, lock, endpoint
#   daemon, CLI          2     EXIT_CONFIG          a user mistake: bad config, input or output
#   daemon (serve)       4     EXIT_MODEL_FATAL     a model has every slot FATAL, fatal_exits on
#   status               0/1/3 EXIT_HEALTHY, EXIT_DEGRADED, EXIT_UNREACHABLE
#   stop, restart        1/2   EXIT_FAILED, EXIT_REFUSED (the daemon said no to a bad request)
#
# Worker exit codes are a contract between the worker and the supervisor's restart policy.
EXIT_OK = 0
EXIT_BOOT_ERROR = 3  # placement failed: bad cores, absent device, bad environment
EXIT_LOAD_ERROR = 4  # the model failed to load
EXIT_WARMUP_ERROR = 5  # the model loaded but failed during warm-up
EXIT_ORPHANED = 6  # the supervisor went away; the worker left on its own
EXIT_PREPARE_ERROR = 7  # a prepare step (freeze, compile, dtype) failed or missed its FP32 answers

EXIT_NAMES = {
    EXIT_OK: "exit 0 (clean)",
    EXIT_BOOT_ERROR: "exit 3 (boot error)",
    EXIT_LOAD_ERROR: "exit 4 (model load error)",
    EXIT_WARMUP_ERROR: "exit 5 (warm-up error)",
    EXIT_ORPHANED: "exit 6 (orphaned)",
    EXIT_PREPARE_ERROR: "exit 7 (prepare error)",
}

# The daemon's and the command line's (``modelwarden ...``). 1 and 2 are start-up failures
# (runtime, configuration), which systemd's RestartPreventExitStatus= may stop.
EXIT_RUNTIME = 1
EXIT_CONFIG = 2
EXIT_MODEL_FATAL = 4
EXIT_HEALTHY, EXIT_DEGRADED, EXIT_UNREACHABLE = 0, 1, 3  # modelwarden status
EXIT_FAILED, EXIT_REFUSED = 1, 2  # modelwarden stop / restart / reload

# Exits that will fail the same way again: back off at once, whatever the uptime.
STARTUP_FAILURES = frozenset({EXIT_BOOT_ERROR, EXIT_LOAD_ERROR, EXIT_WARMUP_ERROR, EXIT_PREPARE_ERROR})
