"""What ``modelwarden status`` shows: the daemon, its models and every worker, read from the
daemon's parts as they are now. The Arbiter answers the status command with this; what this reads
of it is ``StatusView``, declared here rather than reached for attribute by attribute.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Protocol

from modelwarden.shared import __version__
from modelwarden.shared.states import SlotState
from modelwarden.supervisor.fleet.handle import read_rss

if TYPE_CHECKING:
    from modelwarden.shared.config import Settings
    from modelwarden.supervisor.fleet.versions import VersionBook
    from modelwarden.supervisor.gatewaykeeper import GatewayKeeper
    from modelwarden.supervisor.routing.buffers import BufferRegistry
    from modelwarden.supervisor.routing.connections import ConnectionGuard
    from modelwarden.supervisor.routing.quotas import Quotas
    from modelwarden.supervisor.routing.router import Router


class StatusView(Protocol):
    """The parts of the daemon a status snapshot reads (the Arbiter has them all)."""

    pid: int
    started_at: float
    settings: "Settings"
    stopping: bool
    pools: dict  # model name -> ModelPool
    leaving_pools: list  # removed by a reload, still draining
    versions: "VersionBook"
    router: "Router"
    registry: "BufferRegistry"
    quotas: "Quotas"
    connections: "ConnectionGuard | None"
    gateway: "GatewayKeeper | None"

    def clock(self) -> float: ...


def status_snapshot(arbiter: StatusView) -> dict[str, Any]:
    now = arbiter.clock()
    models, workers = [], []
    for pool in arbiter.pools.values():
        fatal = [f"{pool.name}#{slot.index}" for slot in pool.slots if slot.state == SlotState.FATAL]
        version = arbiter.versions.of(pool.config)
        models.append({"name": pool.name, "source": pool.config.source, "workers": len(pool.slots),
                       "ready": pool.ready_count(), "fatal_slots": fatal, "queued": arbiter.router.queued(pool),
                       "version": version, "rolling": pool.rolling(),
                       "golden": pool.judge.golden_of(version) is not None,
                       "batching": _batching_row(arbiter, pool)})
        for slot in (*pool.slots, *pool.leaving):
            workers.extend(_slot_rows(pool, slot, now))
        workers.extend(_standby_row(pool, handle, now) for handle in pool.standbys.handles)
    for pool in arbiter.leaving_pools:  # removed by a reload, still draining
        for slot in (*pool.slots, *pool.leaving):
            workers.extend(_slot_rows(pool, slot, now))
    return {"daemon": {"pid": arbiter.pid, "version": __version__,
                       "uptime_s": round(now - arbiter.started_at, 3),
                       "endpoints": {"frontend": arbiter.settings.frontends,
                                     "control": arbiter.settings.control_endpoint,
                                     "admin": arbiter.settings.admin_endpoint},
                       "stopping": arbiter.stopping, "pending": len(arbiter.router.pending),
                       "limits": limits_snapshot(arbiter),
                       "buffers": len(arbiter.registry), "buffer_bytes": arbiter.registry.bytes,
                       "identities": arbiter.quotas.view()},
            "models": models, "workers": workers,
            **({"gateway": arbiter.gateway.row()} if arbiter.gateway is not None else {})}


def _batching_row(arbiter: StatusView, pool) -> dict | None:
    """None when batching is off for the model; else its settings and what it did."""
    config = pool.config.batching
    if not config.enabled:
        return None
    return {"max_size_allowed": config.max_size, "max_delay_us": config.max_delay_us,
            "dim": config.dim, **arbiter.router.service_of(pool).batches.view()}


def _slot_rows(pool, slot, now: float) -> list[dict]:
    base = {"id": f"{pool.name}#{slot.index}", "model": pool.name, "restarts": slot.restarts,
            "last_exit": slot.last_exit, "error": slot.failure,
            "restart_causes": [{"at": round(at, 3), "cause": cause} for at, cause in slot.causes],
            "device": slot.placement.device, "cores": slot.placement.cores,
            "threads": slot.placement.threads, "promotions": slot.promotions,
            "promoted_at": round(slot.promoted_at, 3) if slot.promoted_at else None}
    if not slot.handles():
        return [{**base, **_empty_row(slot, now)}]
    return [{**base, **_handle_row(handle, now)} for handle in slot.handles()]


def _standby_row(pool, handle, now: float) -> dict:
    """A standby (supervisor/fleet/standby.py): a worker row of its own, with no slot behind it."""
    return {"id": handle.worker_id, "model": pool.name, "restarts": 0, "last_exit": None,
            "restart_causes": [], "promotions": 0, "promoted_at": None, "standby": True,
            **_handle_row(handle, now)}


def _empty_row(slot, now: float) -> dict:
    """A slot with no process (BACKOFF, FATAL, STOPPED): the same keys as a live worker's row."""
    return {"state": slot.state.value, "pid": None, "generation": slot.generation,
            "interop_threads": None, "warmup": None, "uptime_s": None, "ready_s": None, "requests": 0, "errors": 0,
            "inflight": 0, "rss_bytes": None, "rss_trend_bytes_per_s": None, "cuda_bytes": None,
            "latency_p50_us": None, "retiring": None, "probe": None, "version": None, "prepare": None,
            "backoff_s": round(slot.backoff_until - now, 3) if slot.backoff_until else None,
            "retry_in_s": round(slot.retry_at - now, 3) if slot.retry_at else None,
            "held": slot.held}


def _handle_row(handle, now: float) -> dict:
    probe = handle.probe
    info = handle.info
    return {
        "state": handle.state.value, "pid": handle.pid, "generation": handle.spec.generation,
        "device": info.get("device", handle.spec.device),
        "cores": info.get("cores", handle.spec.cores),
        "threads": info.get("threads", handle.spec.threads),
        "interop_threads": info.get("interop_threads"),
        "warmup": info.get("warmup"),
        "uptime_s": round(now - handle.started_at, 3),
        "ready_s": round(now - handle.ready_at, 3) if handle.ready_at else None,
        "requests": handle.served, "errors": handle.errors, "inflight": len(handle.inflight),
        "rss_bytes": read_rss(handle.pid) if handle.alive else None,
        "rss_trend_bytes_per_s": handle.rss_trend(),
        "cuda_bytes": handle.cuda_bytes, "latency_p50_us": handle.latency_p50_us(),
        "retiring": handle.retiring, "error": handle.failure, "backoff_s": None,
        "retry_in_s": None, "version": handle.spec.version,
        # [models.prepare]: the steps and how far the prepared answers were from the FP32 ones
        "prepare": info.get("prepare"),
        "probe": {"last_at": probe.last_at, "ok": probe.last_ok, "reason": probe.last_reason,
                  "consecutive_failures": probe.consecutive_failures, "drift": probe.drift,
                  "latency_us": probe.latency_us, "baseline_us": probe.baseline_us,
                  "cuda_bytes": probe.cuda_bytes},
    }


def limits_snapshot(arbiter: StatusView) -> dict[str, Any]:
    guard, router = arbiter.connections, arbiter.router
    return {"connections": guard.connections if guard else None,
            "max_connections": guard.high_water if guard else None,
            "listeners_paused": guard.paused if guard else False,
            "fd_limit": guard.fd_limit if guard else None,
            "fd_reserve": guard.reserve if guard else None,
            "open_fds": guard.open if guard else None,
            "request_bytes": router.request_bytes.total, "unread_reply_bytes": router.replies.total,
            "buffer_bytes": arbiter.registry.max_bytes,
            "per_identity": dataclasses.asdict(arbiter.quotas.shares)}
