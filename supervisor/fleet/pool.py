"""Pool policy for one model: its worker slots, restarts, backoff, FATAL, replacement, health.

The pool chooses; its host acts. Everything the pool needs from whoever runs it -- time, timers,
spawning, stopping and signalling workers, and the notifications it sends back -- is the
``PoolHost`` protocol below; the Arbiter is one, the unit tests' FakeHost another. Which request
goes to which worker is the router's business (it owns the queues and every request): the
pool only says which worker has room (``least_loaded``) and tells the host when one became READY.

A *slot* (supervisor/fleet/slot.py) is a place for one worker; each incarnation on it is a WorkerHandle.
The slot's state follows its current worker's while it has one, and is the policy's choice
between incarnations (shared/states.py describes both machines).

Restart policy on an exit of ``current``:
  * a failed start -- never READY, up less than ``start_seconds``, or an exit code saying the
    model cannot load -- counts; the next start waits ``backoff_initial * 2**(n-1)`` (capped);
  * after ``max_start_failures`` failed starts in a row the slot is FATAL;
  * any other exit (a crash after a good start) restarts at once and resets the count.

Probes: a worker failing ``probe.failures`` probes in a row is replaced; after
``probe.max_replacements`` such replacements with no worker passing ``probe.failures`` probes in a
row in between, the slot gives up instead: its worker drains and the slot goes FATAL (never an
endless loop of replacements while status says READY).

FATAL is not for ever: after ``fatal_retry`` seconds (0 = never) the slot tries once more, the
way Kubernetes' CrashLoopBackOff does, so a host recovers by itself from a transient fault; one
more failure (a failed start, or a streak of failed probes) makes it FATAL again for another
``fatal_retry``. A restart command revives it at once, with its counts reset.

Changes to the pool's shape (supervisor/fleet/reload.py drives them): ``scale`` adds slots (started at
once) or stops the last ones; ``stop_slot`` drains a slot's workers and keeps it STOPPED
(``held``) until a restart; ``reconfigure`` takes a new configuration, and the slots whose
workers it changes are rolled one at a time by ``roll_step`` (replace before retire). Stopped
slots that left the pool (scaled down) stay in ``leaving`` until their workers are gone.

Standbys (``standby = N``, supervisor/fleet/standby.py): whenever a slot needs a new incarnation -- its
worker died, was replaced (probes, drift, memory, ``max_requests``, a reload's roll, a restart
command) or its backoff ran out -- ``spawn`` promotes a warm standby into it when one is STANDBY
(it takes the slot's generation, cores and threads and goes READY in milliseconds), and only
spawns a process when none is. The restart policy is the same either way: a promoted worker that
dies within ``start_seconds`` of its promotion is a failed start of the slot.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import signal
import time
from typing import Callable, Protocol, runtime_checkable

from modelwarden.shared.config import ModelConfig, WorkerSpec
from modelwarden.shared.states import (BOOTING, STARTUP_FAILURES, IllegalTransition, SlotState,
                                       WorkerState, check_transition)
from modelwarden.supervisor.fleet.handle import WorkerHandle, exit_cause
from modelwarden.supervisor.fleet.placement import SlotPlacement
from modelwarden.supervisor.fleet.probes import ProbeJudge, Verdict
from modelwarden.supervisor.fleet.slot import Slot
from modelwarden.supervisor.fleet.standby import Standbys
from modelwarden.supervisor.routing import workers
from modelwarden.supervisor.timers import Timers

logger = logging.getLogger(__name__)
S = WorkerState
RSS_SAMPLE_EVERY = 1.0

StateListener = Callable[[WorkerHandle, WorkerState, WorkerState], None]


@runtime_checkable
class PoolHost(Protocol):
    """What a ModelPool needs from its host, and all of it (a unit test checks the pool uses
    nothing else). The host runs the loop; the pool never blocks, sends or signals by itself.

    * ``clock()``: monotonic seconds; ``timers``: the loop's deadline heap, run by the host.
    * ``stopping``: the daemon is shutting down: start nothing new.
    * ``worker_spec`` and ``launch``: build a worker's blueprint, then spawn it; ``launch``
      returns its handle, which calls ``on_state`` at each state change, and raises OSError when
      no process could be made.
    * ``send_stop``: tell an idle draining worker to exit; ``signal_worker``: send it a signal
      (SIGTERM, then SIGKILL past ``kill_grace``).
    * ``recover_requests``: the worker is gone or declared dead: retry or answer what it held.
    * ``on_worker_ready``: a worker of the pool became READY: queued requests can go.
    * ``on_slot_fatal``: a slot went FATAL, or a FATAL slot's last worker left (the host checks
      ``pool.all_fatal()`` and answers what nobody can serve).
    * ``standby_placement``: where a new standby of the pool sleeps, given the slot it is
      modelled on; ``send_promote``: tell a standby which slot it now is.
    """

    stopping: bool
    timers: Timers

    def clock(self) -> float: ...

    def worker_spec(self, config: ModelConfig, slot: int, generation: int,
                    placement: SlotPlacement) -> WorkerSpec: ...

    def launch(self, spec: WorkerSpec, on_state: StateListener) -> WorkerHandle: ...

    def send_stop(self, handle: WorkerHandle) -> None: ...

    def signal_worker(self, handle: WorkerHandle, signum: int) -> None: ...

    def recover_requests(self, pool: "ModelPool", handle: WorkerHandle) -> None: ...

    def on_worker_ready(self, pool: "ModelPool") -> None: ...

    def on_slot_fatal(self, pool: "ModelPool") -> None: ...

    def standby_placement(self, pool: "ModelPool", template: SlotPlacement) -> SlotPlacement: ...

    def send_promote(self, handle: WorkerHandle) -> None: ...


class ModelPool:
    def __init__(self, config: ModelConfig, placements: list[SlotPlacement], host: PoolHost,
                 judge: ProbeJudge) -> None:
        self.config = config
        self.host = host
        self.judge = judge
        self.slots = [Slot(index, placement, config.name)
                      for index, placement in enumerate(placements)]
        self.leaving: list[Slot] = []  # scaled down: draining, no longer counted or routed to
        self.standbys = Standbys(self)
        self.promotions = 0  # standbys promoted into a slot, since the pool was made
        # Per version, the outputs its READY workers learned from warm-up (worker/outputs.py):
        # what hello and KServe metadata list when the configuration declares none.
        self.learned_outputs: dict[str, list[dict]] = {}
        self._next_rss_sample = 0.0

    @property
    def name(self) -> str:
        return self.config.name

    # -- views ------------------------------------------------------------------------------

    def handles(self) -> list[WorkerHandle]:
        """Every worker process of the pool: the slots' and the standbys'."""
        return [handle for slot in (*self.slots, *self.leaving)
                for handle in slot.handles()] + self.standbys.handles

    def ready(self) -> list[WorkerHandle]:
        return [handle for handle in self.handles() if handle.state == S.READY]

    def least_loaded(self) -> WorkerHandle | None:
        """The READY worker with room and the fewest requests in flight; workers failing probes
        (or being replaced) last; ties to the most recently used (routing/workers.py)."""
        return workers.least_loaded(self.slots, self.config.max_inflight)

    def all_fatal(self) -> bool:
        """No slot serves or will start a worker by itself soon: each is FATAL or stopped."""
        return workers.serves_nothing(self.slots)

    def ready_count(self) -> int:
        """Slots serving now; a slot whose old worker serves while its replacement boots counts."""
        return sum(1 for slot in self.slots if any(h.state == S.READY for h in slot.handles()))

    # -- starting ---------------------------------------------------------------------------

    def start_all(self) -> None:
        for slot in self.slots:
            self.spawn(slot)
        self.standbys.fill()

    def spawn(self, slot: Slot) -> WorkerHandle | None:
        if self.host.stopping:
            return None
        self.host.timers.cancel(slot.backoff_timer)
        slot.backoff_timer = slot.backoff_until = None
        slot.generation += 1
        standby = self.standbys.take(slot)
        if standby is not None:
            return self._promote(slot, standby)
        spec = self.host.worker_spec(self.config, slot.index, slot.generation, slot.placement)
        try:
            handle = self.host.launch(spec, self._on_state)
            handle.pool = self
        except OSError as exc:  # no process at all (EAGAIN, ENOMEM, EMFILE): a failed start
            logger.critical("%s#%d: cannot spawn a worker: %s", self.name, slot.index, exc)
            slot.set_state(SlotState.STARTING, "spawning")
            slot.set_state(SlotState.DEAD, f"spawn failed: {exc}")
            self._after_exit(slot, True, f"spawn failed: {exc}")
            return None
        slot.current = handle
        slot.set_state(SlotState.STARTING, f"pid {handle.pid}, generation {slot.generation}")
        self._limit_requests(handle)
        return handle

    def _limit_requests(self, handle: WorkerHandle) -> None:
        if self.config.max_requests:
            handle.request_limit = self.config.max_requests + random.randint(
                0, self.config.max_requests_jitter)

    def _promote(self, slot: Slot, handle: WorkerHandle) -> WorkerHandle:
        """A warm standby becomes the slot's current worker: the slot's identity, cores and
        threads; it goes READY when it says it has re-pinned. Another standby starts."""
        placement = slot.placement
        was = handle.worker_id
        handle.spec = dataclasses.replace(handle.spec, slot=slot.index, generation=slot.generation,
                                          cores=list(placement.cores), threads=placement.threads,
                                          standby=None)
        handle.promoted_at = self.host.clock()
        slot.current = handle
        slot.promotions += 1
        slot.promoted_at = time.time()
        self.promotions += 1
        slot.set_state(SlotState.STARTING, f"promoting standby {was} pid {handle.pid}, "
                       f"generation {slot.generation}")
        self.host.send_promote(handle)
        self._limit_requests(handle)
        return handle  # the next standby starts once this one is READY: no spawn competes now

    def slot_of(self, handle: WorkerHandle) -> Slot:
        """The slot ``handle`` serves (never asked of a standby: it has none)."""
        index = handle.spec.slot
        if index < len(self.slots) and handle in (self.slots[index].current, self.slots[index].previous):
            return self.slots[index]
        for slot in self.leaving:  # a scaled-down slot; its index may be in use again
            if handle in (slot.current, slot.previous):
                return slot
        return self.slots[index]

    def on_worker_failed(self, handle: WorkerHandle, stage: str, message: str) -> None:
        """A worker said why it could not start; its slot keeps the reason for ``status``."""
        handle.failure = f"{stage}: {message}"
        if not self.standbys.owns(handle):  # a standby has no slot to blame
            self.slot_of(handle).failure = handle.failure

    def slot_versions(self) -> set[str]:
        """The versions the slots' workers run (a leaving standby is no roll)."""
        return {handle.spec.version for handle in self.handles() if not self.standbys.owns(handle)}

    def standby_cores(self) -> set[int]:
        return {core for handle in self.standbys.live() for core in handle.spec.cores}

    def on_worker_state(self, handle: WorkerHandle, state: str, info: dict) -> None:
        """A worker reported LOADING/WARMING/READY."""
        try:
            new = WorkerState(state)
        except ValueError:
            logger.error("%s reported an unknown state %r", handle.worker_id, state)
            return
        if not handle.alive or new not in (S.LOADING, S.WARMING, S.STANDBY, S.READY) or new == handle.state:
            return
        if (new == S.STANDBY) != self.standbys.owns(handle) and new in (S.STANDBY, S.READY):
            # READY from a standby not promoted, or STANDBY from a slot's worker: out of turn
            logger.error("%s: reported %s out of turn; ignored", handle.worker_id, new.value)
            return
        try:
            check_transition(handle.state, new)
        except IllegalTransition as exc:  # an out-of-order report: log it, keep the daemon up
            logger.error("%s: %s", handle.worker_id, exc)
            return
        reference = info.pop("reference", None)  # a golden, not something to show in status
        handle.info.update({key: value for key, value in info.items() if value is not None})
        if new == S.READY:
            self._learn_from_ready(handle, info, reference)
        if new == S.STANDBY:
            handle.ready_at = self.host.clock()  # warm since: a standby dying soon after failed
        if new == S.READY:
            handle.ready_at = self.host.clock()
            handle.probe.baseline_us = info.get("probe_baseline_us")
            handle.probe.due_at = handle.ready_at  # check it (or record golden) straight away
        handle.set_state(new)

    def _learn_from_ready(self, handle: WorkerHandle, info: dict, reference: object) -> None:
        """What a READY worker reports for its whole version: its outputs, and the FP32 answers
        a prepared worker was held to (the version's probe golden, supervisor/fleet/probes.py)."""
        version = handle.spec.version
        outputs = info.get("outputs")
        if isinstance(outputs, list) and all(_is_output_spec(item) for item in outputs):
            self.learned_outputs[version] = outputs
        if reference is not None and self.judge.adopt_reference(version, reference):
            logger.info("%s: the FP32 answers it was prepared against are version %s's golden",
                        handle.worker_id, version)

    def outputs_of(self, version: str) -> tuple[list[dict], bool]:
        """(the outputs hello lists, whether the configuration declared them)."""
        if self.config.outputs:
            return [spec.model_dump() for spec in self.config.outputs], True
        return self.learned_outputs.get(version, []), False

    def _on_state(self, handle: WorkerHandle, old: WorkerState, new: WorkerState) -> None:
        if self.standbys.owns(handle):
            return  # slotless: no slot follows it, no request waits for it
        slot = self.slot_of(handle)
        if handle is slot.current:
            slot.follow(new)
        if new != S.READY:
            return
        if slot.previous is not None and slot.previous.state == S.READY:
            self.drain(slot.previous, f"replaced by generation {handle.spec.generation}")
        self.host.on_worker_ready(self)
        if handle.promoted_at is not None:
            self.standbys.fill()

    # -- stopping ---------------------------------------------------------------------------

    def drain(self, handle: WorkerHandle, reason: str) -> None:
        handle.set_state(S.DRAINING, reason)
        handle.drain_deadline = self.host.clock() + self.config.drain_timeout
        self.stop_if_idle(handle)

    def stop_if_idle(self, handle: WorkerHandle) -> None:
        if handle.state == S.DRAINING and not handle.inflight and not handle.stop_sent:
            handle.stop_sent = True
            self.host.send_stop(handle)
            self.terminate_later(handle)

    def terminate(self, handle: WorkerHandle, reason: str) -> None:
        """SIGTERM now, SIGKILL after ``kill_grace`` if it is still there."""
        if handle.alive:
            handle.set_state(S.DEAD, reason)
        self.host.recover_requests(self, handle)
        self.host.signal_worker(handle, signal.SIGTERM)
        self.host.timers.cancel(handle.kill_timer)
        handle.kill_timer = self.host.timers.call_at(
            self.host.clock() + self.config.kill_grace, self.host.signal_worker, handle,
            signal.SIGKILL)

    def terminate_later(self, handle: WorkerHandle) -> None:
        """After a stop message: kill it if it has not left within ``kill_grace``."""
        self.host.timers.cancel(handle.kill_timer)
        handle.kill_timer = self.host.timers.call_at(
            self.host.clock() + self.config.kill_grace, self._overdue, handle)

    def _overdue(self, handle: WorkerHandle) -> None:
        if handle.exitcode is None:
            logger.critical("%s pid %s did not stop when asked; killing", handle.worker_id, handle.pid)
            self.host.signal_worker(handle, signal.SIGKILL)

    def mark_exited(self, handle: WorkerHandle) -> None:
        """The process is gone: STOPPED if it left cleanly when told, else DEAD. Nothing is
        routed to it from now on."""
        cause = exit_cause(handle.exitcode)
        self.host.timers.cancel(handle.kill_timer)
        if handle.state == S.DRAINING and handle.exitcode == 0:
            handle.set_state(S.STOPPED, cause)
        elif handle.alive:
            handle.set_state(S.DEAD, cause)

    def on_exit(self, handle: WorkerHandle) -> None:
        """The process is gone (reaped, and marked): recover its requests, then restart."""
        self.mark_exited(handle)  # a no-op when the host marked it already
        cause = exit_cause(handle.exitcode)
        self.host.recover_requests(self, handle)
        if self.standbys.owns(handle):
            self.standbys.on_exit(handle)
            return
        slot = self.slot_of(handle)
        if handle is slot.previous:
            slot.previous = None
            self._forget_if_gone(slot)
            self.host.on_slot_fatal(self)  # its replacement may have gone FATAL meanwhile
            return
        if handle is not slot.current:
            return
        slot.current = None
        slot.last_exit = cause
        slot.failure = handle.failure or slot.failure
        # The slot followed its worker to DEAD or STOPPED when the exit was marked.
        if slot.fatal_on_exit is not None:
            self._go_fatal(slot, slot.fatal_on_exit)
        elif self.host.stopping or slot.held:
            slot.set_state(SlotState.STOPPED, slot.held or "stopped")
            self._forget_if_gone(slot)
            self.host.on_slot_fatal(self)  # a stopped model answers what waits for it
        elif handle.state == S.STOPPED:  # drained as told, then released by a reload: no failure
            self.spawn(slot)
        else:
            self._restart(slot, handle, cause)

    def _restart(self, slot: Slot, handle: WorkerHandle, cause: str) -> None:
        now = self.host.clock()
        # A promoted standby's start, for the crash-loop rules, is its promotion.
        started = max(handle.started_at, handle.promoted_at or 0.0)
        failed_start = (handle.ready_at is None or now - started < self.config.start_seconds
                        or handle.exitcode in STARTUP_FAILURES)
        self._after_exit(slot, failed_start, cause)

    def _after_exit(self, slot: Slot, failed_start: bool, cause: str) -> None:
        """Restart now, back off, or give up (FATAL), by the count of failed starts in a row."""
        now = self.host.clock()
        slot.start_failures = slot.start_failures + 1 if failed_start else 0
        slot.restarts += 1
        slot.causes.append((time.time(), cause))
        if slot.start_failures >= self.config.max_start_failures:
            self._go_fatal(slot, f"{slot.start_failures} failed starts in a row, "
                           f"last: {cause}{'; ' + slot.failure if slot.failure else ''}")
            return
        if not slot.start_failures:
            self.spawn(slot)
            return
        delay = min(self.config.backoff_initial * 2 ** (slot.start_failures - 1),
                    self.config.backoff_max)
        slot.set_state(SlotState.BACKOFF, f"failed start {slot.start_failures}, retry in {delay:.1f}s")
        slot.backoff_until = now + delay
        slot.backoff_timer = self.host.timers.call_at(now + delay, self.spawn, slot)

    def _go_fatal(self, slot: Slot, reason: str) -> None:
        slot.fatal_on_exit = None
        retry = self.config.fatal_retry
        slot.set_state(SlotState.FATAL, reason + (f"; next try in {retry:.0f}s" if retry else ""))
        if retry and not self.host.stopping:
            slot.retry_at = self.host.clock() + retry
            slot.retry_timer = self.host.timers.call_at(slot.retry_at, self._retry_fatal, slot)
        self.host.on_slot_fatal(self)

    def _retry_fatal(self, slot: Slot) -> None:
        """``fatal_retry`` passed: one more try. One more failure makes it FATAL again."""
        slot.retry_timer = slot.retry_at = None
        if slot.state != SlotState.FATAL or slot.handles() or slot.held or slot not in self.slots:
            return
        logger.warning("slot %s: FATAL for %.0fs; trying again (fatal_retry)", slot.name,
                       self.config.fatal_retry)
        slot.start_failures = self.config.max_start_failures - 1
        slot.probe_replacements = self.config.probe.max_replacements
        self.spawn(slot)

    def _cancel_retry(self, slot: Slot) -> None:
        self.host.timers.cancel(slot.retry_timer)
        slot.retry_timer = slot.retry_at = None

    # -- replacement ------------------------------------------------------------------------

    def replace(self, handle: WorkerHandle, reason: str) -> bool:
        """Start a replacement; the old worker serves on until it is READY, then drains."""
        slot = self.slot_of(handle)
        if (handle is not slot.current or handle.state != S.READY or handle.retiring
                or slot.previous is not None or slot.held or self.host.stopping):
            return False
        logger.warning("%s pid %s: replacing (%s)", handle.worker_id, handle.pid, reason)
        handle.retiring = reason
        slot.previous, slot.current = handle, None
        slot.probe_passes = 0
        slot.causes.append((time.time(), f"replaced: {reason}"))
        slot.restarts += 1
        self.spawn(slot)
        return True

    def restart(self, only: int | None = None) -> list[str]:
        """Operator restart: revive FATAL/stopped slots now; replace live workers (replace before
        retire). ``only`` limits it to one slot."""
        touched = []
        for slot in self.slots if only is None else [self.slots[only]]:
            slot.probe_replacements = 0
            if slot.current is None:
                self._cancel_retry(slot)
                slot.start_failures = 0
                slot.failure = slot.held = slot.fatal_on_exit = None
                self.spawn(slot)
                touched.append(f"{self.name}#{slot.index}")
            elif slot.current.state == S.READY and self.replace(slot.current, "restart command"):
                touched.append(f"{self.name}#{slot.index}")
        return touched

    # -- health -----------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        sample_rss = now >= self._next_rss_sample
        if sample_rss:
            self._next_rss_sample = now + RSS_SAMPLE_EVERY
        for handle in self.handles():
            self._check(handle, now, sample_rss)
        self.standbys.fill()  # one promoted that never went READY, a count changed by reload

    def _check(self, handle: WorkerHandle, now: float, sample_rss: bool) -> None:
        config = self.config
        if handle.state in BOOTING and now - handle.started_at > config.start_timeout:
            logger.critical("%s pid %s: not READY after %.0fs; killing", handle.worker_id,
                            handle.pid, config.start_timeout)
            self.terminate(handle, "start timeout")
        elif (handle.state in (S.READY, S.DRAINING, S.STANDBY)
              and now - handle.last_seen > config.heartbeat_timeout):
            logger.critical("%s pid %s: no heartbeat for %.1fs; killing as hung", handle.worker_id,
                            handle.pid, now - handle.last_seen)
            self.terminate(handle, "hung")
        elif handle.state == S.DRAINING and handle.drain_deadline and now > handle.drain_deadline:
            self.terminate(handle, "drain timeout")
        elif handle.state == S.READY:
            self._check_probe_timeout(handle, now)
            if sample_rss:
                self._check_memory(handle, now)
        elif handle.state == S.STANDBY and sample_rss:
            handle.sample_rss(now)  # shown in status; max_rss applies once it serves

    def _check_probe_timeout(self, handle: WorkerHandle, now: float) -> None:
        probe = handle.probe
        timeout = self.config.probe.timeout
        if probe.timed_out(now, timeout):
            self.record_probe(handle, Verdict(False, f"no answer in {timeout}s"))
        if probe.unanswered and not handle.retiring:
            # The worker still holds the probe, so no later probe can reach it to make up the
            # `failures` count: an unanswered probe means a stuck worker. Replace it now, or at
            # the first tick the slot can take a replacement (its previous worker may still be
            # draining).
            self._replace_for_probes(handle, f"probe unanswered for {timeout}s")

    def _check_memory(self, handle: WorkerHandle, now: float) -> None:
        rss = handle.sample_rss(now)
        if self.config.max_rss and rss and rss > self.config.max_rss:
            self.replace(handle, f"rss {rss} > max_rss {self.config.max_rss}")
        cuda = handle.cuda_bytes
        if self.config.max_cuda_memory and cuda and cuda > self.config.max_cuda_memory:
            self.replace(handle, f"cuda memory {cuda} > max_cuda_memory {self.config.max_cuda_memory}")

    def after_result(self, handle: WorkerHandle) -> None:
        """After each result: a worker past ``max_requests`` is replaced, a draining one that
        holds nothing more stops. The router skips the call when neither can apply
        (routing/workers.needs_the_pool)."""
        if handle.request_limit and handle.served >= handle.request_limit:
            self.replace(handle, f"served {handle.served} requests (max_requests)")
        self.stop_if_idle(handle)

    def probe_due(self, handle: WorkerHandle, now: float) -> bool:
        return self.config.probes_enabled and workers.probe_due(handle, now)

    def record_probe(self, handle: WorkerHandle, verdict: Verdict) -> None:
        probe = handle.probe
        probe.last_at, probe.last_ok, probe.last_reason = time.time(), verdict.ok, verdict.reason
        if verdict.drift is not None:
            probe.drift = verdict.drift
        probe.due_at = self.host.clock() + self.config.probe.interval
        slot = self.slot_of(handle)
        if verdict.ok:
            probe.consecutive_failures = 0
            if handle is slot.current:
                slot.probe_passes += 1
                if slot.probe_passes >= self.config.probe.failures:
                    slot.probe_replacements = 0  # a worker proved healthy: the streak is over
            return
        probe.consecutive_failures += 1
        probe.failures += 1
        if handle is slot.current:
            slot.probe_passes = 0
        logger.warning("%s pid %s: probe failed (%d in a row): %s", handle.worker_id, handle.pid,
                       probe.consecutive_failures, verdict.reason)
        if probe.consecutive_failures >= self.config.probe.failures:
            self._replace_for_probes(
                handle, f"{probe.consecutive_failures} failed probes: {verdict.reason}")

    def _replace_for_probes(self, handle: WorkerHandle, reason: str) -> None:
        """Replace a worker failing its probes, or give its slot up once replacing has not
        helped ``probe.max_replacements`` times: drain the worker, then FATAL."""
        slot = self.slot_of(handle)
        if handle is not slot.current or handle.retiring or self.host.stopping:
            return
        limit = self.config.probe.max_replacements
        if slot.probe_replacements < limit:
            if self.replace(handle, reason):
                slot.probe_replacements += 1
            return
        verdict = (f"{reason}; gave up after {limit} replacement(s) for failed probes "
                   f"(version {handle.spec.version or '?'})")
        logger.critical("%s pid %s: %s", handle.worker_id, handle.pid, verdict)
        handle.retiring = slot.fatal_on_exit = verdict
        self._stop_handle(handle, verdict)

    # -- shape: stop, scale, reconfigure, roll ---------------------------------------------

    def _stop_handle(self, handle: WorkerHandle, reason: str) -> None:
        if handle.state == S.READY:
            self.drain(handle, reason)
        elif handle.alive and handle.state != S.DRAINING:
            self.terminate(handle, reason)  # still booting: it holds no request

    def stop_slot(self, slot: Slot, reason: str) -> None:
        """Drain the slot's workers and keep it STOPPED (no restart) until a restart command."""
        slot.held = reason
        self.host.timers.cancel(slot.backoff_timer)
        slot.backoff_timer = slot.backoff_until = None
        self._cancel_retry(slot)
        for handle in slot.handles():
            self._stop_handle(handle, reason)
        if not slot.handles() and slot.state != SlotState.STOPPED:
            slot.set_state(SlotState.STOPPED, reason)
        self.host.on_slot_fatal(self)

    def stop(self, only: int | None = None, reason: str = "stop command") -> list[str]:
        """Operator stop of every slot or one: drained, then STOPPED until a restart."""
        stopped = []
        for slot in self.slots if only is None else [self.slots[only]]:
            if slot.held is None:
                self.stop_slot(slot, reason)
                stopped.append(slot.name)
        return stopped

    def shut_down(self) -> None:
        """The daemon is stopping: standbys stop, no slot restarts, READY workers drain."""
        self.standbys.stop_all("shutdown")
        for slot in self.slots:
            self.host.timers.cancel(slot.backoff_timer)
        for handle in self.handles():
            if handle.state == S.READY:
                self.drain(handle, "shutdown")
            elif handle.alive and handle.state != S.DRAINING:
                self.terminate(handle, "shutdown")

    def retire(self, reason: str) -> None:
        """The model was removed: no worker of it starts again (a crash stays down, nothing is
        replaced), while the ones serving finish its queue; ``scale([])`` then stops them."""
        for slot in self.slots:
            slot.held = reason
        self.standbys.stop_all(reason)

    def release(self) -> list[str]:
        """A reload re-read the file: slots stopped by a command serve again (a slot still
        draining restarts once its worker has left)."""
        released = []
        for slot in self.slots:
            if slot.held is None:
                continue
            slot.held = None
            released.append(slot.name)
            if not slot.handles():
                slot.start_failures = slot.probe_replacements = 0
                self.spawn(slot)
        return released

    def scale(self, placements: list[SlotPlacement], reason: str) -> None:
        """As many slots as ``placements``: new ones start now, surplus ones stop (the last
        first) and leave; a kept slot whose placement changed is rolled."""
        count = len(placements)
        for slot in self.slots[count:]:
            self.stop_slot(slot, reason)
            self.leaving.append(slot)
            self._forget_if_gone(slot)
        del self.slots[count:]
        for slot, placement in zip(self.slots, placements):
            if slot.placement != placement:
                slot.placement = placement
                slot.stale_through = slot.generation
        for index in range(len(self.slots), count):
            slot = Slot(index, placements[index], self.name)
            self.slots.append(slot)
            self.spawn(slot)

    def reconfigure(self, config: ModelConfig, judge: ProbeJudge, roll: bool,
                    version: str | None = None) -> None:
        """A new configuration. With ``roll`` every worker runs a superseded one; else only the
        workers whose version is not ``version`` do. Those are rolled (``roll_step``); for the
        others it only changes the supervisor's policy, which applies now."""
        self.config = config
        self.judge = judge
        for slot in self.slots:
            current = slot.current
            if roll or (version is not None and current is not None
                        and current.spec.version != version):
                slot.stale_through = slot.generation
        for handle in list(self.standbys.handles):
            if roll or (version is not None and handle.spec.version != version):
                self.standbys.let_go(handle, "reload: superseded version or configuration")
        self.standbys.fill()

    def roll_step(self) -> None:
        """Replace the next stale worker, one slot at a time: none while a replacement is under
        way (or a replacement that cannot start keeps its predecessor serving: the roll stops
        there rather than take every slot down with a bad version)."""
        if self.host.stopping or any(slot.previous is not None for slot in self.slots):
            return
        for slot in self.slots:
            if not slot.runs_stale():
                continue
            if slot.current.state == S.READY:
                self.replace(slot.current, "reload: new configuration")
            return  # one at a time; a stale worker still booting is replaced once READY

    def rolling(self) -> bool:
        return any(slot.runs_stale() or slot.previous is not None for slot in self.slots)

    def _forget_if_gone(self, slot: Slot) -> None:
        if slot in self.leaving and not slot.handles():
            self.leaving.remove(slot)


def _is_output_spec(item: object) -> bool:
    """One learned output as the worker reports it: checked, never trusted."""
    return (isinstance(item, dict) and isinstance(item.get("name"), str)
            and isinstance(item.get("dtype"), str) and isinstance(item.get("shape"), list)
            and all(isinstance(dim, int) for dim in item["shape"]))
