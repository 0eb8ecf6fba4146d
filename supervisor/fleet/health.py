"""The daemon's health as the service manager sees it: ready, settled, or beyond help.

A model is *ready* when at least ``ready_min`` of its slots serve (default: every slot); the
daemon is ready when every model is. That is what ``READY=1`` promises systemd, so ``systemctl
start`` returns only once requests can be served. A model is *dead* when every one of its slots
is FATAL and holds no process: nothing will serve it until an operator acts, so the daemon says so
in ``STATUS=`` and, with ``[daemon] fatal_exits``, exits with ``EXIT_MODEL_FATAL`` so that
``Restart=`` and alerting see it. A reload has *settled* when the daemon is ready and no slot still
has an old worker serving while its replacement starts.

Pure functions of the pools' slots: no clock, no sockets (tests/test_unit_health.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from modelwarden.shared.states import SlotState, WorkerState



@dataclass(frozen=True)
class ModelHealth:
    name: str
    workers: int
    ready: int
    ready_min: int
    fatal: tuple[str, ...]  # FATAL slots, e.g. ("mlp#0",)
    replacing: int  # slots whose old worker serves on while its replacement starts
    dead: bool  # every slot FATAL, no process left

    @property
    def ready_enough(self) -> bool:
        return self.ready >= self.ready_min


@dataclass(frozen=True)
class Health:
    models: tuple[ModelHealth, ...]

    @property
    def ready(self) -> bool:
        return all(model.ready_enough for model in self.models)

    @property
    def settled(self) -> bool:
        return self.ready and not any(model.replacing for model in self.models)

    @property
    def dead(self) -> list[str]:
        return [model.name for model in self.models if model.dead]

    def status_line(self) -> str:
        """One line for ``STATUS=``: capacity, then what READY waits for, then what is FATAL."""
        ready = sum(model.ready for model in self.models)
        total = sum(model.workers for model in self.models)
        parts = [f"{ready}/{total} workers ready"]
        waiting = [f"{m.name} {m.ready}/{m.workers} (needs {m.ready_min})"
                   for m in self.models if not m.ready_enough]
        if waiting:
            parts.append("waiting for " + ", ".join(waiting))
        fatal = [name for model in self.models for name in model.fatal]
        if fatal:
            parts.append("FATAL: " + ", ".join(fatal))
        for name in self.dead:
            parts.append(f"every worker of {name!r} is FATAL")
        return "; ".join(parts)


def model_health(name: str, ready_min: int | None, slots: list) -> ModelHealth:
    """``slots``: the pool's ``Slot`` objects (supervisor/fleet/slot.py)."""
    serving = sum(1 for slot in slots
                  if any(handle.state == WorkerState.READY for handle in slot.handles()))
    fatal = tuple(slot.name for slot in slots if slot.state == SlotState.FATAL)
    # A reload rolls one slot at a time: a slot still waiting for its turn is not settled either,
    # unless a replacement that cannot start (FATAL, its old worker serving) halted the roll.
    halted = any(slot.previous is not None and slot.state == SlotState.FATAL for slot in slots)
    replacing = sum(1 for slot in slots
                    if (slot.previous is not None and slot.state != SlotState.FATAL)
                    or (not halted and slot.runs_stale()))
    dead = bool(slots) and all(slot.state == SlotState.FATAL and not slot.handles() for slot in slots)
    return ModelHealth(name, len(slots), serving, len(slots) if ready_min is None else ready_min,
                       fatal, replacing, dead)


def daemon_health(pools: Iterable) -> Health:
    """``pools``: the arbiter's ``ModelPool`` objects."""
    return Health(tuple(model_health(pool.name, pool.config.ready_min, pool.slots) for pool in pools))
