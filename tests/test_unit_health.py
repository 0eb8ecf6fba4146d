"""Unit tests of what systemd is told (supervisor/fleet/health.py, supervisor/systemd.ServiceReporter):
slots built by hand, a notifier that records instead of sending. The integration tests on a real
notify socket are in test_notify.py and, under a real systemd, test_systemd.py. The last test
reads the shipped unit with ``systemd-analyze security --offline`` (when the tool is there)."""

from __future__ import annotations

import re
import shutil
import subprocess
from types import SimpleNamespace

import pytest

from modelwarden.shared.config import ConfigError, load_settings
from modelwarden.shared.states import SlotState, WorkerState
from modelwarden.supervisor.fleet.health import Health, model_health
from modelwarden.supervisor.fleet.slot import Slot
from modelwarden.supervisor.systemd import ServiceReporter
from tests.helpers import ROOT


def slot(index: int, state: SlotState, worker: WorkerState | None = None,
         previous: WorkerState | None = None) -> Slot:
    made = Slot(index, placement=None, model="mlp", state=state)
    made.current = SimpleNamespace(state=worker) if worker else None
    made.previous = SimpleNamespace(state=previous) if previous else None
    return made


S, W = SlotState, WorkerState


def test_a_model_is_ready_at_its_minimum_and_by_default_at_all_its_workers():
    slots = [slot(0, S.READY, W.READY), slot(1, S.STARTING, W.LOADING)]
    assert not model_health("mlp", None, slots).ready_enough
    assert model_health("mlp", 1, slots).ready_enough
    assert model_health("mlp", 0, [slot(0, S.BACKOFF)]).ready_enough


def test_an_old_worker_serving_while_its_replacement_starts_counts_but_is_not_settled():
    health = Health((model_health("mlp", None, [slot(0, S.STARTING, W.LOADING, previous=W.READY)]),))
    assert health.ready and not health.settled
    assert health.status_line() == "1/1 workers ready"


def test_a_slot_waiting_for_its_turn_in_a_reloads_roll_is_not_settled_unless_the_roll_halted():
    waiting = slot(1, S.READY, W.READY)
    waiting.current.spec = SimpleNamespace(generation=1)
    waiting.stale_through = 1  # a reload superseded its worker's configuration
    done = slot(0, S.READY, W.READY)
    assert not Health((model_health("mlp", None, [done, waiting]),)).settled
    # Slot 0's new version cannot start (FATAL, its old worker serving): the roll stops there.
    halted = slot(0, S.FATAL, None, previous=W.READY)
    assert Health((model_health("mlp", None, [halted, waiting]),)).settled


def test_status_names_what_it_waits_for_fatal_slots_and_dead_models():
    half = model_health("mlp", None, [slot(0, S.READY, W.READY), slot(1, S.FATAL)])
    dead = Health((model_health("big", 0, [slot(0, S.FATAL), slot(1, S.FATAL)]),))
    assert Health((half,)).status_line() == ("1/2 workers ready; waiting for mlp 1/2 (needs 2); "
                                             "FATAL: mlp#1")
    assert dead.dead == ["big"] and dead.ready  # ready_min 0: dead, yet not waited for
    assert dead.status_line().endswith("FATAL: mlp#0, mlp#1; every worker of 'big' is FATAL")
    # a FATAL slot whose old worker still serves is not dead
    assert not model_health("mlp", None, [slot(0, S.FATAL, previous=W.READY)]).dead


class Recorder:
    def __init__(self) -> None:
        self.sent: list[str] = []

    def ready(self, status: str) -> None:
        self.sent.append(f"READY {status}")

    def status(self, status: str) -> None:
        self.sent.append(f"STATUS {status}")

    def reloading(self, status: str) -> None:
        self.sent.append(f"RELOADING {status}")


def health(ready: int, replacing: int = 0) -> Health:
    slots = [slot(0, S.READY, W.READY, previous=W.READY if replacing else None)
             if ready else slot(0, S.STARTING, W.LOADING)]
    return Health((model_health("mlp", None, slots),))


def test_the_reporter_sends_ready_once_and_each_status_change_once():
    notifier = Recorder()
    reporter = ServiceReporter(notifier)
    for state in (health(0), health(0), health(1), health(1)):
        reporter.update(state, stopping=False)
    assert notifier.sent == ["STATUS 0/1 workers ready; waiting for mlp 0/1 (needs 1)",
                             "READY 1/1 workers ready"]


def test_a_reload_is_closed_by_ready_only_once_it_settled():
    notifier = Recorder()
    reporter = ServiceReporter(notifier)
    reporter.update(health(1), stopping=False)
    reporter.reload_started(health(1))
    reporter.update(health(1, replacing=1), stopping=False)
    reporter.update(health(1), stopping=False)
    assert notifier.sent == ["READY 1/1 workers ready", "RELOADING reloading; 1/1 workers ready",
                             "READY 1/1 workers ready"]


def test_no_ready_while_stopping_and_no_reloading_before_the_first_ready():
    notifier = Recorder()
    reporter = ServiceReporter(notifier)
    reporter.reload_started(health(0))
    reporter.update(health(1), stopping=True)
    assert notifier.sent == ["STATUS 1/1 workers ready"]


def test_ready_min_above_the_worker_count_is_a_config_error(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text('[[models]]\nname = "m"\nsource = "python:a:b"\nworkers = 2\nready_min = 3\n'
                      'warmup = 0\n')
    with pytest.raises(ConfigError, match="ready_min 3 is more than the 2 workers"):
        load_settings(config)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_the_shipped_unit_is_rated_at_most_2_offline():
    report = subprocess.run(["systemd-analyze", "security", "--offline=yes",
                             str(ROOT / "systemd" / "modelwarden.service")],
                            capture_output=True, text=True, timeout=60)
    found = re.search(r"Overall exposure level for modelwarden\.service: ([0-9.]+)",
                      report.stdout + report.stderr)
    if found is None:
        pytest.skip(f"this systemd-analyze cannot rate a unit offline: {report.stderr[-300:]}")
    assert float(found.group(1)) <= 2.0, report.stdout
