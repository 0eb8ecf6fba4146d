"""What the request path asks of a model's workers, on every request: which one takes it, whether
any could, whether one owes a probe. The pool (supervisor/fleet/pool.py) owns the workers and
their lives; these are its rules for choosing, compiled (workers.pxd) because the router applies
them per request, and the pool's own methods (``least_loaded``, ``all_fatal``) call them too, so
each rule exists once.

They read the fleet's objects as they are: a pool's ``slots``, each slot's ``current`` and
``previous`` worker and its ``state`` and ``held``, each worker's ``state``, ``inflight``,
``probe``, ``retiring`` and ``last_dispatch``.
"""

from __future__ import annotations

from modelwarden.shared.states import SlotState, WorkerState

_READY = WorkerState.READY
_FATAL = SlotState.FATAL


def least_loaded(slots, limit):
    """The READY worker with room (fewer than ``limit`` in flight) and the fewest requests in
    flight; workers failing probes (or being replaced) only when nobody else has room; ties go to
    the *most* recently used: its model is still in the CPU caches. (Least recently used
    alternated the workers at low load, so each forward found its weights evicted by the other
    worker's: a 13 MB model's forward measured 3x slower that way on a 2-core machine.) None when
    no worker has room."""
    best = None
    best_suspect = True
    best_load = 0
    best_used = 0.0
    for slot in slots:
        current = slot.current
        previous = slot.previous
        for which in range(2):  # the two workers a slot may have, without a tuple per slot
            handle = current if which == 0 else previous
            if handle is None or not has_room(handle, limit):
                continue
            load = len(handle.inflight)
            suspect = handle.probe.consecutive_failures > 0 or handle.retiring is not None
            used = handle.last_dispatch
            # (suspect, load, -used) smallest wins; on a tie the first seen stays
            if (best is None or suspect < best_suspect
                    or (suspect == best_suspect
                        and (load < best_load or (load == best_load and used > best_used)))):
                best = handle
                best_suspect = suspect
                best_load = load
                best_used = used
    return best


def has_room(handle, limit):
    """READY, with fewer than ``limit`` requests in flight."""
    return handle.state is _READY and len(handle.inflight) < limit


def serves_nothing(slots):
    """No slot serves or will start a worker by itself soon: each is FATAL or stopped (held)."""
    for slot in slots:
        if slot.current is not None or slot.previous is not None:
            return False
        if slot.state is not _FATAL and not slot.held:
            return False
    return True


def needs_the_pool(handle):
    """Whether a result from ``handle`` may change what the pool does with it
    (``ModelPool.after_result``): a request budget (``max_requests``) to count against, or a
    drain that waits for its last request. A READY worker without a budget needs nothing."""
    return bool(handle.request_limit) or handle.state is not _READY


def probe_due(handle, now):
    """The worker's next probe may go now: none in flight and its time has come (probes on)."""
    probe = handle.probe
    return probe.inflight_since is None and now >= probe.due_at
