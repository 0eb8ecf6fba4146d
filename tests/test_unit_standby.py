"""Standby policy (supervisor/fleet/standby.py and the pool's promotion), against FakeHost: no process.

The end-to-end tests (real processes, kills, pinning) are in tests/test_standby.py.
"""

from __future__ import annotations

import pytest

from modelwarden.shared.config import ModelConfig
from modelwarden.shared.states import EXIT_LOAD_ERROR, SlotState
from modelwarden.shared.states import WorkerState as S
from modelwarden.supervisor.fleet.placement import SlotPlacement
from modelwarden.supervisor.fleet.probes import ProbeJudge
from modelwarden.supervisor.fleet.standby import placement_for
from tests.test_unit_pool import FakeHost, assert_slots_follow, exit_with, make_pool, ready


@pytest.fixture
def host() -> FakeHost:
    return FakeHost()


def warm(pool, handle) -> None:
    for state in ("LOADING", "WARMING", "STANDBY"):
        pool.on_worker_state(handle, state, {})
        assert_slots_follow(pool)
    assert handle.state == S.STANDBY


def serving_with_standby(host, workers: int = 1, **overrides):
    pool = make_pool(host, workers=workers, standby=1, **overrides)
    pool.start_all()
    slots = list(host.launched)
    assert len(slots) == workers  # the slots' first workers boot alone
    for handle in slots:
        ready(pool, handle)
    pool.tick(host.now)
    *_, standby = host.launched
    warm(pool, standby)
    return pool, slots, standby


def test_a_standby_is_launched_slotless_and_never_routed_to(host):
    pool, (worker,), standby = serving_with_standby(host)
    assert standby.worker_id == "m#standby0" and standby.spec.cores == [99]
    assert pool.slots[0].current is worker and pool.slots[0].state == SlotState.READY
    assert pool.least_loaded() is worker and pool.ready() == [worker]
    assert standby in pool.handles()


def test_a_crash_promotes_the_standby_into_the_slot(host):
    pool, (worker,), standby = serving_with_standby(host)
    host.advance(60)  # a crash after a good start
    exit_with(pool, worker, -9)
    slot = pool.slots[0]
    assert host.promoted == [standby] and slot.current is standby
    assert len(host.launched) == 2  # no process spawned for the slot
    assert standby.worker_id == "m#0" and standby.spec.cores == [0] and standby.spec.threads == 1
    assert standby.spec.generation == slot.generation == 2 and slot.promotions == 1
    assert slot.state == SlotState.STARTING
    pool.on_worker_state(standby, "READY", {})
    assert slot.state == SlotState.READY and pool.least_loaded() is standby
    assert len(host.launched) == 3 and host.launched[-1].worker_id == "m#standby1"  # the next one


def test_without_a_warm_standby_a_crash_spawns_as_before(host):
    pool = make_pool(host, standby=1)
    pool.start_all()
    worker, = host.launched
    ready(pool, worker)
    pool.tick(host.now)
    assert host.launched[-1].worker_id == "m#standby0"  # booting, not warm yet
    host.advance(60)
    exit_with(pool, worker, -9)
    assert host.promoted == [] and pool.slots[0].current is host.launched[-1]
    assert host.launched[-1].worker_id == "m#0"


def test_ready_from_a_standby_not_promoted_is_ignored(host):
    pool, _, standby = serving_with_standby(host)
    pool.on_worker_state(standby, "READY", {})
    assert standby.state == S.STANDBY and pool.ready_count() == 1


def test_a_promoted_standby_dying_within_start_seconds_is_a_failed_start(host):
    pool, (worker,), standby = serving_with_standby(host)
    host.advance(60)  # the standby has been up for a minute: only its promotion is recent
    exit_with(pool, worker, -9)
    pool.on_worker_state(standby, "READY", {})
    host.advance(1)
    exit_with(pool, standby, -9)
    assert pool.slots[0].state == SlotState.BACKOFF and pool.slots[0].start_failures == 1


def test_a_replacement_promotes_the_standby_and_drains_the_old_worker_once_ready(host):
    pool, (worker,), standby = serving_with_standby(host, max_requests=5)
    worker.served = 5
    pool.after_result(worker)
    assert pool.slots[0].previous is worker and pool.slots[0].current is standby
    assert worker.state == S.READY  # serves on until its replacement is READY
    pool.on_worker_state(standby, "READY", {})
    assert worker.state == S.DRAINING and host.stopped == [worker]


def test_a_dying_standby_is_replaced_without_touching_the_slots(host):
    pool, (worker,), standby = serving_with_standby(host)
    host.advance(60)
    exit_with(pool, standby, -9)
    assert host.launched[-1].worker_id == "m#standby1"
    slot = pool.slots[0]
    assert slot.current is worker and slot.restarts == 0 and slot.state == SlotState.READY


def test_standbys_failing_to_boot_are_retried_after_a_growing_delay(host):
    pool, _, standby = serving_with_standby(host)
    exit_with(pool, standby, EXIT_LOAD_ERROR)  # right after STANDBY: a failed standby
    assert len(host.launched) == 2
    host.advance(0.5)
    assert len(host.launched) == 3
    exit_with(pool, host.launched[-1], EXIT_LOAD_ERROR)  # before STANDBY
    host.advance(0.5)
    assert len(host.launched) == 3  # the delay doubled
    host.advance(0.5)
    assert len(host.launched) == 4
    assert pool.slots[0].restarts == 0


def test_a_new_version_lets_the_old_standbys_go_and_starts_new_ones(host):
    pool, _, standby = serving_with_standby(host)
    standby.spec.version = "v1"
    pool.reconfigure(pool.config, pool.judge, roll=False, version="v2")
    assert standby.state == S.DRAINING and host.stopped == [standby]
    assert len(host.launched) == 3 and host.launched[-1].worker_id == "m#standby1"
    exit_with(pool, standby, 0)
    assert standby.state == S.STOPPED and len(host.launched) == 3


def test_fewer_standbys_by_reload_stop_the_surplus(host):
    pool, _, standby = serving_with_standby(host)
    config = ModelConfig(**{**pool.config.model_dump(), "standby": 0})
    pool.reconfigure(config, ProbeJudge(config.probe), roll=False, version=standby.spec.version)
    assert standby.state == S.DRAINING and len(host.launched) == 2


def test_no_standby_starts_again_during_shutdown(host):
    pool, _, standby = serving_with_standby(host)
    host.stopping = True
    exit_with(pool, standby, -15)
    host.advance(60)
    assert len(host.launched) == 2


def test_a_standby_takes_spare_cores_or_sleeps_on_its_slots():
    slot = SlotPlacement([0, 1], 2, "cpu")
    assert placement_for(slot, [0, 1, 2, 3], {0, 1}) == SlotPlacement([2, 3], 2, "cpu")
    assert placement_for(slot, [0, 1, 2], {0, 1}) == slot  # one spare core is not enough
    gpu = SlotPlacement([0], 1, "cuda:0")
    assert placement_for(gpu, [0, 1], {0}) == gpu


def test_a_standby_on_a_bare_cuda_device_is_promoted_only_into_the_slot_it_was_modelled_on(host):
    # a bare "cuda" picks the GPU by slot index in the worker: slot 1 may be another GPU
    pool = make_pool(host, workers=2, standby=1)
    for slot in pool.slots:
        slot.placement = SlotPlacement([slot.index], 1, "cuda")
    pool.start_all()
    first, second = host.launched
    ready(pool, first)
    ready(pool, second)
    pool.tick(host.now)
    standby = host.launched[-1]
    assert standby.spec.slot == 0 and standby.spec.device == "cuda"
    warm(pool, standby)
    host.advance(60)
    exit_with(pool, second, -9)
    assert host.promoted == [] and pool.slots[1].current.worker_id == "m#1"
    exit_with(pool, first, -9)
    assert host.promoted == [standby] and pool.slots[0].current is standby


@pytest.mark.parametrize("header", [
    {"slot": 0, "generation": 2, "cores": [], "threads": 1},
    {"slot": 0, "generation": 2, "cores": [0], "threads": 2},  # more threads than cores
    {"slot": "0", "generation": 2, "cores": [0], "threads": 1},
    {"slot": 0, "generation": 2, "cores": ["0"], "threads": 1},
    {"slot": 0, "cores": [0], "threads": 1},
])
def test_a_promotion_that_cannot_be_applied_is_a_placement_error(header):
    from modelwarden.worker.pinning import PlacementError
    from modelwarden.worker.standby import promote

    with pytest.raises(PlacementError, match="bad promotion"):
        promote(None, header)  # refused before anything is touched
