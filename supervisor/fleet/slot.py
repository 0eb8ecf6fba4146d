"""One worker slot: a place for one worker (fixed cores/device) that outlives its incarnations.

``current`` is the incarnation the slot is responsible for; ``previous`` is an old one still
serving while its replacement boots (replace before retire: capacity never dips). The slot's
state is its own machine (``SlotState``, ``SLOT_TRANSITIONS`` in shared/states.py): ``follow``
mirrors the current worker's state, ``set_state`` records what the pool's restart policy chose.

Logging: the worker's own transition is logged by its handle, so a slot change that only mirrors
it is logged at DEBUG; a change the policy makes (a start, BACKOFF, FATAL, STOPPED) is logged
once at INFO (FATAL: CRITICAL). Either way the from-state is the slot's own, so a worker's
``LOADING -> DEAD`` is followed by the slot's ``DEAD -> BACKOFF``, never a contradiction.
"""

from __future__ import annotations

import collections
import logging
from typing import Any

from modelwarden.shared.states import SLOT_FOLLOWS, SlotState, WorkerState, check_transition
from modelwarden.supervisor.fleet.handle import WorkerHandle
from modelwarden.supervisor.fleet.placement import SlotPlacement

logger = logging.getLogger(__name__)


class Slot:
    """Compiled, an extension type whose fields are C slots (slot.pxd): the worker choice reads
    a slot's ``current`` and ``previous`` on every request (supervisor/routing/workers.py)."""

    def __init__(self, index: int, placement: SlotPlacement, model: str = "",
                 state: SlotState = SlotState.STOPPED) -> None:
        self.index = index
        self.placement = placement
        self.model = model
        self.state = state
        self.current: WorkerHandle | None = None
        self.previous: WorkerHandle | None = None  # serving while ``current`` boots
        self.generation = 0
        self.restarts = 0
        self.start_failures = 0
        self.last_exit: str | None = None
        self.failure: str | None = None
        self.causes: collections.deque = collections.deque(maxlen=10)
        self.backoff_timer: Any = None
        self.backoff_until: float | None = None
        self.retry_timer: Any = None  # a FATAL slot's next try on its own (``fatal_retry``)
        self.retry_at: float | None = None
        self.held: str | None = None  # stopped on purpose (stop command, scale down, removal): no restart
        self.stale_through = 0  # incarnations up to this generation run a superseded configuration
        self.probe_replacements = 0  # replacements for failed probes, since probes last passed
        self.probe_passes = 0  # probes passed in a row by the current worker
        self.fatal_on_exit: str | None = None  # given up on: FATAL once its worker has left
        self.promotions = 0  # standbys promoted into this slot
        self.promoted_at: float | None = None  # wall-clock time of the last promotion

    def __repr__(self) -> str:
        return f"Slot({self.model}#{self.index}, {self.state.value})"

    @property
    def name(self) -> str:
        return f"{self.model}#{self.index}"

    def set_state(self, new: SlotState, reason: str = "") -> None:
        """A change the restart policy chose."""
        level = logging.CRITICAL if new == SlotState.FATAL else logging.INFO
        self._change(new, level, reason)

    def follow(self, worker_state: WorkerState) -> None:
        """The current worker changed state: the slot's state follows it."""
        self._change(SLOT_FOLLOWS[worker_state], logging.DEBUG, f"worker {worker_state.value}")

    def _change(self, new: SlotState, level: int, reason: str) -> None:
        if new == self.state:
            return
        check_transition(self.state, new)
        logger.log(level, "slot %s: %s -> %s%s", self.name, self.state.value, new.value,
                   f" ({reason})" if reason else "")
        self.state = new

    def runs_stale(self) -> bool:
        """Its current worker was spawned under a configuration a reload has since replaced."""
        return (self.stale_through > 0 and self.current is not None
                and self.current.spec.generation <= self.stale_through)

    def handles(self) -> list[WorkerHandle]:
        return [handle for handle in (self.current, self.previous) if handle is not None]
