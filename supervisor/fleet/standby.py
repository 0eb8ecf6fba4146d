"""Warm standby workers of one model (``standby = N``): kept ready, handed out on demand.

Contract. ``Standbys`` keeps ``config.standby`` extra worker processes alive for a pool. Each is
spawned like any worker (its own link and the same spawn secret,
supervisor/fleet/workerauth.py) but with ``spec.standby`` set: it boots, loads, warms up, then reports
STANDBY and serves nothing (worker/standby.py). It belongs to no slot: the slots' restart policy
never sees it, and its death only makes ``Standbys`` start another (after a delay that doubles
while standbys fail to boot, so a model that cannot load does not spawn in a tight loop).

The first standbys start once every slot's first worker is up (READY or past its first try), so
they never slow the daemon's start. ``take(device)`` hands the pool one STANDBY worker for a slot that needs a new incarnation; the
pool promotes it (its ``_promote``) and calls ``fill`` so a new standby starts in the background.
``retire`` drains them all (a reload to a new version, or the model removed): a standby of an old
version is never promoted.

Placement (``placement_for``): cores that no slot and no other standby holds when there are
enough of them; else the cores of a slot of the model (round robin), where it sleeps until
promoted and re-pinned. Either way it runs the slots' thread count from its first parallel
region on. A standby costs a whole worker's memory (docs/OPERATIONS.md).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

from modelwarden.shared.states import SlotState, WorkerState
from modelwarden.supervisor.fleet.handle import WorkerHandle, exit_cause
from modelwarden.supervisor.fleet.placement import SlotPlacement

if TYPE_CHECKING:
    from modelwarden.supervisor.fleet.pool import ModelPool

logger = logging.getLogger(__name__)
S = WorkerState


def placement_for(template: SlotPlacement, available: list[int], claimed: set[int]) -> SlotPlacement:
    """A standby's cores: as many free ones as ``template`` (a slot it may replace) has, or that
    slot's own cores when too few are free. Threads and device are always the slot's."""
    if template.device == "cpu":
        free = [core for core in available if core not in claimed]
        if len(free) >= len(template.cores):
            return SlotPlacement(free[:len(template.cores)], template.threads, template.device)
    return template


class Standbys:
    def __init__(self, pool: "ModelPool") -> None:
        self.pool = pool
        self.handles: list[WorkerHandle] = []
        self.serial = 0  # the next standby's number: its worker id is "<model>#standby<n>"
        self.failures = 0  # standbys in a row that died before (or soon after) STANDBY
        self.timer = None
        self.retired = 0  # standbys drained because they were stale or surplus

    @property
    def host(self):
        return self.pool.host

    def owns(self, handle: WorkerHandle) -> bool:
        return handle in self.handles

    def ready(self) -> list[WorkerHandle]:
        return [handle for handle in self.handles if handle.state == S.STANDBY]

    def live(self) -> list[WorkerHandle]:
        """The standbys that count toward ``standby``: alive and not being let go."""
        return [handle for handle in self.handles
                if handle.alive and handle.state != S.DRAINING and not handle.retiring]

    def take(self, slot) -> WorkerHandle | None:
        """A warmed standby that can serve ``slot``, now the caller's; None if none is warm.
        Only on the slot's device: a process cannot change GPUs. With a bare ``cuda`` (the
        device chosen by slot index in the worker) only one modelled on that very slot will do."""
        device = slot.placement.device
        for handle in self.ready():
            if handle.retiring or handle.spec.device != device:
                continue
            if device == "cuda" and handle.spec.slot != slot.index:
                continue
            self.handles.remove(handle)
            return handle
        return None

    def fill(self) -> None:
        """Start standbys until ``config.standby`` are alive (unless a delay after failures runs,
        the daemon stops or the model has no slot to model them on); let surplus ones go."""
        pool = self.pool
        if self.host.stopping or not pool.slots or all(slot.held for slot in pool.slots):
            return
        if any(slot.generation == 1 and slot.state == SlotState.STARTING for slot in pool.slots):
            return  # the slots' first workers boot first: standbys must not delay serving
        live = self.live()
        for handle in live[pool.config.standby:]:
            self.let_go(handle, "more standbys than configured")
        while self.timer is None and len(self.live()) < pool.config.standby:
            if self._launch() is None:
                return

    def _launch(self) -> WorkerHandle | None:
        pool = self.pool
        serial = self.serial
        self.serial += 1
        index = serial % len(pool.slots)
        template = pool.slots[index].placement
        placement = self.host.standby_placement(pool, template)
        # ``slot``: the slot it is modelled on (a bare "cuda" picks its GPU by it); its id and
        # routing use ``standby`` until it is promoted
        spec = dataclasses.replace(self.host.worker_spec(pool.config, index, 0, placement),
                                   standby=serial)
        try:
            handle = self.host.launch(spec, pool._on_state)
            handle.pool = pool
        except OSError as exc:
            logger.critical("%s: cannot spawn a standby: %s", pool.name, exc)
            self._retry_later()
            return None
        self.handles.append(handle)
        return handle

    def let_go(self, handle: WorkerHandle, reason: str) -> None:
        """Stop one standby (told to exit when warm, terminated while booting)."""
        if handle.retiring or not handle.alive:
            return
        handle.retiring = reason
        self.retired += 1
        if handle.state == S.STANDBY:
            handle.set_state(S.DRAINING, reason)
            handle.stop_sent = True
            self.host.send_stop(handle)
            self.pool.terminate_later(handle)
        else:
            self.pool.terminate(handle, reason)

    def retire(self, reason: str) -> None:
        """Every standby goes (a new version, or the model removed); ``fill`` starts new ones."""
        for handle in list(self.handles):
            self.let_go(handle, reason)

    def on_exit(self, handle: WorkerHandle) -> None:
        """A standby's process is gone: forget it, and start another unless it was let go."""
        self.handles.remove(handle)
        if handle.retiring or self.host.stopping:
            self.fill()
            return
        now = self.host.clock()
        reached = handle.ready_at  # when it reported STANDBY
        if reached is None or now - reached < self.pool.config.start_seconds:
            self.failures += 1
        else:
            self.failures = 0
        logger.warning("%s pid %s: standby exited (%s); starting another%s", handle.worker_id,
                       handle.pid, exit_cause(handle.exitcode),
                       f" after {self._delay():.1f}s" if self.failures else "")
        if self.failures:
            self._retry_later()
        else:
            self.fill()

    def _delay(self) -> float:
        config = self.pool.config
        return min(config.backoff_initial * 2 ** max(self.failures - 1, 0), config.backoff_max)

    def _retry_later(self) -> None:
        if self.timer is None:
            self.timer = self.host.timers.call_at(self.host.clock() + self._delay(), self._retry)

    def _retry(self) -> None:
        self.timer = None
        self.fill()

    def stop_all(self, reason: str) -> None:
        self.host.timers.cancel(self.timer)
        self.timer = None
        self.retire(reason)
