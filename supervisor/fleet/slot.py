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
from dataclasses import dataclass, field
from typing import Any

from modelwarden.shared.states import SLOT_FOLLOWS, SlotState, WorkerState, check_transition
from modelwarden.supervisor.fleet.handle import WorkerHandle
from modelwarden.supervisor.fleet.placement import SlotPlacement

logger = logging.getLogger(__name__)


@dataclass(eq=False, slots=True)
class Slot:
    index: int
    placement: SlotPlacement
    model: str = ""
    state: SlotState = SlotState.STOPPED
    current: WorkerHandle | None = None
    previous: WorkerHandle | None = None
    generation: int = 0
    restarts: int = 0
    start_failures: int = 0
    last_exit: str | None = None
    failure: str | None = None
    causes: collections.deque = field(default_factory=lambda: collections.deque(maxlen=10))
    backoff_timer: Any = None
    backoff_until: float | None = None
    retry_timer: Any = None  # a FATAL slot's next try on its own (``fatal_retry``)
    retry_at: float | None = None
    held: str | None = None  # stopped on purpose (stop command, scale down, removal): no restart
    stale_through: int = 0  # incarnations up to this generation run a superseded configuration
    probe_replacements: int = 0  # replacements for failed probes, since probes last passed
    probe_passes: int = 0  # probes passed in a row by the current worker
    fatal_on_exit: str | None = None  # given up on: FATAL once its worker has left
    promotions: int = 0  # standbys promoted into this slot
    promoted_at: float | None = None  # wall-clock time of the last promotion

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
