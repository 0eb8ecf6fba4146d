"""Helpers for tests of several daemons: one CURVE key set for the fleet, daemon settings, a load
of client threads that counts every answer, and the kill-and-restart scenario both the loopback
test and the namespace test run.

Run as a script (``python -m tests.fleet ENDPOINTS...``), it is the client of the namespace test:
a load over the given endpoints until a stop file appears, then one JSON line of counts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Callable

import torch
import zmq

from tests.faulty import reference
from tests.helpers import ROOT, Daemon, faulty_model, poll_until
from tests.load import Counts

MODEL = "fleetm"  # a name that a capture cannot hold by chance


def keygen(directory: Path, name: str) -> tuple[Path, Path]:
    result = subprocess.run([sys.executable, "-m", "modelwarden", "keygen", str(directory), "--name", name],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return directory / f"{name}.key", directory / f"{name}.key_secret"


class FleetKeys:
    """One server key pair shared by every daemon (as a Kubernetes Secret would be), the allowed
    client alice, and mallory whose key no daemon allows."""

    def __init__(self, root: Path) -> None:
        self.server_public, self.server_secret = keygen(root / "server", "server")
        self.alice_public, self.alice_secret = keygen(root / "alice", "alice")
        self.mallory_public, self.mallory_secret = keygen(root / "mallory", "mallory")
        self.allowed = root / "allowed"
        self.allowed.mkdir()
        shutil.copy(self.alice_public, self.allowed)
        for path in root.rglob("*"):  # daemons and clients may run as root in other namespaces
            path.chmod(path.stat().st_mode | 0o044 if path.is_file() else path.stat().st_mode | 0o055)

    def curve(self) -> dict:
        return {"server_secret_key": str(self.server_secret), "client_keys": str(self.allowed)}

    def alice(self) -> dict:
        return {"server_key": str(self.server_public), "client_key": str(self.alice_secret)}


def fleet_model(**extra: Any) -> dict:
    """20 ms a request: under load a daemon always holds some, so a kill always loses some."""
    extra.setdefault("kwargs", {"fault": "slow", "delay": 0.02})
    return faulty_model(MODEL, "none", workers=1, probe={"interval": 0}, **extra)


def fleet_daemon(keys: FleetKeys, tcp: str, models: list[dict] | None = None,
                 prefix: list[str] = ()) -> Daemon:
    """A daemon with a CURVE tcp frontend (beside its ipc one), started by ``start``."""
    daemon = Daemon(models or [fleet_model()], daemon={"curve": keys.curve()}, extra_frontends=[tcp])
    daemon.tcp = tcp
    daemon.prefix = list(prefix)
    return daemon


def served(daemon: Daemon) -> int:
    """Client requests this daemon process has answered (0 for a fresh one)."""
    return sum(worker["requests"] for worker in daemon.status()["workers"])


class Load:
    """``threads`` threads calling ``infer`` on one shared client until stopped; every answer
    counted (tests.load.Counts) and checked against the reference."""

    def __init__(self, client, threads: int = 4) -> None:
        self.client = client
        self.counts = Counts()
        self.failures: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(seed,), daemon=True)
                         for seed in range(threads)]

    def _run(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        while not self._stop.is_set():
            x = torch.randn(4, 8, generator=generator)
            try:
                y = self.client.infer(MODEL, x)
                right = torch.allclose(y, reference(x), rtol=1e-4, atol=1e-5)
                outcome = "ok" if right else "wrong"
            except Exception as exc:  # every failure is counted, whatever its kind
                outcome = repr(exc)
            with self._lock:
                self.counts.sent += 1
                if outcome == "ok":
                    self.counts.ok += 1
                elif outcome == "wrong":
                    self.counts.wrong += 1
                else:
                    self.failures.append(outcome)

    def __enter__(self) -> "Load":
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)
            assert not thread.is_alive(), "a load thread hangs"

    def summary(self) -> dict:
        with self._lock:
            return {"sent": self.counts.sent, "ok": self.counts.ok, "wrong": self.counts.wrong,
                    "failures": list(self.failures[:5]), "failed": len(self.failures)}


@contextlib.contextmanager
def all_running(daemons: list):
    """Start every daemon, then wait until each is READY; clean them all up afterwards."""
    try:
        for daemon in daemons:
            daemon.start()
        for daemon in daemons:
            daemon.wait_ready()
        yield daemons
    finally:
        for daemon in daemons:
            daemon.cleanup()


def kill_and_restart_under_load(first: Daemon, second: Daemon, load_done: Callable[[], dict],
                                restart: Callable[[Daemon], None]) -> dict:
    """Both daemons serve; SIGKILL ``first``: ``second`` takes the load; restart ``first``: it
    takes its share again. ``load_done`` stops the load and returns its summary. Returns what
    was seen, for the caller's asserts."""
    poll_until(lambda: served(first) >= 20 and served(second) >= 20, 60,
               message="both daemons serving the load")
    poll_until(lambda: first.status()["daemon"]["pending"] > 0, 30,
               message="the daemon to kill holding requests")
    first.process.kill()
    first.process.wait(30)
    after_kill = served(second)
    poll_until(lambda: served(second) >= after_kill + 100, 60,
               message="the surviving daemon taking the whole load")
    restart(first)
    first.wait_ready()
    poll_until(lambda: served(first) >= 20, 60, message="the restarted daemon serving again")
    second_before = served(second)
    poll_until(lambda: served(second) >= second_before + 20, 60,
               message="the surviving daemon still serving: the load spreads")
    return load_done()


def _client_main() -> None:
    """The client of the namespace test, in its own network namespace: ``--requests N`` sends N
    requests and reports; without it, a load of ``--threads`` threads runs until the stop file
    exists. Either way the last line is one JSON object of counts."""
    parser = argparse.ArgumentParser()
    parser.add_argument("endpoints")
    parser.add_argument("--server-key")
    parser.add_argument("--client-key")
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--requests", type=int)
    parser.add_argument("--stop-file")
    parser.add_argument("--threads", type=int, default=4)
    args = parser.parse_args()
    from modelwarden.client.connect import connect

    with connect(args.endpoints, timeout=args.timeout, server_key=args.server_key,
                 client_key=args.client_key) as client:
        summary = _requests(client, args.requests) if args.requests else _load(client, args)
        summary["health"] = client.health() if hasattr(client, "health") else {}
    print(json.dumps(summary), flush=True)


def _requests(client, count: int) -> dict:
    outcomes: dict[str, int] = {}
    for seed in range(count):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))
        try:
            right = torch.allclose(client.infer(MODEL, x), reference(x), rtol=1e-4, atol=1e-5)
            outcome = "ok" if right else "wrong"
        except Exception as exc:
            outcome = type(exc).__name__
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    return {"outcomes": outcomes}


def _load(client, args) -> dict:
    idle = zmq.Poller()
    with Load(client, args.threads) as load:
        print("started", flush=True)
        while not os.path.exists(args.stop_file):
            idle.poll(100)
    return load.summary()


if __name__ == "__main__":
    _client_main()
