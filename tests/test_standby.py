"""Warm standby workers (``standby = N``), end to end: real daemon, real processes, real kills.

A standby is promoted into a slot when the slot's worker dies (SIGKILL), is replaced for
drifting probes, or is recycled by ``max_requests``: the slot's next READY worker is then the
standby's own process (same pid), re-pinned on every thread to the slot's cores, and a new
standby boots. A standby that dies is replaced without the slots noticing; a reload to a new
version replaces the standbys of the old one; a kill storm with standbys loses no request.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from modelwarden.client.client import Client
from tests.faulty import reference
from tests.helpers import Daemon, alive, faulty_model, poll_until, probe_files, rewrite_config
from tests.load import run_load, sigkill_storm
from tests.test_metrics import metrics_url, scrape, value

FAST = {"start_seconds": 0.5, "heartbeat_timeout": 5.0, "kill_grace": 1.0, "timeout": 90.0,
        "backoff_initial": 0.1, "max_start_failures": 20}


def standby_model(name: str, fault: str = "none", workers: int = 1, standby: int = 1,
                  **extra) -> dict:
    return faulty_model(name, fault, workers=workers, standby=standby, **{**FAST, **extra})


def slot_row(daemon: Daemon, worker_id: str) -> dict:
    return next(w for w in daemon.workers() if w["id"] == worker_id)


def warm_standby(daemon: Daemon, model: str) -> dict:
    return poll_until(lambda: next(iter(daemon.workers(model, "STANDBY")), None), 90,
                      message=f"a STANDBY worker of {model}")


def thread_affinities(pid: int) -> dict[int, str]:
    """Cpus_allowed_list of every thread of ``pid``."""
    found = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except OSError:
            continue  # the thread exited meanwhile
        line = next(l for l in status.splitlines() if l.startswith("Cpus_allowed_list:"))
        found[int(tid)] = line.split(":", 1)[1].strip()
    return found


def thread_nice(pid: int) -> dict[int, int]:
    """The nice value of every thread of ``pid`` (field 19 of /proc/<pid>/task/<tid>/stat)."""
    found = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        found[int(tid)] = int(stat[stat.rfind(")") + 2:].split()[16])
    return found


def cpu_list(cores: list[int]) -> str:
    from modelwarden.shared.config import format_cores

    return format_cores(cores)


def promoted_into(daemon: Daemon, worker_id: str, pid: int, timeout: float = 30) -> dict:
    """The slot's row once ``pid`` (a standby) serves in it."""
    return poll_until(lambda: next((w for w in daemon.workers() if w["id"] == worker_id
                                    and w["pid"] == pid and w["state"] == "READY"), None),
                      timeout, interval=0.01, message=f"pid {pid} READY as {worker_id}")


@pytest.mark.parametrize("threads", [
    1, pytest.param(2, marks=pytest.mark.skipif(
        len(os.sched_getaffinity(0)) < 4, reason="2 threads and a spare 2 cores need 4 cores"))])
def test_a_killed_worker_is_replaced_by_its_standby_on_every_thread_of_the_slots_cores(threads):
    # a helper thread of the model's own: promotion must move it too, not only the loop's
    model = standby_model("sb", cores_per_worker=threads, threads=threads,
                          kwargs={"helper_thread": True})
    with Daemon([model], daemon={"metrics": "127.0.0.1:0"}) as daemon:
        daemon.wait_ready()
        standby = warm_standby(daemon, "sb")
        slot = slot_row(daemon, "sb#0")
        assert standby["id"] == "sb#standby0" and standby["standby"] is True
        # two cores, one slot: the standby sleeps on the core the slot does not use
        assert standby["cores"] != slot["cores"], (standby, slot)
        assert set(thread_affinities(standby["pid"]).values()) == {cpu_list(standby["cores"])}
        # it booted in the background (as root it may restore its priority when promoted)
        assert set(thread_nice(standby["pid"]).values()) == ({10} if os.geteuid() == 0 else {0})

        os.kill(slot["pid"], signal.SIGKILL)
        row = promoted_into(daemon, "sb#0", standby["pid"])

        assert row["cores"] == slot["cores"] and row["threads"] == slot["threads"] == threads, row
        threads = thread_affinities(standby["pid"])
        assert len(threads) > 1 and set(threads.values()) == {cpu_list(slot["cores"])}, threads
        assert set(thread_nice(standby["pid"]).values()) == {0}  # serving at full priority
        assert row["promotions"] == 1 and row["promoted_at"] is not None, row
        assert row["generation"] == slot["generation"] + 1
        with Client(daemon.endpoint, timeout=30) as client:
            x = torch.randn(3, 8)
            assert torch.allclose(client.infer("sb", x), reference(x), atol=1e-5)
        # a new standby boots in the background, on the spare core again
        fresh = poll_until(lambda: next((w for w in daemon.workers("sb", "STANDBY")
                                         if w["pid"] != standby["pid"]), None), 90,
                           message="a new standby")
        assert fresh["id"] == "sb#standby1" and fresh["cores"] == standby["cores"]
        assert "promoting standby sb#standby0" in daemon.log()
        url = metrics_url(daemon)
        poll_until(lambda: value(scrape(url), "modelwarden_promotions_total", model="sb") == 1.0,
                   10, message="one promotion counted")
        poll_until(lambda: value(scrape(url), "modelwarden_workers", model="sb",
                                 state="STANDBY") == 1.0, 10, message="the standby in the gauge")


def test_a_promoted_standby_that_dies_at_once_counts_as_a_failed_start_of_its_slot():
    with Daemon([standby_model("crashy", start_seconds=3.0)]) as daemon:
        daemon.wait_ready()
        standby = warm_standby(daemon, "crashy")
        # up longer than start_seconds: only its promotion makes its death a failed start
        poll_until(lambda: slot_row(daemon, standby["id"])["uptime_s"] > 4.0, 30,
                   message="the standby up for 4s")
        os.kill(slot_row(daemon, "crashy#0")["pid"], signal.SIGKILL)
        promoted_into(daemon, "crashy#0", standby["pid"])
        os.kill(standby["pid"], signal.SIGKILL)  # within start_seconds of its promotion
        poll_until(lambda: "slot crashy#0: DEAD -> BACKOFF (failed start 1" in daemon.log(), 30,
                   message="the slot backing off")


def test_a_standby_that_dies_is_replaced_without_touching_the_slots():
    with Daemon([standby_model("calm", workers=2)]) as daemon:
        daemon.wait_ready()
        standby = warm_standby(daemon, "calm")
        before = {w["id"]: (w["pid"], w["restarts"], w["generation"])
                  for w in daemon.workers("calm") if not w.get("standby")}
        os.kill(standby["pid"], signal.SIGKILL)
        fresh = poll_until(lambda: next((w for w in daemon.workers("calm", "STANDBY")
                                         if w["pid"] != standby["pid"]), None), 90,
                           message="a new standby")
        assert fresh["id"] == "calm#standby1"
        after = {w["id"]: (w["pid"], w["restarts"], w["generation"])
                 for w in daemon.workers("calm") if not w.get("standby")}
        assert after == before
        assert all(w["state"] == "READY" for w in daemon.workers("calm") if not w.get("standby"))


def test_a_worker_replaced_for_drift_is_replaced_by_the_standby(tmp_path):
    # ``once``: only the first worker to reach call 31 drifts; the standby, promoted, does not
    model = standby_model("drifty", "drift", kwargs={"after": 30, "scale": 0.5,
                                                     "once": str(tmp_path / "armed")},
                          probe=probe_files(tmp_path, failures=2))
    with Daemon([model]) as daemon:
        daemon.wait_ready()
        standby = warm_standby(daemon, "drifty")
        first = slot_row(daemon, "drifty#0")
        counts = run_load(daemon.endpoint, "drifty", lambda x: x @ torch.zeros(8, 8),
                          clients=1, requests=40)  # outputs not checked: it drifts on purpose
        assert counts.reconciles() and counts.ok == counts.sent, counts
        row = promoted_into(daemon, "drifty#0", standby["pid"], timeout=60)
        assert any("failed probes" in c["cause"] for c in row["restart_causes"]), row
        poll_until(lambda: not alive(first["pid"]), 30, message="the drifting worker gone")


def test_a_worker_recycled_by_max_requests_is_replaced_by_the_standby():
    with Daemon([standby_model("recycled", max_requests=15)]) as daemon:
        daemon.wait_ready()
        standby = warm_standby(daemon, "recycled")
        first = slot_row(daemon, "recycled#0")
        counts = run_load(daemon.endpoint, "recycled", reference, clients=2, requests=15)
        assert counts.ok == counts.sent == 30 and counts.wrong == 0, counts
        row = promoted_into(daemon, "recycled#0", standby["pid"])
        assert any("max_requests" in c["cause"] for c in row["restart_causes"]), row
        poll_until(lambda: not alive(first["pid"]), 30, message="the recycled worker gone")


def test_a_reload_to_a_new_version_replaces_the_standbys_of_the_old_one():
    with Daemon([standby_model("versioned")]) as daemon:
        daemon.wait_ready()
        old = warm_standby(daemon, "versioned")
        new_model = standby_model("versioned", kwargs={"gain": 2.0})
        rewrite_config(daemon, [new_model])
        daemon.command("reload")
        new_version = daemon.status()["models"][0]["version"]
        assert new_version != old["version"]
        fresh = poll_until(lambda: next((w for w in daemon.workers("versioned", "STANDBY")
                                         if w["version"] == new_version), None), 90,
                           message="a standby of the new version")
        assert fresh["pid"] != old["pid"]
        poll_until(lambda: not alive(old["pid"]), 30, message="the old standby gone")
        # the slot rolls to the new version too; no worker of the old one is left
        poll_until(lambda: all(w["version"] == new_version for w in daemon.workers("versioned")
                               if w["pid"]), 90, message="every worker on the new version")


@pytest.mark.slow
def test_a_sigkill_storm_with_standbys_loses_nothing():
    with Daemon([standby_model("storm", workers=2)]) as daemon:
        daemon.wait_ready()
        warm_standby(daemon, "storm")
        counts, kills = sigkill_storm(daemon, "storm", reference)
        assert len(kills) == 12, kills
        assert counts.sent > 100, counts
        assert counts.reconciles(), counts
        assert counts.ok == counts.sent and counts.wrong == 0, counts
        assert "promoting standby" in daemon.log()
        poll_until(lambda: all(m["ready"] == m["workers"] for m in daemon.status()["models"]),
                   90, message="every slot READY again")
