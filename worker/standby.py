"""A standby worker's wait, and its promotion into a slot.

Contract. A worker spawned with ``spec.standby`` set does everything a worker does before serving
-- pinned, torch imported, thread counts set, model loaded, warmed up, probe baseline taken --
then reports STANDBY and waits here. While it waits it beats (from this loop, as a serving worker
does: a hung standby is caught the same way), leaves when the supervisor is gone, and exits 0 on
``stop``. It is never sent a request.

On ``{"type": "promote", "slot": I, "generation": G, "cores": [...], "threads": T}`` it
re-pins every thread of the process (``/proc/self/task``) to the slot's cores, sets torch's
intra-op thread count to T, and takes the slot's identity (worker id in its log lines, process
title and reply headers); the caller then reports READY and serves. The supervisor spawns a
standby with the thread count of the slots it may replace, so the OpenMP pool was sized before
its first parallel region and ``set_num_threads`` here does not resize it (docs/ARCHITECTURE.md,
"Standby workers", says what re-pinning can and cannot guarantee). A promotion whose cores
cannot be applied is a boot error (exit 3): the slot's crash-loop rules take it from there.

A standby boots in the background: before its first thread exists it lowers its CPU priority
(nice ``STANDBY_NICE``), so that on a busy host its import, load and warm-up take the CPU the
serving workers leave, and on promotion it restores its priority on every thread. It does so
only when it will be allowed to restore it (CAP_SYS_NICE, or an RLIMIT_NICE that reaches back):
an unprivileged process can lower its priority but never raise it again, and a promoted worker
left at a low priority would serve slowly for ever.
"""

from __future__ import annotations

import logging
import os
import threading
import time


from modelwarden.shared import protocol
from modelwarden.shared.config import WorkerSpec
from modelwarden.shared.logs import setup_logging
from modelwarden.shared.protocol import ProtocolError
from modelwarden.shared.sockets import Poller
from modelwarden.shared.states import EXIT_BOOT_ERROR, EXIT_OK, EXIT_ORPHANED
from modelwarden.worker.pinning import PlacementError

logger = logging.getLogger(__name__)
STANDBY_NICE = 10  # a nice-0 task gets ~10x the CPU of a nice-10 one when both want it
CAP_SYS_NICE = 23
_restore_nice: int | None = None  # the priority to restore on promotion, once lowered


def boot_in_the_background() -> bool:
    """Lower this process's CPU priority for its boot if it can be restored; True if lowered."""
    global _restore_nice
    current = os.getpriority(os.PRIO_PROCESS, 0)
    if not _may_raise_priority_to(current):
        logger.info("standby boots at normal priority: it could not restore it when promoted "
                    "(no CAP_SYS_NICE, RLIMIT_NICE below %d)", 20 - current)
        return False
    os.setpriority(os.PRIO_PROCESS, 0, min(19, current + STANDBY_NICE))
    _restore_nice = current
    return True


def _may_raise_priority_to(nice: int) -> bool:
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    if soft == resource.RLIM_INFINITY or soft >= 20 - nice:
        return True
    try:
        with open("/proc/self/status") as status:
            line = next(l for l in status if l.startswith("CapEff:"))
    except (OSError, StopIteration):
        return False
    return bool(int(line.split()[1], 16) >> CAP_SYS_NICE & 1)


def wait_for_promotion(spec: WorkerSpec, link, parent_sentinel: int | None) -> int | None:
    """Wait slotless until promoted (returns None, ``spec`` now the slot's) or told to leave
    (returns the exit code)."""
    poller = Poller()
    poller.register(link.fd)
    if parent_sentinel is not None:
        poller.register(parent_sentinel)
    next_beat = time.monotonic()
    while True:
        ready = poller.poll(max(0.0, next_beat - time.monotonic()) * 1000)
        if parent_sentinel is not None and parent_sentinel in ready:
            logger.error("supervisor is gone; leaving")
            return EXIT_ORPHANED
        if link.fd in ready:
            for frames in link.receive():
                code = _on_message(spec, link, frames)
                if code != "wait":
                    return code
            if link.gone:
                logger.error("the supervisor closed our link; leaving")
                return EXIT_ORPHANED
        if time.monotonic() >= next_beat:
            link.send({"type": protocol.HEARTBEAT})
            next_beat = time.monotonic() + spec.heartbeat_interval


def _on_message(spec: WorkerSpec, link, frames: list) -> int | None | str:
    try:
        header = protocol.unpack_header(frames[0], strict=False)
    except ProtocolError as exc:
        logger.error("dropping a malformed message from the supervisor: %s", exc.message)
        return "wait"
    kind = header.get("type")
    if kind == protocol.STOP:
        logger.info("standby: stopping as asked")
        return EXIT_OK
    if kind != protocol.PROMOTE:
        logger.error("standby: dropping a message of type %r (a standby serves nothing)", kind)
        return "wait"
    try:
        promote(spec, header)
    except PlacementError as exc:
        logger.error("promotion failed: %s", exc)
        link.failed("boot", f"promotion failed: {exc}")
        return EXIT_BOOT_ERROR
    return None


def promote(spec: WorkerSpec, header: dict) -> None:
    """Take the slot ``header`` names: its cores for every thread, its thread count, its id."""
    import torch

    cores, threads = header.get("cores"), header.get("threads")
    slot, generation = header.get("slot"), header.get("generation")
    if (not isinstance(cores, list) or not cores or not all(isinstance(c, int) for c in cores)
            or not isinstance(threads, int) or not 1 <= threads <= len(cores)
            or not isinstance(slot, int) or not isinstance(generation, int)):
        raise PlacementError(f"bad promotion: slot {slot!r}, generation {generation!r}, "
                             f"cores {cores!r}, threads {threads!r}")
    was = spec.worker_id
    moved = repin_every_thread(cores)
    torch.set_num_threads(threads)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # for any pool created from now on
        os.environ[name] = str(threads)
    spec.slot, spec.generation = slot, generation
    spec.cores, spec.threads, spec.standby = sorted(cores), threads, None
    setup_logging(spec.worker_id, spec.log_level, spec.log_format)
    _retitle(spec)
    logger.info("promoted from %s: %d thread(s) re-pinned to %s, %d intra-op thread(s)",
                was, moved, spec.placement, threads)


def repin_every_thread(cores: list[int]) -> int:
    """Every thread of this process on ``cores``; returns how many were moved.

    The calling thread first, so a thread it creates from now on inherits the new mask; then every
    task listed in /proc/self/task, again until a pass finds no thread it has not moved (a thread
    another thread created meanwhile)."""
    wanted = set(cores)
    try:
        _move(0, wanted)
    except OSError as exc:
        raise PlacementError(f"cannot pin to cores {sorted(wanted)}: {exc}") from None
    moved: set[int] = {threading.get_native_id()}
    while True:
        fresh = {int(tid) for tid in os.listdir("/proc/self/task")} - moved
        if not fresh:
            return len(moved)
        for tid in fresh:
            try:
                _move(tid, wanted)
            except ProcessLookupError:
                pass  # it exited between the listing and now
            moved.add(tid)


def _move(tid: int, cores: set[int]) -> None:
    """One thread onto ``cores``, at the priority it had before its background boot."""
    os.sched_setaffinity(tid, cores)
    if _restore_nice is not None:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, _restore_nice)  # per thread on Linux
        except PermissionError:  # the limit changed under us: serve, slower, and say so
            logger.warning("thread %d: cannot restore CPU priority %d", tid, _restore_nice)


def _retitle(spec: WorkerSpec) -> None:
    try:
        import setproctitle

        setproctitle.setproctitle(f"modelwarden: worker {spec.worker_id} {spec.placement}")
    except ImportError:
        pass
