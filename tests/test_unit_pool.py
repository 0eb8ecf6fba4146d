"""Unit tests of supervisor/fleet/pool.py's restart policy, replacement and routing, and of the slot's
and the worker's state machines (shared/states.py, supervisor/fleet/slot.py), against FakeHost: an
implementation of the pool's ``PoolHost`` protocol (no processes, no sockets; a fake clock drives
real Timers).

Safety: the pool signals workers only through its host, which here records the signal and sends
none; the fake pids also lie far above any pid_max, so even a stray os.kill would find no process.
"""

from __future__ import annotations

import ast
import itertools
import logging
import signal
from pathlib import Path

import pytest

from modelwarden.shared.config import ModelConfig, WorkerSpec
from modelwarden.shared.states import (EXIT_LOAD_ERROR, EXIT_OK, EXIT_WARMUP_ERROR,
                                       SLOT_FOLLOWS, SLOT_TRANSITIONS, WORKER_TRANSITIONS,
                                       IllegalTransition, SlotState, check_transition)
from modelwarden.shared.states import WorkerState as S
from modelwarden.supervisor.fleet import pool as pool_module
from modelwarden.supervisor.fleet import standby as standby_module
from modelwarden.supervisor.fleet.handle import WorkerHandle
from modelwarden.supervisor.fleet.placement import SlotPlacement
from modelwarden.supervisor.fleet.pool import ModelPool, PoolHost
from modelwarden.supervisor.fleet.probes import ProbeJudge, Verdict
from modelwarden.supervisor.timers import Timers

SIGKILLED = -9
SIGSEGV = -11
NEVER = 1e9  # kill_grace / drain_timeout: no kill timer ever comes due in these tests


class FakeProcess:
    """Stands in for multiprocessing.Process; nothing in the pool touches it."""

    def __init__(self, pid: int) -> None:
        self.pid = pid


class FakeHost:
    """A PoolHost (what ModelPool needs from the Arbiter), recording every call."""

    def __init__(self) -> None:
        self.stopping = False
        self.timers = Timers()
        self.now = 1000.0
        self.launched: list[WorkerHandle] = []
        self.dispatched: list[ModelPool] = []  # on_worker_ready notices
        self.stopped: list[WorkerHandle] = []
        self.signals: list[tuple[WorkerHandle, int]] = []
        self.recovered: list[WorkerHandle] = []
        self.fatal: list[bool] = []  # pool.all_fatal() at each on_slot_fatal call
        self.promoted: list[WorkerHandle] = []  # send_promote calls
        self._pids = itertools.count(2_000_000_000)  # > any pid_max (at most 2**22)

    def clock(self) -> float:
        return self.now

    def advance(self, seconds: float) -> int:
        self.now += seconds
        return self.timers.run_due(self.now)

    def worker_spec(self, config, slot, generation, placement) -> WorkerSpec:
        return WorkerSpec(model=config, slot=slot, generation=generation, cores=placement.cores,
                          threads=placement.threads, device=placement.device,
                          supervisor_pid=1,
                          base_dir="/nonexistent")

    def launch(self, spec: WorkerSpec, on_state) -> WorkerHandle:
        pid = next(self._pids)
        handle = WorkerHandle(spec, FakeProcess(pid), pid, sentinel=pid, started_at=self.now,
                              on_state=on_state, last_seen=self.now)
        self.launched.append(handle)
        return handle

    def on_worker_ready(self, pool: ModelPool) -> None:
        self.dispatched.append(pool)

    def send_stop(self, handle: WorkerHandle) -> None:
        self.stopped.append(handle)

    def signal_worker(self, handle: WorkerHandle, signum: int) -> None:
        self.signals.append((handle, signum))

    def recover_requests(self, pool: ModelPool, handle: WorkerHandle) -> None:
        self.recovered.append(handle)
        handle.inflight.clear()

    def on_slot_fatal(self, pool: ModelPool) -> None:
        self.fatal.append(pool.all_fatal())

    def standby_placement(self, pool: ModelPool, template: SlotPlacement) -> SlotPlacement:
        return SlotPlacement([99], template.threads, template.device)  # a spare core

    def send_promote(self, handle: WorkerHandle) -> None:
        self.promoted.append(handle)


_: PoolHost = FakeHost()  # a type checker holds the fake to the protocol; isinstance below


def make_pool(host: FakeHost, workers: int = 1, **overrides) -> ModelPool:
    fields = dict(name="m", source="python:pkg.mod:build", warmup=0, workers=workers,
                  kill_grace=NEVER, drain_timeout=NEVER, start_seconds=10.0,
                  max_start_failures=5, backoff_initial=0.5, backoff_max=30.0)
    fields.update(overrides)
    config = ModelConfig(**fields)
    placements = [SlotPlacement([index], 1, "cpu") for index in range(workers)]
    return ModelPool(config, placements, host, ProbeJudge(config.probe))


def assert_slots_follow(pool: ModelPool) -> None:
    """The invariant between the two machines: a slot with a current worker is in the state
    that worker's state maps to."""
    for slot in pool.slots:
        assert type(slot.state) is SlotState  # str enums: "READY" would equal either machine's
        if slot.current is not None:
            assert slot.state == SLOT_FOLLOWS[slot.current.state], (slot.state, slot.current.state)


def ready(pool: ModelPool, handle: WorkerHandle) -> None:
    for state in ("LOADING", "WARMING", "READY"):
        pool.on_worker_state(handle, state, {})
        assert_slots_follow(pool)
    assert handle.state == S.READY


def exit_with(pool: ModelPool, handle: WorkerHandle, code: int) -> None:
    handle.exitcode = code
    pool.on_exit(handle)
    assert_slots_follow(pool)


@pytest.fixture
def host() -> FakeHost:
    return FakeHost()


# -- starting -----------------------------------------------------------------------------------


def test_start_all_launches_one_worker_per_slot(host):
    pool = make_pool(host, workers=3)
    pool.start_all()
    assert len(host.launched) == 3
    assert [h.spec.slot for h in host.launched] == [0, 1, 2]
    assert [h.spec.cores for h in host.launched] == [[0], [1], [2]]
    assert all(slot.state == SlotState.STARTING and slot.generation == 1 for slot in pool.slots)
    assert pool.ready() == [] and pool.least_loaded() is None


def test_ready_report_makes_a_worker_serve_and_dispatches(host):
    pool = make_pool(host)
    pool.start_all()
    handle = host.launched[0]
    pool.on_worker_state(handle, "LOADING", {"pid": 5})
    pool.on_worker_state(handle, "WARMING", {})
    assert pool.ready() == [] and host.dispatched == []
    host.now += 3
    pool.on_worker_state(handle, "READY", {"threads": 1, "probe_baseline_us": 250})
    assert pool.ready() == [handle]
    assert handle.ready_at == host.now
    assert handle.probe.baseline_us == 250
    assert handle.info == {"pid": 5, "threads": 1, "probe_baseline_us": 250}
    assert host.dispatched == [pool]
    assert pool.ready_count() == 1


def test_unknown_or_repeated_state_reports_are_ignored(host):
    pool = make_pool(host)
    pool.start_all()
    handle = host.launched[0]
    pool.on_worker_state(handle, "BANANA", {})
    pool.on_worker_state(handle, "DRAINING", {})
    assert handle.state == S.STARTING
    pool.on_worker_state(handle, "LOADING", {})
    pool.on_worker_state(handle, "LOADING", {})
    assert handle.state == S.LOADING


def test_spawn_does_nothing_while_stopping(host):
    pool = make_pool(host)
    host.stopping = True
    pool.start_all()
    assert host.launched == []
    assert pool.slots[0].state == SlotState.STOPPED


# -- failed starts: backoff and FATAL -----------------------------------------------------------


def test_failed_starts_back_off_exponentially_then_go_fatal(host):
    pool = make_pool(host, backoff_initial=1.0, backoff_max=5.0, max_start_failures=6,
                     fatal_retry=0)
    pool.start_all()
    slot = pool.slots[0]
    for failure, delay in enumerate([1.0, 2.0, 4.0, 5.0, 5.0], start=1):
        exit_with(pool, slot.current, EXIT_LOAD_ERROR)
        assert slot.state == SlotState.BACKOFF
        assert slot.start_failures == failure
        assert slot.current is None
        assert slot.backoff_until == host.now + delay
        assert slot.last_exit == "exit 4 (model load error)"
        launched = len(host.launched)
        assert host.advance(delay - 0.001) == 0
        assert len(host.launched) == launched, f"restarted before the {delay}s backoff"
        assert host.advance(0.001) == 1
        assert len(host.launched) == launched + 1
        assert slot.state == SlotState.STARTING and slot.current is host.launched[-1]
        assert slot.generation == failure + 1
    exit_with(pool, slot.current, EXIT_LOAD_ERROR)  # the sixth failed start
    assert slot.state == SlotState.FATAL
    assert host.fatal == [True]
    assert pool.all_fatal()
    assert len(host.timers) == 0
    host.advance(10_000)
    assert len(host.launched) == 6  # FATAL stays down with fatal_retry = 0
    assert slot.restarts == 6


def test_default_backoff_sequence_and_fatal_after_five(host):
    pool = make_pool(host)  # backoff_initial 0.5, cap 30, max_start_failures 5
    pool.start_all()
    slot = pool.slots[0]
    delays = []
    for _ in range(4):
        exit_with(pool, slot.current, EXIT_WARMUP_ERROR)
        delays.append(slot.backoff_until - host.now)
        host.advance(delays[-1])
    assert delays == [0.5, 1.0, 2.0, 4.0]
    exit_with(pool, slot.current, EXIT_WARMUP_ERROR)
    assert slot.state == SlotState.FATAL and host.fatal == [True]


def test_backoff_is_capped_at_backoff_max(host):
    pool = make_pool(host, backoff_initial=10.0, backoff_max=15.0, max_start_failures=10)
    pool.start_all()
    slot = pool.slots[0]
    delays = []
    for _ in range(4):
        exit_with(pool, slot.current, EXIT_LOAD_ERROR)
        delays.append(slot.backoff_until - host.now)
        host.advance(delays[-1])
    assert delays == [10.0, 15.0, 15.0, 15.0]


def test_death_before_ready_is_a_failed_start_however_long_it_lived(host):
    pool = make_pool(host)
    pool.start_all()
    slot = pool.slots[0]
    pool.on_worker_state(slot.current, "LOADING", {})
    host.now += 120  # far beyond start_seconds, but it never got READY
    exit_with(pool, slot.current, SIGKILLED)
    assert slot.current is None
    assert slot.state == SlotState.BACKOFF and slot.start_failures == 1
    assert slot.last_exit == "SIGKILL"
    assert len(host.launched) == 1
    assert host.recovered == [host.launched[0]]
    assert host.launched[0].state == S.DEAD


def test_crash_soon_after_ready_is_a_failed_start(host):
    pool = make_pool(host, start_seconds=10.0)
    pool.start_all()
    handle = host.launched[0]
    ready(pool, handle)
    host.now += 9.5
    exit_with(pool, handle, SIGSEGV)
    assert pool.slots[0].state == SlotState.BACKOFF and pool.slots[0].start_failures == 1


def test_load_error_exit_code_is_a_failed_start_even_after_a_long_ready_run(host):
    pool = make_pool(host)
    pool.start_all()
    handle = host.launched[0]
    ready(pool, handle)
    host.now += 3600
    exit_with(pool, handle, EXIT_LOAD_ERROR)
    assert pool.slots[0].state == SlotState.BACKOFF and pool.slots[0].start_failures == 1


def test_crash_after_a_good_start_restarts_at_once_and_resets_the_count(host):
    pool = make_pool(host, start_seconds=10.0)
    pool.start_all()
    slot = pool.slots[0]
    for _ in range(3):  # three failed starts first
        exit_with(pool, slot.current, EXIT_LOAD_ERROR)
        host.advance(slot.backoff_until - host.now)
    assert slot.start_failures == 3 and len(host.launched) == 4
    handle = slot.current
    ready(pool, handle)
    host.now += 10.5
    exit_with(pool, handle, SIGKILLED)
    assert slot.start_failures == 0
    assert slot.state == SlotState.STARTING
    assert len(host.launched) == 5 and slot.current is host.launched[-1]  # no backoff wait
    assert slot.backoff_timer is None and len(host.timers) == 0
    assert slot.restarts == 4
    assert slot.last_exit == "SIGKILL"
    # and the next failed start backs off from the initial delay again
    exit_with(pool, slot.current, EXIT_LOAD_ERROR)
    assert slot.start_failures == 1 and slot.backoff_until - host.now == 0.5


def test_unexpected_clean_exit_of_a_serving_worker_is_restarted(host):
    pool = make_pool(host)
    pool.start_all()
    handle = host.launched[0]
    ready(pool, handle)
    host.now += 60
    exit_with(pool, handle, EXIT_OK)
    assert handle.state == S.DEAD  # it was not asked to stop
    assert pool.slots[0].state == SlotState.STARTING and len(host.launched) == 2


def test_exit_while_stopping_does_not_restart(host):
    pool = make_pool(host)
    pool.start_all()
    handle = host.launched[0]
    ready(pool, handle)
    host.stopping = True
    exit_with(pool, handle, SIGKILLED)
    assert pool.slots[0].state == SlotState.STOPPED
    assert len(host.launched) == 1 and len(host.timers) == 0


def test_restart_revives_a_fatal_slot(host):
    pool = make_pool(host, max_start_failures=2)
    pool.start_all()
    slot = pool.slots[0]
    exit_with(pool, slot.current, EXIT_LOAD_ERROR)
    host.advance(10)
    slot.current.failure = "ImportError: no module named pkg"
    exit_with(pool, slot.current, EXIT_LOAD_ERROR)
    assert slot.state == SlotState.FATAL and slot.failure == "ImportError: no module named pkg"
    assert pool.restart() == ["m#0"]
    assert slot.state == SlotState.STARTING
    assert slot.start_failures == 0 and slot.failure is None
    assert slot.current is host.launched[-1] and len(host.launched) == 3
    assert not pool.all_fatal()
    # the count starts over: one failure backs off rather than going FATAL again
    exit_with(pool, slot.current, EXIT_LOAD_ERROR)
    assert slot.state == SlotState.BACKOFF and slot.start_failures == 1


def test_restart_during_backoff_starts_now_and_cancels_the_pending_start(host):
    pool = make_pool(host, backoff_initial=5.0)
    pool.start_all()
    slot = pool.slots[0]
    exit_with(pool, slot.current, EXIT_LOAD_ERROR)
    assert slot.state == SlotState.BACKOFF
    assert pool.restart() == ["m#0"]
    assert len(host.launched) == 2 and slot.state == SlotState.STARTING
    assert slot.backoff_timer is None and slot.backoff_until is None
    host.advance(100)
    assert len(host.launched) == 2  # the old backoff timer did not start a second worker


def test_restart_leaves_booting_workers_alone_and_replaces_ready_ones(host):
    pool = make_pool(host, workers=2)
    pool.start_all()
    first, second = host.launched
    ready(pool, first)
    assert pool.restart() == ["m#0"]
    assert first.retiring == "restart command" and first.state == S.READY
    assert pool.slots[0].previous is first
    assert second.state == S.STARTING and second.retiring is None
    assert len(host.launched) == 3


# -- replacement --------------------------------------------------------------------------------


def test_replace_keeps_the_old_worker_serving_until_the_new_one_is_ready(host):
    pool = make_pool(host)
    pool.start_all()
    slot = pool.slots[0]
    old = slot.current
    ready(pool, old)
    assert pool.replace(old, "test") is True
    new = slot.current
    assert new is not old and new is host.launched[-1]
    assert slot.previous is old and old.retiring == "test"
    assert new.spec.generation == 2 and new.spec.slot == 0
    for state in ("LOADING", "WARMING"):
        pool.on_worker_state(new, state, {})
        assert old.state == S.READY
        assert pool.ready() == [old] and pool.least_loaded() is old
        assert host.stopped == []
    pool.on_worker_state(new, "READY", {})
    assert old.state == S.DRAINING
    assert old.drain_deadline == host.now + NEVER
    assert host.stopped == [old]  # it held nothing: told to stop at once
    assert pool.ready() == [new] and pool.least_loaded() is new
    exit_with(pool, old, EXIT_OK)
    assert old.state == S.STOPPED
    assert slot.previous is None and slot.current is new
    assert len(host.launched) == 2  # the old one's exit restarts nothing
    assert slot.state == SlotState.READY  # it follows its current worker: the new one


def test_replaced_worker_with_requests_stops_only_once_idle(host):
    pool = make_pool(host, max_inflight=4)
    pool.start_all()
    old = host.launched[0]
    ready(pool, old)
    old.inflight = {1: "request-1", 2: "request-2"}
    pool.replace(old, "test")
    new = host.launched[-1]
    ready(pool, new)
    assert old.state == S.DRAINING and host.stopped == []
    assert pool.least_loaded() is new  # a draining worker gets nothing new
    del old.inflight[1]
    pool.after_result(old)
    assert host.stopped == []
    del old.inflight[2]
    pool.after_result(old)
    assert host.stopped == [old]
    pool.after_result(old)
    assert host.stopped == [old]  # told once only


def test_replace_refuses_what_it_cannot_replace(host):
    pool = make_pool(host)
    pool.start_all()
    booting = host.launched[0]
    assert pool.replace(booting, "not ready yet") is False
    ready(pool, booting)
    assert pool.replace(booting, "first") is True
    assert pool.replace(booting, "again") is False  # already retiring / not current
    new = host.launched[-1]
    ready(pool, new)
    host.stopping = True
    assert pool.replace(new, "while stopping") is False
    assert len(host.launched) == 2


def test_replacement_failing_to_start_leaves_the_old_worker_serving(host):
    pool = make_pool(host)
    pool.start_all()
    slot = pool.slots[0]
    old = slot.current
    ready(pool, old)
    pool.replace(old, "test")
    exit_with(pool, slot.current, EXIT_LOAD_ERROR)
    assert slot.state == SlotState.BACKOFF
    assert old.state == S.READY and pool.least_loaded() is old
    host.advance(slot.backoff_until - host.now)
    new = slot.current
    assert new is host.launched[-1] and slot.previous is old
    ready(pool, new)
    assert old.state == S.DRAINING and host.stopped == [old]


def test_old_worker_dying_during_replacement_does_not_disturb_the_new_one(host):
    pool = make_pool(host)
    pool.start_all()
    slot = pool.slots[0]
    old = slot.current
    ready(pool, old)
    pool.replace(old, "test")
    new = slot.current
    exit_with(pool, old, SIGKILLED)
    assert old.state == S.DEAD and slot.previous is None
    assert slot.current is new and slot.state == SlotState.STARTING
    assert len(host.launched) == 2 and slot.start_failures == 0
    ready(pool, new)
    assert host.stopped == []


def test_last_worker_of_a_fatal_slot_leaving_reports_the_pool_fatal(host):
    pool = make_pool(host, max_start_failures=2)
    pool.start_all()
    slot = pool.slots[0]
    old = slot.current
    ready(pool, old)
    pool.replace(old, "probes failing")
    exit_with(pool, slot.current, EXIT_LOAD_ERROR)
    host.advance(slot.backoff_until - host.now)
    exit_with(pool, slot.current, EXIT_LOAD_ERROR)
    assert slot.state == SlotState.FATAL
    assert host.fatal == [False]  # the old worker still serves
    exit_with(pool, old, SIGKILLED)
    assert pool.all_fatal()
    assert host.fatal[-1] is True


def test_rejected_ready_report_does_not_count_as_a_good_start(host):
    pool = make_pool(host, start_seconds=10.0)
    pool.start_all()
    slot = pool.slots[0]
    handle = slot.current
    pool.on_worker_state(handle, "READY", {})  # out of order: STARTING -> READY is illegal
    assert handle.state == S.STARTING
    host.now += 400
    exit_with(pool, handle, -15)  # killed by the start timeout
    assert slot.state == SlotState.BACKOFF and slot.start_failures == 1


# -- probes -------------------------------------------------------------------------------------


def test_three_failed_probes_in_a_row_replace_the_worker(host):
    pool = make_pool(host)
    pool.start_all()
    handle = host.launched[0]
    ready(pool, handle)
    for count in (1, 2):
        pool.record_probe(handle, Verdict(False, "drifted from golden by 0.5", 0.5))
        assert handle.probe.consecutive_failures == count
        assert handle.retiring is None and len(host.launched) == 1
    assert handle.probe.drift == 0.5 and handle.probe.last_ok is False
    assert handle.probe.due_at == host.now + pool.config.probe.interval
    pool.record_probe(handle, Verdict(False, "drifted from golden by 0.7", 0.7))
    assert handle.retiring is not None and "3 failed probes" in handle.retiring
    assert pool.slots[0].previous is handle
    assert len(host.launched) == 2
    assert handle.state == S.READY  # still serving until the replacement is READY
    pool.record_probe(handle, Verdict(False, "still bad"))  # a fourth failure: no second replacement
    assert len(host.launched) == 2


def test_alternating_probe_results_never_replace(host):
    pool = make_pool(host)
    pool.start_all()
    handle = host.launched[0]
    ready(pool, handle)
    for _ in range(20):
        pool.record_probe(handle, Verdict(False, "bad"))
        pool.record_probe(handle, Verdict(False, "bad"))
        pool.record_probe(handle, Verdict(True, "ok", 0.0))
        assert handle.probe.consecutive_failures == 0
    assert handle.retiring is None and len(host.launched) == 1
    assert handle.probe.last_ok is True and handle.probe.last_reason == "ok"


def test_probe_failures_threshold_comes_from_config(host):
    pool = make_pool(host, probe={"failures": 1})
    pool.start_all()
    handle = host.launched[0]
    ready(pool, handle)
    pool.record_probe(handle, Verdict(False, "bad"))
    assert handle.retiring is not None and len(host.launched) == 2


def test_an_unanswered_probe_replaces_the_worker_at_once(host):
    # A stuck worker still holds its probe, so no second probe could ever count as a failure:
    # the timeout alone must start the replacement, whatever `failures` says.
    pool = make_pool(host, probe={"timeout": 2.0, "failures": 3})
    pool.start_all()
    handle = host.launched[0]
    ready(pool, handle)
    handle.probe.inflight_since, handle.probe.rid = host.now, 77
    pool._check_probe_timeout(handle, host.now + 1.9)
    assert handle.retiring is None and len(host.launched) == 1
    pool._check_probe_timeout(handle, host.now + 2.1)
    assert handle.probe.consecutive_failures == 1 and handle.probe.rid is None
    assert handle.retiring is not None and "probe unanswered" in handle.retiring
    assert len(host.launched) == 2 and handle.state == S.READY  # replace before retire


def test_an_unanswered_probe_waits_for_the_slot_to_take_a_replacement(host):
    # The slot's previous worker is still draining when the new one stops answering: the
    # replacement must come as soon as the slot is free, not never.
    pool = make_pool(host, probe={"timeout": 2.0})
    pool.start_all()
    old = host.launched[0]
    ready(pool, old)
    pool.replace(old, "recycled")
    new = host.launched[1]
    ready(pool, new)
    assert old.state == S.DRAINING and pool.slots[0].previous is old
    new.probe.inflight_since, new.probe.rid = host.now, 78
    pool._check_probe_timeout(new, host.now + 2.1)
    assert new.retiring is None and len(host.launched) == 2  # the slot is busy retiring `old`
    exit_with(pool, old, 0)
    pool._check_probe_timeout(new, host.now + 2.2)
    assert new.retiring is not None and "probe unanswered" in new.retiring
    assert len(host.launched) == 3


# -- routing ------------------------------------------------------------------------------------


def three_ready(host: FakeHost, **overrides) -> tuple[ModelPool, list[WorkerHandle]]:
    pool = make_pool(host, workers=3, **overrides)
    pool.start_all()
    for handle in host.launched:
        ready(pool, handle)
    return pool, list(host.launched)


def test_least_loaded_prefers_fewer_requests_in_flight(host):
    pool, (a, b, c) = three_ready(host, max_inflight=3)
    a.inflight = {1: "r", 2: "r"}
    b.inflight = {3: "r"}
    c.inflight = {4: "r", 5: "r"}
    assert pool.least_loaded() is b
    b.inflight[6] = "r"
    b.inflight[7] = "r"  # b is full now
    a.last_dispatch, c.last_dispatch = 1.0, 2.0
    assert pool.least_loaded() is c
    a.inflight[8] = "r"
    c.inflight[9] = "r"
    assert pool.least_loaded() is None  # nobody has room


def test_least_loaded_avoids_suspect_workers_while_others_have_room(host):
    pool, (a, b, c) = three_ready(host, max_inflight=4)
    b.inflight = {1: "r", 2: "r"}
    c.inflight = {3: "r", 4: "r", 5: "r"}
    a.probe.consecutive_failures = 1
    assert pool.least_loaded() is b  # busier, but its probes pass
    b.retiring = "being replaced"
    assert pool.least_loaded() is c
    c.inflight[6] = "r"  # c is full: only suspects have room
    assert pool.least_loaded() is a


def test_least_loaded_breaks_ties_by_most_recent_dispatch(host):
    # the most recently used worker has its weights in the caches
    pool, (a, b, c) = three_ready(host)
    a.last_dispatch, b.last_dispatch, c.last_dispatch = 30.0, 10.0, 20.0
    assert pool.least_loaded() is a
    a.inflight = {1: "r"}  # busy: the next most recent
    assert pool.least_loaded() is c


def test_least_loaded_ignores_workers_that_are_not_ready(host):
    pool = make_pool(host, workers=2)
    pool.start_all()
    a, b = host.launched
    pool.on_worker_state(a, "LOADING", {})
    ready(pool, b)
    b.last_dispatch = 1e9
    assert pool.least_loaded() is b
    assert pool.ready() == [b] and pool.ready_count() == 1


# -- the host contract ----------------------------------------------------------------------------


def _host_members_used_by_the_pool() -> set[str]:
    # the pool's standbys (supervisor/fleet/standby.py) reach the host through the pool's
    return {name for module in (pool_module, standby_module)
            for name in _host_members_used_by(module)}


def _host_members_used_by(module) -> set[str]:
    tree = ast.parse(Path(module.__file__).read_text())
    return {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
            and node.value.attr == "host" and isinstance(node.value.value, ast.Name)
            and node.value.value.id == "self"}


def test_the_pool_uses_exactly_what_the_host_protocol_names():
    declared = set(PoolHost.__annotations__) | {
        name for name, value in vars(PoolHost).items() if callable(value) and not name.startswith("_")}
    assert _host_members_used_by_the_pool() == declared
    assert isinstance(FakeHost(), PoolHost)


def test_the_arbiter_is_a_pool_host(tmp_path):
    from modelwarden.shared.config import load_settings
    from modelwarden.supervisor.arbiter import Arbiter
    from tests.helpers import mlp_model, render_config
    config = tmp_path / "modelwarden.toml"
    config.write_text(render_config({"runtime_dir": str(tmp_path / "run")}, [mlp_model(workers=1)]))
    arbiter = Arbiter(load_settings(config))
    try:
        assert isinstance(arbiter, PoolHost)
        assert arbiter.pools["mlp"].host is arbiter
    finally:
        arbiter.context.term()


def test_a_stuck_start_is_signalled_through_the_host_then_killed_after_kill_grace(host):
    pool = make_pool(host, start_timeout=30.0, kill_grace=2.0)
    pool.start_all()
    handle = host.launched[0]
    pool.on_worker_state(handle, "LOADING", {})
    pool.tick(host.now + 29.0)
    assert host.signals == [] and handle.state == S.LOADING
    host.now += 30.5
    pool.tick(host.now)
    assert handle.state == S.DEAD and pool.slots[0].state == SlotState.DEAD
    assert host.signals == [(handle, signal.SIGTERM)] and host.recovered == [handle]
    host.advance(1.9)
    assert host.signals == [(handle, signal.SIGTERM)]
    host.advance(0.2)
    assert host.signals == [(handle, signal.SIGTERM), (handle, signal.SIGKILL)]
    exit_with(pool, handle, SIGKILLED)
    assert pool.slots[0].state == SlotState.BACKOFF


# -- the slot's machine follows its current worker ----------------------------------------------


def test_a_slot_is_ready_when_its_current_worker_is_and_starting_while_a_replacement_boots(host):
    pool = make_pool(host)
    pool.start_all()
    slot = pool.slots[0]
    old = slot.current
    for state in ("LOADING", "WARMING"):
        pool.on_worker_state(old, state, {})
        assert slot.state == SlotState.STARTING
    pool.on_worker_state(old, "READY", {})
    assert slot.state == SlotState.READY
    pool.replace(old, "test")
    new = slot.current
    assert slot.state == SlotState.STARTING  # its current worker boots; the old one serves on
    ready(pool, new)
    assert slot.state == SlotState.READY and old.state == S.DRAINING  # the old one is not current
    exit_with(pool, old, EXIT_OK)
    assert slot.state == SlotState.READY


def test_a_slot_drains_and_stops_with_its_current_worker_at_shutdown(host):
    pool = make_pool(host)
    pool.start_all()
    slot = pool.slots[0]
    handle = slot.current
    ready(pool, handle)
    host.stopping = True
    pool.drain(handle, "shutdown")
    assert slot.state == SlotState.DRAINING and host.stopped == [handle]
    exit_with(pool, handle, EXIT_OK)
    assert handle.state == S.STOPPED and slot.state == SlotState.STOPPED
    assert slot.current is None and len(host.launched) == 1


def test_a_worker_death_logs_the_worker_once_and_the_slot_from_its_own_state(host, caplog):
    pool = make_pool(host)
    pool.start_all()
    slot = pool.slots[0]
    pool.on_worker_state(slot.current, "LOADING", {})
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="modelwarden"):
        exit_with(pool, slot.current, SIGKILLED)
    lines = [(record.levelno, record.getMessage()) for record in caplog.records
             if " -> " in record.getMessage()]
    visible = [message for level, message in lines if level >= logging.INFO]
    assert visible == ["m#0 pid 2000000000: LOADING -> DEAD (SIGKILL)",
                       "slot m#0: DEAD -> BACKOFF (failed start 1, retry in 0.5s)"]
    assert (logging.DEBUG, "slot m#0: STARTING -> DEAD (worker DEAD)") in lines


def test_illegal_slot_transitions_raise(host):
    pool = make_pool(host, max_start_failures=1)
    slot = pool.slots[0]
    with pytest.raises(IllegalTransition):
        slot.set_state(SlotState.READY)  # STOPPED -> READY: nothing was started
    with pytest.raises(IllegalTransition):
        slot.set_state(SlotState.BACKOFF)  # STOPPED -> BACKOFF: nothing failed
    pool.start_all()
    exit_with(pool, slot.current, EXIT_LOAD_ERROR)
    assert slot.state == SlotState.FATAL
    for illegal in (SlotState.READY, SlotState.BACKOFF, SlotState.DEAD, SlotState.DRAINING):
        with pytest.raises(IllegalTransition):
            slot.set_state(illegal)
    assert slot.state == SlotState.FATAL


# -- the tables -----------------------------------------------------------------------------------


def test_every_state_of_each_machine_has_a_row_of_its_own_kind():
    assert set(WORKER_TRANSITIONS) == set(S)
    assert set(SLOT_TRANSITIONS) == set(SlotState)
    assert all(type(new) is S for edges in WORKER_TRANSITIONS.values() for new in edges)
    assert all(type(new) is SlotState for edges in SLOT_TRANSITIONS.values() for new in edges)
    assert set(SLOT_FOLLOWS) == set(S)


def test_worker_table_a_process_walks_forward_and_never_comes_back():
    check_transition(S.STARTING, S.LOADING)
    check_transition(S.WARMING, S.READY)
    check_transition(S.READY, S.DRAINING)
    check_transition(S.DRAINING, S.STOPPED)
    for state in (S.STARTING, S.LOADING, S.WARMING, S.READY, S.DRAINING):
        check_transition(state, S.DEAD)
    for old, new in [(S.STARTING, S.READY), (S.LOADING, S.READY), (S.READY, S.WARMING),
                     (S.READY, S.STOPPED), (S.DEAD, S.STARTING), (S.STOPPED, S.STARTING)]:
        with pytest.raises(IllegalTransition):
            check_transition(old, new)
    assert WORKER_TRANSITIONS[S.DEAD] == WORKER_TRANSITIONS[S.STOPPED] == frozenset()


def test_slot_table_restart_policy_edges():
    check_transition(SlotState.STOPPED, SlotState.STARTING)
    check_transition(SlotState.READY, SlotState.STARTING)  # a replacement boots
    for new in (SlotState.STARTING, SlotState.BACKOFF, SlotState.FATAL, SlotState.STOPPED):
        check_transition(SlotState.DEAD, new)
    check_transition(SlotState.BACKOFF, SlotState.STARTING)
    check_transition(SlotState.FATAL, SlotState.STARTING)
    for old, new in [(SlotState.STARTING, SlotState.BACKOFF), (SlotState.READY, SlotState.FATAL),
                     (SlotState.BACKOFF, SlotState.READY), (SlotState.FATAL, SlotState.READY),
                     (SlotState.STOPPED, SlotState.DEAD)]:
        with pytest.raises(IllegalTransition):
            check_transition(old, new)


def test_a_transition_across_the_two_machines_raises():
    with pytest.raises(IllegalTransition):
        check_transition(SlotState.STARTING, S.READY)
    with pytest.raises(IllegalTransition):
        check_transition(S.DEAD, SlotState.STARTING)


def test_every_edge_a_current_worker_takes_is_an_edge_its_slot_can_follow():
    for old, edges in WORKER_TRANSITIONS.items():
        for new in edges:
            if SLOT_FOLLOWS[old] != SLOT_FOLLOWS[new]:
                check_transition(SLOT_FOLLOWS[old], SLOT_FOLLOWS[new])


def test_every_slot_state_is_reachable_from_stopped():
    seen, frontier = {SlotState.STOPPED}, [SlotState.STOPPED]
    while frontier:
        for new in SLOT_TRANSITIONS[frontier.pop()] - seen:
            seen.add(new)
            frontier.append(new)
    assert seen == set(SlotState)


# -- FATAL heals by itself (fatal_retry) ----------------------------------------------------------


def go_fatal(pool: ModelPool, host: FakeHost) -> None:
    """Fail every start of slot 0 until it is FATAL, waiting out each backoff."""
    slot = pool.slots[0]
    while slot.state != SlotState.FATAL:
        if slot.current is None:
            host.advance(slot.backoff_until - host.now)
        exit_with(pool, slot.current, EXIT_LOAD_ERROR)


def test_a_fatal_slot_tries_again_after_fatal_retry_and_heals(host):
    pool = make_pool(host, fatal_retry=60.0, max_start_failures=3)
    pool.start_all()
    go_fatal(pool, host)
    slot = pool.slots[0]
    assert slot.retry_at == host.now + 60.0
    launched = len(host.launched)
    host.advance(59.9)
    assert len(host.launched) == launched and slot.state == SlotState.FATAL
    host.advance(0.1)
    assert len(host.launched) == launched + 1 and slot.state == SlotState.STARTING
    assert slot.retry_at is None
    ready(pool, slot.current)  # the transient fault is gone: it serves again
    host.advance(20.0)
    assert pool.ready_count() == 1 and not pool.all_fatal()


def test_a_retry_that_fails_again_is_fatal_at_once_and_waits_another_interval(host):
    pool = make_pool(host, fatal_retry=60.0, max_start_failures=3)
    pool.start_all()
    go_fatal(pool, host)
    slot = pool.slots[0]
    for _ in range(3):  # a steady fault: one try per interval, no backoff ladder in between
        launched = len(host.launched)
        host.advance(60.0)
        assert len(host.launched) == launched + 1
        exit_with(pool, slot.current, EXIT_LOAD_ERROR)
        assert slot.state == SlotState.FATAL and slot.retry_at == host.now + 60.0
    assert len(host.launched) == 3 + 3


def test_fatal_retry_zero_never_retries_and_restart_retries_at_once(host):
    pool = make_pool(host, fatal_retry=0, max_start_failures=1)
    pool.start_all()
    exit_with(pool, host.launched[0], EXIT_LOAD_ERROR)
    slot = pool.slots[0]
    assert slot.state == SlotState.FATAL and slot.retry_at is None and len(host.timers) == 0
    host.advance(100_000)
    assert len(host.launched) == 1
    assert pool.restart() == ["m#0"] and len(host.launched) == 2


def test_a_restart_command_cancels_the_pending_fatal_retry(host):
    pool = make_pool(host, fatal_retry=30.0, max_start_failures=1)
    pool.start_all()
    exit_with(pool, host.launched[0], EXIT_LOAD_ERROR)
    assert pool.restart() == ["m#0"]
    assert pool.slots[0].retry_at is None and pool.slots[0].start_failures == 0
    host.advance(31.0)
    assert len(host.launched) == 2  # the retry timer did not start a second worker


# -- probes: at most max_replacements, then FATAL -------------------------------------------------


def fail_probes(pool: ModelPool, handle: WorkerHandle) -> None:
    for _ in range(pool.config.probe.failures):
        pool.record_probe(handle, Verdict(False, "drifted from golden by 0.5", 0.5))


def test_a_slot_failing_probes_is_replaced_max_replacements_times_then_fatal(host):
    pool = make_pool(host, fatal_retry=0, probe={"max_replacements": 2})
    pool.start_all()
    slot = pool.slots[0]
    for replacement in (1, 2):
        ready(pool, slot.current)
        pool.record_probe(slot.current, Verdict(True, "ok", 0.0))  # one pass is not health
        fail_probes(pool, slot.current)
        assert slot.probe_replacements == replacement and slot.previous is not None
        ready(pool, slot.current)  # the replacement serves; its predecessor drains and leaves
        exit_with(pool, slot.previous, EXIT_OK)
    last = slot.current
    fail_probes(pool, last)
    assert len(host.launched) == 3  # no third replacement
    assert last.state == S.DRAINING and last in host.stopped  # out of rotation at once
    exit_with(pool, last, EXIT_OK)
    assert slot.state == SlotState.FATAL and pool.all_fatal() and host.fatal[-1] is True
    host.advance(10_000)
    assert len(host.launched) == 3


def test_a_worker_passing_failures_probes_in_a_row_resets_the_replacement_count(host):
    pool = make_pool(host, probe={"max_replacements": 1})
    pool.start_all()
    slot = pool.slots[0]
    ready(pool, slot.current)
    fail_probes(pool, slot.current)
    ready(pool, slot.current)
    assert slot.probe_replacements == 1
    for _ in range(pool.config.probe.failures):
        pool.record_probe(slot.current, Verdict(True, "ok", 0.0))
    assert slot.probe_replacements == 0
    exit_with(pool, slot.previous, EXIT_OK)
    fail_probes(pool, slot.current)  # a new streak may replace again
    assert slot.previous is not None and slot.state != SlotState.FATAL


def test_a_probe_fatal_slot_gets_one_streak_after_its_fatal_retry(host):
    pool = make_pool(host, fatal_retry=60.0, probe={"max_replacements": 0})
    pool.start_all()
    slot = pool.slots[0]
    ready(pool, slot.current)
    fail_probes(pool, slot.current)
    exit_with(pool, slot.current, EXIT_OK)
    assert slot.state == SlotState.FATAL
    host.advance(60.0)
    ready(pool, slot.current)
    fail_probes(pool, slot.current)
    assert slot.current.state == S.DRAINING and slot.previous is None


# -- shape: stop, scale, reconfigure, roll --------------------------------------------------------


def test_stop_drains_a_slot_keeps_it_stopped_and_restart_brings_it_back(host):
    pool = make_pool(host, workers=2)
    pool.start_all()
    for handle in host.launched:
        ready(pool, handle)
    first = host.launched[0]
    assert pool.stop(0) == ["m#0"]
    assert first.state == S.DRAINING and not pool.all_fatal()
    exit_with(pool, first, EXIT_OK)
    assert pool.slots[0].state == SlotState.STOPPED and len(host.launched) == 2
    host.advance(1000)
    assert len(host.launched) == 2  # never restarted by itself
    assert pool.stop() == ["m#1"]
    exit_with(pool, host.launched[1], EXIT_OK)
    assert pool.all_fatal() and host.fatal[-1] is True  # nobody will serve: the queue is answered
    assert pool.restart() == ["m#0", "m#1"] and len(host.launched) == 4


def test_a_stopped_slot_whose_worker_dies_draining_is_not_restarted(host):
    pool = make_pool(host)
    pool.start_all()
    ready(pool, host.launched[0])
    pool.stop()
    exit_with(pool, host.launched[0], SIGKILLED)
    assert pool.slots[0].state == SlotState.STOPPED and len(host.launched) == 1


def test_scale_up_starts_new_slots_and_leaves_the_others_alone(host):
    pool = make_pool(host, workers=1)
    pool.start_all()
    ready(pool, host.launched[0])
    pool.scale([SlotPlacement([0], 1, "cpu"), SlotPlacement([1], 1, "cpu"),
                SlotPlacement([2], 1, "cpu")], "scale")
    assert [h.spec.slot for h in host.launched] == [0, 1, 2]
    assert host.launched[0].state == S.READY and not host.launched[0].retiring
    assert len(pool.slots) == 3 and pool.ready_count() == 1


def test_scale_down_drains_the_last_slots_which_then_leave_the_pool(host):
    pool = make_pool(host, workers=3)
    pool.start_all()
    for handle in host.launched:
        ready(pool, handle)
    doomed = host.launched[2]
    doomed.inflight[7] = object()  # it holds a request: it drains, and stops only once idle
    pool.scale([SlotPlacement([0], 1, "cpu"), SlotPlacement([1], 1, "cpu")], "scaled down")
    assert len(pool.slots) == 2 and pool.ready_count() == 2
    assert doomed.state == S.DRAINING and doomed not in host.stopped
    assert pool.least_loaded() is not doomed and doomed in pool.handles()
    assert pool.slot_of(doomed) in pool.leaving
    doomed.inflight.clear()
    pool.after_result(doomed)
    assert doomed in host.stopped
    exit_with(pool, doomed, EXIT_OK)
    assert pool.leaving == [] and len(host.launched) == 3  # not restarted
    pool.scale([SlotPlacement([0], 1, "cpu"), SlotPlacement([1], 1, "cpu"),
                SlotPlacement([2], 1, "cpu")], "scale")
    assert host.launched[-1].spec.slot == 2


def test_a_reconfigured_pool_rolls_one_worker_at_a_time_replacing_before_retiring(host):
    pool = make_pool(host, workers=2)
    pool.start_all()
    old = list(host.launched)
    for handle in old:
        ready(pool, handle)
    new_config = pool.config.model_copy(update={"kwargs": {"scale": 2}})
    pool.reconfigure(new_config, pool.judge, roll=True)
    assert pool.rolling()
    pool.roll_step()
    assert len(host.launched) == 3 and pool.slots[0].previous is old[0]
    assert host.launched[2].spec.model is new_config
    pool.roll_step()
    assert len(host.launched) == 3  # slot 1 waits for slot 0's replacement
    ready(pool, host.launched[2])
    assert old[0].state == S.DRAINING and pool.ready_count() == 2
    exit_with(pool, old[0], EXIT_OK)
    pool.roll_step()
    assert len(host.launched) == 4 and pool.slots[1].previous is old[1]
    ready(pool, host.launched[3])
    exit_with(pool, old[1], EXIT_OK)
    pool.roll_step()
    assert len(host.launched) == 4 and not pool.rolling()


def test_a_policy_only_change_applies_without_restarting_anyone(host):
    pool = make_pool(host, workers=2)
    pool.start_all()
    for handle in host.launched:
        ready(pool, handle)
    pool.reconfigure(pool.config.model_copy(update={"max_inflight": 4}), pool.judge, roll=False)
    pool.roll_step()
    assert len(host.launched) == 2 and not pool.rolling()
    assert pool.least_loaded().has_room(pool.config.max_inflight)


def test_a_new_version_that_cannot_start_stops_the_roll_with_the_old_worker_serving(host):
    pool = make_pool(host, workers=2, max_start_failures=1, fatal_retry=0)
    pool.start_all()
    old = list(host.launched)
    for handle in old:
        ready(pool, handle)
    pool.reconfigure(pool.config.model_copy(update={"version": "bad"}), pool.judge, roll=True)
    pool.roll_step()
    exit_with(pool, host.launched[2], EXIT_LOAD_ERROR)
    assert pool.slots[0].state == SlotState.FATAL and pool.slots[0].previous is old[0]
    pool.roll_step()
    assert len(host.launched) == 3  # the roll stopped at the first slot
    assert pool.ready_count() == 2 and not pool.all_fatal()


def test_a_reload_releases_stopped_slots_even_one_still_draining(host):
    pool = make_pool(host, workers=2)
    pool.start_all()
    for handle in host.launched:
        ready(pool, handle)
    pool.stop()
    exit_with(pool, host.launched[1], EXIT_OK)  # slot 1 stopped; slot 0 still draining
    assert pool.release() == ["m#0", "m#1"]
    assert len(host.launched) == 3 and host.launched[2].spec.slot == 1
    exit_with(pool, host.launched[0], EXIT_OK)  # slot 0's worker leaves: the slot starts again
    assert len(host.launched) == 4 and pool.slots[0].state == SlotState.STARTING
    assert pool.release() == []


def test_a_retired_pool_restarts_and_replaces_nothing_then_scales_to_nothing(host):
    pool = make_pool(host, workers=2)
    pool.start_all()
    for handle in host.launched:
        ready(pool, handle)
    pool.retire("model m removed by a reload")
    exit_with(pool, host.launched[0], SIGSEGV)  # a crash of a removed model's worker: no restart
    assert pool.slots[0].state == SlotState.STOPPED and len(host.launched) == 2
    assert not pool.replace(host.launched[1], "max_rss")
    pool.scale([], "removed")
    assert pool.slots == [] and host.launched[1].state == S.DRAINING
    exit_with(pool, host.launched[1], EXIT_OK)
    assert pool.leaving == [] and pool.handles() == [] and len(host.launched) == 2
