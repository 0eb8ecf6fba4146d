"""The daemon's life as an operator drives it: signals, deadlines, systemd's watchdog, JSON logs.

Each test breaks when the mechanism it is named after breaks: a drain that drops queued requests,
a second signal that does not cut the drain short, a rolling restart (``modelwarden restart``)
that retires before it replaces, a start or drain deadline that is never enforced, a probe latency check that never
fails, a watchdog that never pings, a retry where ``retries = 0`` forbids one.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from modelwarden.client.client import Client, ShuttingDown, WorkerDied
from tests.helpers import ROOT, Daemon, alive, faulty_model, poll_until

pytestmark = pytest.mark.slow

QUICK = {"start_seconds": 0.5, "backoff_initial": 0.1, "kill_grace": 1.0}


def echo(name: str, delay: float, workers: int = 1, **extra) -> dict:
    model = {"name": name, "source": "python:tests.faulty:make_echo",
             "kwargs": {"copy": True, "delay": delay}, "workers": workers, "warmup": 0,
             "cores_per_worker": 1, **QUICK}
    model.update(extra)
    return model


def pending(daemon: Daemon) -> int:
    return daemon.status()["daemon"]["pending"]


def wait_exit(daemon: Daemon, timeout: float) -> int:
    """The daemon's exit code, polled: it must leave by itself within ``timeout``."""
    return poll_until(lambda: daemon.process.poll() is not None and (daemon.process.returncode,),
                      timeout, message="the daemon to exit")[0]


def test_sigterm_serves_what_was_accepted_refuses_new_work_and_exits_zero():
    with Daemon([echo("slow", delay=1.0, workers=1)], daemon={"graceful_timeout": 60}) as daemon:
        daemon.wait_ready()
        with Client(daemon.endpoint, timeout=60) as client:
            x = torch.arange(6.0).reshape(2, 3)
            accepted = [client.submit("slow", x + index) for index in range(3)]  # 1 running, 2 queued
            poll_until(lambda: pending(daemon) == 3, 10, message="three requests accepted")
            daemon.process.send_signal(signal.SIGTERM)
            poll_until(lambda: daemon.status()["daemon"]["stopping"], 10, message="stopping")
            with pytest.raises(ShuttingDown):
                client.infer("slow", x)
            for index, future in enumerate(accepted):
                assert torch.equal(future.result(timeout=30), x + index)
        assert wait_exit(daemon, 30) == 0
        assert "SIGTERM: draining" in daemon.log()


def test_a_second_signal_stops_at_once_and_answers_everything():
    with Daemon([echo("stuck", delay=60.0, workers=1)], daemon={"graceful_timeout": 120}) as daemon:
        daemon.wait_ready()
        with Client(daemon.endpoint, timeout=120) as client:
            futures = [client.submit("stuck", torch.ones(2)) for _ in range(2)]
            poll_until(lambda: pending(daemon) == 2, 10, message="two requests accepted")
            daemon.process.send_signal(signal.SIGTERM)
            poll_until(lambda: daemon.status()["daemon"]["stopping"], 10, message="stopping")
            started = time.monotonic()
            daemon.process.send_signal(signal.SIGINT)
            for future in futures:
                with pytest.raises(ShuttingDown):
                    future.result(timeout=30)
            assert wait_exit(daemon, 30) == 0
            # far less than the 60 s forward or the 120 s graceful_timeout
            assert time.monotonic() - started < 30


def test_graceful_timeout_bounds_the_drain():
    with Daemon([echo("stuck", delay=60.0)], daemon={"graceful_timeout": 1.0}) as daemon:
        daemon.wait_ready()
        with Client(daemon.endpoint, timeout=120) as client:
            future = client.submit("stuck", torch.ones(2))
            poll_until(lambda: pending(daemon) == 1, 10, message="the request accepted")
            daemon.process.send_signal(signal.SIGTERM)
            with pytest.raises(ShuttingDown):
                future.result(timeout=30)
        assert wait_exit(daemon, 30) == 0


def ready_sampler(daemon: Daemon, stop: threading.Event, seen: list, failures: list) -> None:
    """READY workers of the first model, sampled until ``stop``; a failed sample is recorded."""
    while not stop.wait(0.05):
        try:
            seen.append(daemon.status(timeout=10)["models"][0]["ready"])
        except Exception as exc:
            failures.append(repr(exc))


def test_a_rolling_restart_replaces_every_worker_before_retiring_it():
    with Daemon([echo("rolling", delay=0.0, workers=2)]) as daemon:
        daemon.wait_ready()
        before = set(daemon.worker_pids())
        stop, seen, failures = threading.Event(), [], []
        sampler = threading.Thread(target=ready_sampler, args=(daemon, stop, seen, failures))
        sampler.start()
        try:
            assert daemon.command("restart")["restarted"] == ["rolling#0", "rolling#1"]
            poll_until(lambda: len(daemon.workers("rolling", "READY")) == 2
                       and not before & set(daemon.worker_pids()), 90,
                       message="both workers replaced")
        finally:
            stop.set()
            sampler.join(30)
        assert not failures, failures
        assert seen and min(seen) >= 2, f"capacity dipped during the rolling restart: {min(seen)}"
        for pid in before:
            poll_until(lambda: not alive(pid), 30, message=f"old worker {pid} gone")


def test_start_timeout_kills_a_worker_that_never_gets_ready():
    model = faulty_model("stalls", "load_hang", workers=1, start_timeout=1.5, **QUICK)
    with Daemon([model]) as daemon:
        first = poll_until(lambda: daemon.worker_pids() and daemon.worker_pids()[0], 30,
                           message="a worker process")
        poll_until(lambda: not alive(first), 20, message="the stalled worker killed")
        worker = poll_until(lambda: next((w for w in daemon.workers() if w["restart_causes"]), None),
                            20, message="a restart recorded")
        assert "not READY after" in daemon.log()
        assert any("start timeout" in cause["cause"] or "SIG" in cause["cause"]
                   for cause in worker["restart_causes"]), worker


def test_drain_timeout_kills_a_draining_worker_and_its_request_is_retried():
    model = echo("draining", delay=15.0, drain_timeout=0.5)
    with Daemon([model]) as daemon:
        daemon.wait_ready()
        (old,) = daemon.worker_pids()
        with Client(daemon.endpoint, timeout=60) as client:
            future = client.submit("draining", torch.ones(3))
            poll_until(lambda: daemon.workers()[0]["inflight"] == 1, 10, message="request running")
            daemon.command("restart", target="draining")
            # replaced once the new one is READY, then drained: the old one holds a 15 s request,
            # so only the 0.5 s drain deadline can end it this early
            poll_until(lambda: not alive(old), 12, interval=0.05, message="the drain deadline")
            assert torch.equal(future.result(timeout=30), torch.ones(3))  # retried elsewhere
        assert "drain timeout" in daemon.log()


def test_a_probe_slower_than_its_baseline_fails_and_the_worker_is_replaced():
    # batch 1 is only ever the probe: the worker turns slow on probes after warm-up and baseline
    model = faulty_model("sluggish", "slow", workers=1, heartbeat_timeout=60, **QUICK,
                         kwargs={"after": 8, "only_batch": 1, "delay": 0.3})
    model["probe"] = {"interval": 0.2, "timeout": 30, "failures": 2, "latency_factor": 2.0,
                      "latency_slack_ms": 50}
    with Daemon([model]) as daemon:
        daemon.wait_ready()
        first = daemon.workers()[0]["pid"]
        replaced = poll_until(lambda: next((w for w in daemon.workers()
                                            if w["pid"] not in (first, None)), None),
                              60, message="a replacement for the slow worker")
        assert any("failed probes" in cause["cause"] and "baseline" in cause["cause"]
                   for cause in replaced["restart_causes"]), replaced["restart_causes"]


def test_watchdog_pings_reach_notify_socket(tmp_path):
    path = str(tmp_path / "notify.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(path)
    listener.settimeout(0.2)
    received: list[str] = []
    stop = threading.Event()

    def read() -> None:  # as systemd does: read every datagram as it comes
        while not stop.is_set():
            try:
                received.append(listener.recv(4096).decode())
            except socket.timeout:
                continue

    reader = threading.Thread(target=read)
    reader.start()
    try:
        env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "400000"}  # ping every 0.2 s
        with Daemon([echo("dog", delay=0.0)], env=env) as daemon:
            daemon.wait_ready()
            poll_until(lambda: sum(m.split("\n").count("WATCHDOG=1") for m in received) >= 5,
                       10, message="five watchdog pings")
            assert any("READY=1" in message for message in received)
    finally:
        stop.set()
        reader.join(5)
        listener.close()


def test_a_notify_socket_nobody_reads_does_not_stop_the_daemon(tmp_path):
    path = str(tmp_path / "deaf.sock")
    deaf = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    deaf.bind(path)  # bound, never read: it fills after a few datagrams
    try:
        env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "100000"}
        with Daemon([echo("deaf", delay=0.0)], env=env) as daemon:
            daemon.wait_ready()
            with Client(daemon.endpoint, timeout=10) as client:
                for _ in range(3):
                    assert torch.equal(client.infer("deaf", torch.ones(2)), torch.ones(2))
            assert daemon.stop() == 0
    finally:
        deaf.close()


def test_json_logs_are_one_object_a_line_from_every_process():
    with Daemon([echo("logs", delay=0.0)], daemon={"log_format": "json"}) as daemon:
        daemon.wait_ready()
        poll_until(lambda: "READY on" in daemon.log(), 10, message="the worker's READY line")
        assert daemon.stop() == 0
        entries = [json.loads(line) for line in daemon.log().splitlines() if line.strip()]
        assert entries
        for entry in entries:
            assert {"ts", "level", "role", "pid", "logger", "msg"} <= set(entry), entry
        roles = {entry["role"] for entry in entries}
        assert "supervisor" in roles and "logs#0" in roles, roles


def test_retries_zero_answers_worker_died_instead_of_retrying():
    model = echo("once", delay=30.0, workers=2, retries=0)
    with Daemon([model]) as daemon:
        daemon.wait_ready()
        with Client(daemon.endpoint, timeout=60) as client:
            future = client.submit("once", torch.ones(2))
            holder = poll_until(lambda: next((w for w in daemon.workers() if w["inflight"]), None),
                                10, message="a worker holding the request")
            os.kill(holder["pid"], signal.SIGKILL)
            with pytest.raises(WorkerDied):
                future.result(timeout=20)


def test_a_worker_stuck_in_forward_dies_with_a_sigkilled_supervisor():
    # Idle workers notice their parent's pipe close; one stuck in forward polls nothing, so only
    # the kernel's parent-death signal (PR_SET_PDEATHSIG) can take it down with the supervisor.
    with Daemon([echo("stuck", delay=120.0)]) as daemon:
        daemon.wait_ready()
        (worker,) = daemon.worker_pids()
        with Client(daemon.endpoint, timeout=200) as client:
            client.submit("stuck", torch.ones(2))
            poll_until(lambda: daemon.workers()[0]["inflight"] == 1, 10, message="stuck in forward")
            os.kill(daemon.process.pid, signal.SIGKILL)
            daemon.process.wait(30)
            poll_until(lambda: not alive(worker), 15, message="the stuck worker gone with its parent")


def test_the_restart_and_stop_commands_drive_the_daemon():
    with Daemon([echo("cli", delay=0.0, workers=1)]) as daemon:
        daemon.wait_ready()
        (old,) = daemon.worker_pids()
        command = [sys.executable, "-m", "modelwarden"]
        restart = subprocess.run([*command, "restart", "cli#0", "--admin", daemon.admin],
                                 capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert restart.returncode == 0, restart.stderr
        assert restart.stdout.strip() == "restarting: cli#0"
        poll_until(lambda: daemon.workers("cli", "READY") and old not in daemon.worker_pids(), 60,
                   message="cli#0 replaced by the restart command")
        stop = subprocess.run([*command, "stop", "--admin", daemon.admin],
                              capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert stop.returncode == 0 and stop.stdout.strip() == "stopping", stop.stderr
        assert wait_exit(daemon, 30) == 0
