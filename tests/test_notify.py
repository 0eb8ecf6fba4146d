"""What the daemon tells systemd, read from a real notify socket (an AF_UNIX datagram socket the
test binds and names in $NOTIFY_SOCKET, as systemd does): READY=1 only once every model has its
minimum of READY workers, STATUS= naming what it waits for and what is FATAL, a distinct exit
code for a model beyond help with ``fatal_exits``, RELOADING=1 + MONOTONIC_USEC=, then READY=1,
around a SIGHUP.

Each test fails when its mechanism breaks: READY=1 sent at spawn (the old behaviour), ready_min
ignored, FATAL slots left out of STATUS=, fatal_exits ignored or exiting 0, a reload without
RELOADING=1 or whose READY=1 comes before the old workers are gone.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import pytest

from modelwarden.shared.states import EXIT_MODEL_FATAL
from tests.helpers import (Daemon, alive, children_of, cmdline, faulty_model, poll_until,
                           rewrite_config)

pytestmark = pytest.mark.slow

QUICK = {"start_seconds": 0.5, "backoff_initial": 0.1, "kill_grace": 1.0}


class NotifySocket:
    """A bound datagram socket read by a thread, as systemd reads it: every message kept, in
    order, as a dict of its KEY=VALUE lines."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.messages: list[dict[str, str]] = []
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(path)
        self._sock.settimeout(0.1)
        self._stop = threading.Event()
        self._reader = threading.Thread(target=self._read, name="notify-reader")
        self._reader.start()

    @property
    def env(self) -> dict[str, str]:
        return {"NOTIFY_SOCKET": self.path}

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                data = self._sock.recv(4096).decode()
            except socket.timeout:
                continue
            self.messages.append(dict(line.split("=", 1) for line in data.split("\n") if "=" in line))

    def wait_for(self, predicate, timeout: float, message: str, after: int = 0) -> tuple[int, dict]:
        """(index, message) of the first message from index ``after`` on that matches."""
        def found():
            return next(((index, m) for index, m in enumerate(self.messages[after:], after)
                         if predicate(m)), None)
        return poll_until(found, timeout, message=f"{message}; got {self.messages}")

    def close(self) -> None:
        self._stop.set()
        self._reader.join(5)
        self._sock.close()


@pytest.fixture
def notify(tmp_path):
    listener = NotifySocket(str(tmp_path / "notify.sock"))
    try:
        yield listener
    finally:
        listener.close()


def statuses(messages: list[dict]) -> list[str]:
    return [m["STATUS"] for m in messages if "STATUS" in m]


def test_ready_is_sent_only_once_every_worker_is_ready(notify):
    model = faulty_model("heavy", workers=2, kwargs={"load_delay": 3.0}, **QUICK)
    with Daemon([model], env=notify.env) as daemon:
        index, ready = notify.wait_for(lambda m: m.get("READY") == "1", 90, "READY=1")
        assert ready["STATUS"] == "2/2 workers ready", ready
        assert len(daemon.workers("heavy", "READY")) == 2
        waited = statuses(notify.messages[:index])
        assert any("waiting for heavy 0/2 (needs 2)" in line for line in waited), waited
        assert ready["MAINPID"] == str(daemon.process.pid)


def test_ready_min_lets_a_model_start_without_waiting_for_all_its_workers(notify):
    never = faulty_model("never", "load_hang", workers=1, ready_min=0, **QUICK)
    serving = faulty_model("serving", workers=1, **QUICK)
    with Daemon([never, serving], env=notify.env) as daemon:
        _, ready = notify.wait_for(lambda m: m.get("READY") == "1", 90, "READY=1")
        assert ready["STATUS"] == "1/2 workers ready", ready
        assert daemon.workers("serving", "READY") and not daemon.workers("never", "READY")


def broken_and_healthy() -> list[dict]:
    broken = faulty_model("broken", "load_error", workers=2, max_start_failures=1, ready_min=0,
                          **QUICK)
    healthy = faulty_model("healthy", workers=1, **QUICK)
    return [broken, healthy]


def test_status_names_fatal_slots_and_the_daemon_serves_on(notify):
    with Daemon(broken_and_healthy(), env=notify.env) as daemon:
        _, fatal = notify.wait_for(lambda m: "every worker of 'broken' is FATAL" in m.get("STATUS", ""),
                                   90, "a STATUS naming the FATAL model")
        assert "FATAL: broken#0, broken#1" in fatal["STATUS"], fatal
        assert any(m.get("READY") == "1" for m in notify.messages)  # ready_min = 0: not waited for
        daemon.wait_ready(models=["healthy"])
        assert daemon.process.poll() is None


def test_fatal_exits_stops_the_daemon_with_its_own_exit_code(notify):
    with Daemon(broken_and_healthy(), daemon={"fatal_exits": True}, env=notify.env) as daemon:
        code = poll_until(lambda: daemon.process.poll() is not None and (daemon.process.returncode,),
                          90, message="the daemon to exit")[0]
        assert code == EXIT_MODEL_FATAL == 4
        assert "every worker of broken is FATAL: stopping with exit code 4" in daemon.log()
        said = statuses(notify.messages)
        assert any("every worker of 'broken' is FATAL" in line for line in said), said
        assert any(m.get("STOPPING") == "1" for m in notify.messages)


def test_a_reload_is_framed_by_reloading_and_ready(notify):
    model = faulty_model("rolled", workers=2, kwargs={"load_delay": 1.0}, **QUICK)
    with Daemon([model], env=notify.env) as daemon:
        first, _ = notify.wait_for(lambda m: m.get("READY") == "1", 90, "the first READY=1")
        before = daemon.worker_pids()
        rewrite_config(daemon, [{**model, "version": "2"}])  # a new version rolls every worker
        daemon.process.send_signal(signal.SIGHUP)
        start, reloading = notify.wait_for(lambda m: m.get("RELOADING") == "1", 30, "RELOADING=1",
                                           after=first + 1)
        now_usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        assert 0 <= now_usec - int(reloading["MONOTONIC_USEC"]) < 30_000_000, reloading
        notify.wait_for(lambda m: m.get("READY") == "1", 90, "READY=1 after the reload", after=start + 1)
        # READY=1 closes the reload only once every old worker has handed over and left
        gone = [pid for pid in before if not alive(pid)]
        assert gone == before, f"old workers still running at READY=1: {set(before) - set(gone)}"
        assert not set(before) & set(daemon.worker_pids())
        assert any(line.startswith("reloading; ") for line in statuses(notify.messages[start:]))


def test_the_resource_tracker_is_reaped_before_the_supervisor_exits():
    """Under KillMode=mixed whatever is left in the unit when the supervisor exits is SIGKILLed:
    the supervisor stops multiprocessing's resource tracker itself and reaps it, so once the
    supervisor is gone the tracker is not even a zombie (left to itself it would still be
    shutting down, orphaned)."""
    with Daemon([faulty_model("plain", workers=1, **QUICK)]) as daemon:
        daemon.wait_ready()
        (tracker,) = [pid for pid in children_of(daemon.process.pid) if "resource_tracker" in cmdline(pid)]
        assert daemon.stop() == 0
        assert not os.path.exists(f"/proc/{tracker}"), f"resource tracker {tracker} outlived the supervisor"
