"""Unit tests of supervisor/fleet/placement.py: plan() with an explicit list of available cores."""

from __future__ import annotations

import logging

import pytest

from modelwarden.shared.config import ConfigError, Settings
from modelwarden.supervisor.fleet.placement import SlotPlacement, plan


def model(name: str = "a", **fields) -> dict:
    return {"name": name, "source": "python:pkg.mod:build", "warmup": 0, **fields}


def settings(*models: dict, oversubscribe: bool = False) -> Settings:
    return Settings(models=list(models), daemon={"allow_oversubscription": oversubscribe})


def config_error(call, *args, **kwargs) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        call(*args, **kwargs)
    return info.value


def test_one_worker_one_core_by_default():
    assert plan(settings(model()), cores=[0, 1]) == {"a": [SlotPlacement([0], 1, "cpu")]}


def test_disjoint_consecutive_core_sets_across_models():
    result = plan(settings(model("a", workers=2, cores_per_worker=2), model("b", workers=3)),
                  cores=list(range(8)))
    assert [p.cores for p in result["a"]] == [[0, 1], [2, 3]]
    assert [p.cores for p in result["b"]] == [[4], [5], [6]]
    every = [core for slots in result.values() for p in slots for core in p.cores]
    assert len(every) == len(set(every))  # disjoint


def test_carves_from_the_available_cores_in_order_not_from_zero():
    result = plan(settings(model(workers=2, cores_per_worker=2)), cores=[3, 5, 8, 13, 21])
    assert [p.cores for p in result["a"]] == [[3, 5], [8, 13]]


def test_threads_default_to_the_core_count():
    result = plan(settings(model("a", cores_per_worker=3), model("b", cores_per_worker=2, threads=1)),
                  cores=list(range(5)))
    assert result["a"][0].threads == 3
    assert result["b"][0].threads == 1
    assert result["b"][0].cores == [3, 4]


def test_explicit_cores_are_honoured():
    result = plan(settings(model(workers=2, cores=[[6, 4, 4], [1]])), cores=list(range(8)))
    assert result["a"] == [SlotPlacement([4, 6], 2, "cpu"), SlotPlacement([1], 1, "cpu")]


def test_explicit_cores_must_be_available():
    error = config_error(plan, settings(model(workers=2, cores=[[0], [2, 9]])), cores=[0, 1, 2, 3])
    assert error.key == "models[0] (model 'a').cores[1]"
    assert "9" in error.problem and "not available" in error.problem
    assert "0-3" in error.problem  # says what is available


def test_explicit_cores_may_not_overlap():
    error = config_error(plan, settings(model(workers=2, cores=[[0, 1], [1, 2]])), cores=[0, 1, 2, 3])
    assert error.key == "models[0] (model 'a').cores[1]"
    assert "core 1" in error.problem and "a#0" in error.problem


def test_explicit_cores_may_overlap_when_oversubscribing():
    result = plan(settings(model(workers=2, cores=[[0, 1], [1, 2]]), oversubscribe=True), cores=[0, 1, 2])
    assert [p.cores for p in result["a"]] == [[0, 1], [1, 2]]


def test_carved_cores_may_not_collide_with_explicit_cores_of_an_earlier_model_in_place():
    error = config_error(plan, settings(model("b", cores_per_worker=2), model("a", cores=[[1]])),
                         cores=[0, 1, 2, 3])
    assert error.key == "models[1] (model 'a').cores[0]"
    assert "core 1" in error.problem and "b#0" in error.problem


def test_carving_skips_cores_claimed_explicitly_by_an_earlier_model():
    result = plan(settings(model("a", cores=[[0]]), model("b", workers=2)), cores=[0, 1, 2, 3])
    assert result["a"][0].cores == [0]
    assert [p.cores for p in result["b"]] == [[1], [2]]


def test_threads_above_cores_is_an_error_naming_threads():
    error = config_error(plan, settings(model(cores_per_worker=2, threads=3)), cores=list(range(8)))
    assert error.key == "models[0] (model 'a').threads"
    assert "3 threads on 2 cores" in error.problem


def test_threads_above_explicit_cores_is_an_error_naming_threads():
    error = config_error(plan, settings(model("x", cores=[[0]], threads=2)), cores=[0, 1])
    assert error.key.endswith(".threads") and "model 'x'" in error.key


def test_threads_above_cores_is_an_error_even_when_oversubscribing():
    error = config_error(plan, settings(model(threads=2), oversubscribe=True), cores=list(range(8)))
    assert error.key == "models[0] (model 'a').threads"


def test_running_out_of_cores_names_the_key_and_the_way_out():
    error = config_error(plan, settings(model("a", workers=2), model("b", workers=2, cores_per_worker=2)),
                         cores=[0, 1, 2, 3])
    assert error.key == "models[1] (model 'b').cores_per_worker"
    assert "allow_oversubscription" in error.problem
    assert "0-3" in error.problem


def test_a_worker_wider_than_the_machine_is_an_error_even_when_oversubscribing():
    error = config_error(plan, settings(model(cores_per_worker=5), oversubscribe=True), cores=[0, 1, 2, 3])
    assert error.key == "models[0] (model 'a').cores_per_worker"


def test_oversubscription_wraps_core_sets_around(caplog):
    with caplog.at_level(logging.WARNING, logger="modelwarden.supervisor.fleet.placement"):
        result = plan(settings(model(workers=3, cores_per_worker=2), oversubscribe=True), cores=[0, 1, 2, 3])
    assert [p.cores for p in result["a"]] == [[0, 1], [2, 3], [0, 1]]
    assert [p.threads for p in result["a"]] == [2, 2, 2]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("6 threads on 4 available cores" in message for message in warnings), warnings


def test_oversubscription_spreads_shared_cores_evenly():
    result = plan(settings(model(workers=3, cores_per_worker=2), oversubscribe=True), cores=[0, 1, 2])
    sets = [p.cores for p in result["a"]]
    assert all(len(set(cores)) == 2 for cores in sets)
    usage = [sum(core in cores for cores in sets) for core in (0, 1, 2)]
    assert usage == [2, 2, 2]  # nobody idles while others carry three workers


def test_no_warning_when_it_fits(caplog):
    with caplog.at_level(logging.WARNING, logger="modelwarden.supervisor.fleet.placement"):
        plan(settings(model(workers=4), oversubscribe=True), cores=[0, 1, 2, 3])
    assert not [r for r in caplog.records if r.name == "modelwarden.supervisor.fleet.placement"]


def test_total_cpu_threads_above_cores_cannot_pass_silently():
    """Without allow_oversubscription, no plan runs more CPU threads than cores: whichever check
    trips first (carving or the total), the error points at allow_oversubscription."""
    for models in ([model(workers=5)], [model("a", workers=3), model("b", cores_per_worker=2)],
                   [model("a", workers=2, cores_per_worker=2, threads=2), model("b", threads=1)]):
        error = config_error(plan, settings(*models), cores=[0, 1, 2, 3])
        assert "allow_oversubscription" in error.key + error.problem, error


def test_gpu_workers_get_cores_and_device():
    result = plan(settings(model("g", workers=2, device="cuda:0")), cores=[0, 1, 2])
    assert result["g"] == [SlotPlacement([0], 1, "cuda:0"), SlotPlacement([1], 1, "cuda:0")]


def test_device_list_per_slot():
    result = plan(settings(model(workers=2, device=["cuda:1", "cpu"])), cores=[0, 1])
    assert [p.device for p in result["a"]] == ["cuda:1", "cpu"]


def test_gpu_workers_do_not_count_toward_the_cpu_thread_sum(caplog):
    # Two cores: the CPU model uses both; the GPU worker's host threads share (wrapping) cores.
    gpu_cfg = settings(model("cpu", workers=2), model("gpu", device="cuda:0", cores_per_worker=2),
                       oversubscribe=True)
    cpu_cfg = settings(model("cpu", workers=2), model("gpu", device="cpu", cores_per_worker=2),
                       oversubscribe=True)
    with caplog.at_level(logging.WARNING, logger="modelwarden.supervisor.fleet.placement"):
        result = plan(gpu_cfg, cores=[0, 1])
    assert result["gpu"] == [SlotPlacement([0, 1], 2, "cuda:0")]
    assert not [r for r in caplog.records if "oversubscribed" in r.getMessage()]
    with caplog.at_level(logging.WARNING, logger="modelwarden.supervisor.fleet.placement"):
        plan(cpu_cfg, cores=[0, 1])
    assert [r for r in caplog.records if "4 threads on 2 available cores" in r.getMessage()]


def test_gpu_threads_still_bounded_by_their_cores():
    error = config_error(plan, settings(model(device="cuda", threads=4, cores_per_worker=2)),
                         cores=list(range(8)))
    assert error.key == "models[0] (model 'a').threads"


def test_no_models_no_slots():
    assert plan(settings(), cores=[0]) == {}


def test_a_replan_keeps_running_slots_where_they_are_and_carves_new_ones_around_them():
    before = plan(settings(model("a"), model("b")), cores=list(range(6)))
    assert [p.cores for p in before["b"]] == [[1]]
    # a scaled to 3 and c added: b stays on core 1; a's new slots and c take the free cores.
    after = plan(settings(model("a", workers=3), model("b"), model("c")), cores=list(range(6)),
                 keep=before)
    assert after["b"] == before["b"] and after["a"][0] == before["a"][0]
    assert [p.cores for p in after["a"]] == [[0], [2], [3]] and [p.cores for p in after["c"]] == [[4]]
    # Without keep, b would have moved: the planner carves in model order.
    assert plan(settings(model("a", workers=3), model("b")), cores=list(range(6)))["b"][0].cores == [3]


def test_a_kept_placement_that_no_longer_fits_is_planned_afresh():
    before = plan(settings(model("a", workers=2)), cores=[0, 1, 2, 3])
    after = plan(settings(model("a", workers=2, cores_per_worker=2)), cores=[0, 1, 2, 3], keep=before)
    assert [p.cores for p in after["a"]] == [[0, 1], [2, 3]]
    gone = plan(settings(model("a", workers=2)), cores=[0, 2], keep=before)  # core 1 went away
    assert [p.cores for p in gone["a"]] == [[0], [2]]
