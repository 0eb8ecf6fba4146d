"""Placement planning: which cores, how many threads and which device each worker slot gets.

CPU workers get disjoint core sets carved in order from the cores this process may use
(``os.sched_getaffinity(0)``), or the explicit ``cores`` lists. A worker never runs more threads
than it has cores; the threads of all CPU workers together may not exceed the available cores
unless ``allow_oversubscription`` is set (then it is a warning, and core sets wrap around).
GPU workers get cores too, for their host-side threads.

On a reload (supervisor/fleet/reload.py) the running slots' placements are passed as ``keep``: a slot
that still exists keeps its cores when they still fit (the same count, still available), and only
new slots are carved from what is left, so adding or scaling one model does not move another.
"""

from __future__ import annotations

import collections
import logging
import os
from dataclasses import dataclass

from modelwarden.shared.config import ConfigError, Settings
from modelwarden.shared.cpulist import format_cores

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SlotPlacement:
    cores: list[int]
    threads: int
    device: str


def available_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def plan(settings: Settings, cores: list[int] | None = None,
         keep: dict[str, list[SlotPlacement]] | None = None) -> dict[str, list[SlotPlacement]]:
    """Every model's slots, or ConfigError naming the key that cannot be satisfied. ``keep``:
    the placements running now, kept for the slots that still fit them."""
    cores = available_cores() if cores is None else cores
    oversubscribe = settings.daemon.allow_oversubscription
    used: dict[int, str] = {}  # core -> the first slot given it, for error messages
    load: collections.Counter = collections.Counter()  # core -> how many slots share it
    kept = _kept(settings, keep or {}, cores)
    for owner, slot_cores in kept.items():  # claimed first: new slots are carved around them
        load.update(slot_cores)
        for core in slot_cores:
            used.setdefault(core, owner)
    placements: dict[str, list[SlotPlacement]] = {}
    total_threads = 0
    for index, model in enumerate(settings.models):
        key = f"models[{index}] (model {model.name!r})"
        slots = []
        for slot in range(model.workers):
            owner = f"{model.name}#{slot}"
            if model.cores is not None:
                slot_cores = _explicit(model.cores[slot], cores, f"{key}.cores[{slot}]")
            elif owner in kept:
                slot_cores = kept[owner]
            else:
                slot_cores = _carve(model.cores_per_worker or 1, cores, load, oversubscribe,
                                    f"{key}.cores_per_worker")
            if owner not in kept:
                _claim(slot_cores, used, owner, oversubscribe, f"{key}.cores[{slot}]")
                load.update(slot_cores)
            threads = model.threads or len(slot_cores)
            if threads > len(slot_cores):
                raise ConfigError(f"{key}.threads", f"{threads} threads on {len(slot_cores)} "
                                  "cores: a worker never runs more threads than it has cores")
            device = model.device_of(slot)
            if device == "cpu":
                total_threads += threads
            slots.append(SlotPlacement(slot_cores, threads, device))
        placements[model.name] = slots
    if total_threads > len(cores):
        message = (f"CPU workers run {total_threads} threads on {len(cores)} available cores "
                   f"({format_cores(cores)})")
        if not oversubscribe:
            raise ConfigError("daemon.allow_oversubscription",
                              message + "; lower workers/threads or set allow_oversubscription = true")
        logger.warning("oversubscribed: %s", message)
    return placements


def _kept(settings: Settings, keep: dict[str, list[SlotPlacement]],
          cores: list[int]) -> dict[str, list[int]]:
    """Worker id -> cores, for each running slot of a carved model that still fits its cores."""
    kept = {}
    available = set(cores)
    for model in settings.models:
        if model.cores is not None:
            continue
        for slot, placement in enumerate(keep.get(model.name, [])[:model.workers]):
            if len(placement.cores) == (model.cores_per_worker or 1) and set(placement.cores) <= available:
                kept[f"{model.name}#{slot}"] = list(placement.cores)
    return kept


def _explicit(wanted: list[int], cores: list[int], key: str) -> list[int]:
    missing = sorted(set(wanted) - set(cores))
    if missing:
        raise ConfigError(key, f"cores {format_cores(missing)} are not available "
                          f"(this process may use {format_cores(cores)})")
    return sorted(set(wanted))


def _carve(count: int, cores: list[int], load: collections.Counter, oversubscribe: bool,
           key: str) -> list[int]:
    """The first ``count`` cores nobody has; with oversubscription, the least shared ones."""
    if count > len(cores):
        raise ConfigError(key, f"{count} cores per worker but only {len(cores)} available")
    free = [core for core in cores if not load[core]]
    if len(free) >= count:
        return free[:count]
    if not oversubscribe:
        raise ConfigError(key, f"not enough cores: {len(cores)} available "
                          f"({format_cores(cores)}), {len(free)} unassigned; set "
                          "daemon.allow_oversubscription = true to share cores")
    return sorted(sorted(cores, key=lambda core: (load[core], core))[:count])


def _claim(slot_cores: list[int], used: dict[int, str], owner: str, oversubscribe: bool,
           key: str) -> None:
    for core in slot_cores:
        if core in used and not oversubscribe:
            raise ConfigError(key, f"core {core} is already given to {used[core]}")
        used.setdefault(core, owner)
