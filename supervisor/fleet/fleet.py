"""The fleet: every model's pool, the serving ones and those a reload removed that still drain,
and what is done to all of them at once -- restart or stop by target, apply a reload's plan,
tend the leaving, shut down. The Arbiter owns one; commands reach it through the Arbiter.

What a reload changes is decided before this runs (supervisor/fleet/reload.py: ``diff``) and each
pool acts on its own part (supervisor/fleet/pool.py); the fleet walks the plan in order.
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING, Callable

from modelwarden.shared.config import ModelConfig, Settings
from modelwarden.shared.protocol import BAD_REQUEST, UNKNOWN_MODEL, ProtocolError
from modelwarden.supervisor.fleet import probes
from modelwarden.supervisor.fleet.handle import WorkerHandle
from modelwarden.supervisor.fleet.placement import SlotPlacement
from modelwarden.supervisor.fleet.pool import ModelPool

if TYPE_CHECKING:
    from modelwarden.supervisor.fleet.reload import ReloadPlan
    from modelwarden.supervisor.routing.router import Router

logger = logging.getLogger(__name__)

PoolMaker = Callable[[ModelConfig, list[SlotPlacement], probes.ProbeJudge], ModelPool]


class Fleet:
    def __init__(self, pools: dict[str, ModelPool]) -> None:
        self.pools = pools  # model name -> its pool, in the configuration's order; changed in
        # place only (the Arbiter hands this very dict to the router)
        self.leaving: list[ModelPool] = []  # removed by a reload, draining

    def all(self) -> tuple[ModelPool, ...]:
        return (*self.pools.values(), *self.leaving)

    def pool_of(self, handle: WorkerHandle) -> ModelPool | None:
        """The pool ``handle`` belongs to: its model's, or a leaving one of the same name."""
        pool = self.pools.get(handle.spec.model.name)
        if self.leaving and (pool is None or handle not in pool.handles()):
            pool = next((p for p in self.leaving if handle in p.handles()), pool)
        return pool

    def claimed_cores(self) -> set[int]:
        """Every core a slot or a live standby of any pool holds."""
        pools = self.all()
        claimed = {core for each in pools for slot in each.slots for core in slot.placement.cores}
        claimed.update(core for each in pools for core in each.standby_cores())
        return claimed

    # -- by target (a model, or one worker slot: ``mlp#1``) -------------------------------------

    def target(self, target: str) -> tuple[ModelPool, int | None]:
        name, _, slot = target.partition("#")
        pool = self.pools.get(name)
        if pool is None or (slot and not (re.fullmatch(r"[0-9]{1,6}", slot) and int(slot) < len(pool.slots))):
            raise ProtocolError(BAD_REQUEST, f"no model or worker named {target!r}")
        return pool, int(slot) if slot else None

    def restart(self, target: str | None) -> list[str]:
        """Revive FATAL/stopped slots and replace live workers: every model, one model, or one
        worker slot."""
        if target is None:
            return [name for pool in self.pools.values() for name in pool.restart()]
        pool, slot = self.target(target)
        return pool.restart(slot)

    def stop(self, target: str) -> list[str]:
        """Drain and stop one model's workers, or one worker slot, until a restart."""
        pool, slot = self.target(target)
        return pool.stop(slot)

    # -- reload and scale --------------------------------------------------------------------------

    def running_placements(self) -> dict[str, list[SlotPlacement]]:
        return {name: [slot.placement for slot in pool.slots] for name, pool in self.pools.items()}

    def slot_versions(self) -> dict[str, set[str]]:
        return {name: pool.slot_versions() for name, pool in self.pools.items()}

    def judges_for(self, new: Settings, changes: "ReloadPlan") -> dict[str, probes.ProbeJudge]:
        """Each added or kept model's judge; ProtocolError (nothing touched) when a golden file
        cannot be read."""
        return probes.judges_for_reload(
            new, changes, {name: pool.judge for name, pool in self.pools.items()},
            {name: probes.probe_config_of(pool.config) for name, pool in self.pools.items()})

    def apply(self, new: Settings, changes: "ReloadPlan", placements: dict,
              judges: dict[str, probes.ProbeJudge], version_of: Callable[[ModelConfig], str],
              make_pool: PoolMaker, why: str, release: bool) -> list[str]:
        """Carry out a reload's plan: removed models leave, kept ones reconfigure and scale (and
        roll), added ones start. ``release``: the file was re-read, so slots stopped by a command
        start again. The summary lines, one per change."""
        for name in changes.removed:
            self.pools[name].retire(f"model {name} removed by a reload")
            self.leaving.append(self.pools[name])
        for name, change in changes.kept.items():
            pool = self.pools[name]
            pool.reconfigure(change.config, judges[name], change.roll, version_of(change.config))
            pool.scale(change.placements, f"{why}: workers {len(pool.slots)} -> "
                       f"{len(change.placements)}")
            if release and pool.release():
                change.reasons.append("stopped workers started again")
        added = {}
        for config in changes.added:
            for leaving in self.leaving:
                if leaving.name == config.name:  # it shares the new pool's queue: stop it now
                    leaving.scale([], f"{why}: model {config.name} added again")
            added[config.name] = make_pool(config, placements[config.name], judges[config.name])
        ordered = {model.name: self.pools.get(model.name) or added[model.name]
                   for model in new.models}
        self.pools.clear()  # in place: the router holds this very dict (Arbiter.pools)
        self.pools.update(ordered)
        for pool in added.values():
            pool.start_all()
        summary = changes.summary() or ["no change"]
        for line in summary:
            logger.info("%s: %s", why, line)
        return summary

    def tend_leaving(self, now: float, router: "Router") -> None:
        """Removed models: their workers serve what was queued for them, then drain and stop."""
        for pool in list(self.leaving):
            pool.tick(now)
            if pool.slots:
                router.dispatch(pool)
                if router.queued(pool) and not pool.ready_count():
                    router.fail_queue(pool, UNKNOWN_MODEL, f"model {pool.name!r} was removed "
                                      "by a reload before a worker could serve this")
                if not router.queued(pool):
                    pool.scale([], f"model {pool.name} removed by a reload")
            elif not pool.handles():
                self.leaving.remove(pool)
                router.forget(pool)
                logger.info("model %s: removed; its last worker has left", pool.name)

    # -- stopping ----------------------------------------------------------------------------------

    def shut_down(self) -> None:
        for pool in self.all():
            pool.shut_down()

    def terminate_all(self, reason: str) -> None:
        for pool in self.all():
            for handle in pool.handles():
                if handle.alive:
                    pool.terminate(handle, reason)
