"""Several "machines" on one host, for real: Linux network namespaces made by the test.

Topology (all addresses in 10.213.0.0/24, inside the namespaces only; the host's own network is
never touched)::

    <ns>-d1 (daemon 1, 10.213.0.1) --veth--+
    <ns>-d2 (daemon 2, 10.213.0.2) --veth--+-- bridge in <ns>-sw (the "switch")
    <ns>-c  (client,   10.213.0.3) --veth--+

Each daemon runs as ``ip netns exec <ns>-dN python -m modelwarden serve`` with CURVE on its tcp
frontend; the client runs as ``ip netns exec <ns>-c python -m tests.fleet``. The test process
itself reads each daemon's status over its ipc control socket (the file system is shared). A
capture (tests/capture.py, a raw AF_PACKET socket) on the client's veth sees what the wire holds.
Everything is removed in the fixture's finally; without root or ``ip netns``, the module skips.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fleet import (MODEL, FleetKeys, all_running, fleet_daemon, kill_and_restart_under_load,
                         served)
from tests.helpers import ROOT, poll_until, readline_within

PORT = 5555
REFUSED = "CURVE: refused"
DEADLINE_S = 10.0  # the cut-link test's request deadline
CUT_S = DEADLINE_S + 5.0  # and how long its link stays cut


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


class Network:
    """The namespaces, veths and bridge; ``remove`` deletes all of them."""

    def __init__(self) -> None:
        self.tag = "mw" + secrets.token_hex(2)
        self.switch = f"{self.tag}-sw"
        self.hosts = {"d1": "10.213.0.1", "d2": "10.213.0.2", "c": "10.213.0.3"}
        self.namespaces: list[str] = []

    def ns(self, host: str) -> str:
        return f"{self.tag}-{host}"

    def build(self) -> None:
        for name in (self.switch, *(self.ns(host) for host in self.hosts)):
            ip("netns", "add", name)
            self.namespaces.append(name)
            ip("-n", name, "link", "set", "lo", "up")
        ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        ip("-n", self.switch, "link", "set", "br0", "up")
        for host, address in self.hosts.items():
            inside, port = f"eth-{host}", f"{self.tag}{host}"  # veth names: 15 bytes at most
            ip("-n", self.ns(host), "link", "add", inside, "type", "veth", "peer", "name", port,
               "netns", self.switch)
            ip("-n", self.ns(host), "addr", "add", f"{address}/24", "dev", inside)
            ip("-n", self.ns(host), "link", "set", inside, "up")
            ip("-n", self.switch, "link", "set", port, "master", "br0")
            ip("-n", self.switch, "link", "set", port, "up")

    def exec(self, host: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns(host)]

    def remove(self) -> None:
        # Deleting a namespace deletes its veth ends, and a veth's peer with it.
        for name in reversed(self.namespaces):
            ip("netns", "del", name, check=False)
        self.namespaces.clear()


@pytest.fixture(scope="module")
def network():
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (ip netns add)")
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command (iproute2) to make network namespaces")
    network = Network()
    try:
        try:
            network.build()
        except subprocess.CalledProcessError as exc:
            pytest.skip(f"cannot create network namespaces here: {exc.stderr.strip()}")
        yield network
    finally:
        network.remove()
        leftover = ip("netns", "list").stdout
        assert network.tag not in leftover, leftover


class NamespacedDaemon:
    """A fleet daemon started inside a network namespace (``ip netns exec`` execs, so the
    process is the daemon itself: a kill reaches it)."""

    @staticmethod
    def make(keys: FleetKeys, network: Network, host: str):
        daemon = fleet_daemon(keys, f"tcp://{network.hosts[host]}:{PORT}")

        def start():
            daemon._log = open(daemon.log_path, "ab")
            daemon.process = subprocess.Popen(
                [*network.exec(host), sys.executable, "-m", "modelwarden", "serve",
                 "--config", str(daemon.config_path)],
                cwd=ROOT, env=daemon.env, stdout=daemon._log, stderr=subprocess.STDOUT)
            return daemon

        daemon.start = start
        return daemon


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> FleetKeys:
    return FleetKeys(tmp_path_factory.mktemp("netnskeys"))


@pytest.fixture(scope="module")
def daemons(network, keys):
    with all_running([NamespacedDaemon.make(keys, network, host) for host in ("d1", "d2")]) as started:
        yield started


def endpoints(network: Network) -> str:
    return ",".join(f"tcp://{network.hosts[host]}:{PORT}" for host in ("d1", "d2"))


def client(network: Network, *args: str, **popen) -> subprocess.Popen:
    return subprocess.Popen([*network.exec("c"), sys.executable, "-m", "tests.fleet",
                             endpoints(network), *args],
                            cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, **popen)


def run_client(network: Network, *args: str, timeout: float = 120) -> dict:
    process = client(network, *args)
    out, err = process.communicate(timeout=timeout)
    assert process.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


@contextlib.contextmanager
def load_client(network: Network, keys: FleetKeys, stop: Path, *options: str):
    """A 4-thread load from the client's namespace, running until ``stop_load``; killed if the
    test fails first."""
    load = client(network, "--threads", "4", "--stop-file", str(stop), *options, *key_args(keys))
    try:
        assert readline_within(load.stdout, 60).strip() == "started"
        yield load
    finally:
        if load.poll() is None:
            load.kill()
            load.wait(30)


def assert_none_lost(summary: dict, more_than: int) -> None:
    assert summary["failed"] == 0 and summary["wrong"] == 0, summary
    assert summary["sent"] == summary["ok"] > more_than, summary


def stop_load(load: subprocess.Popen, stop: Path) -> dict:
    """Stop a ``--stop-file`` load client; its summary of counts."""
    stop.touch()
    out, err = load.communicate(timeout=120)
    assert load.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def key_args(keys: FleetKeys, client_secret: Path | None = None) -> list[str]:
    return ["--server-key", str(keys.server_public), "--client-key",
            str(client_secret or keys.alice_secret)]


def capture(network: Network, out: Path, stop: Path) -> subprocess.Popen:
    process = subprocess.Popen([*network.exec("c"), sys.executable, "-m", "tests.capture",
                                "eth-c", str(out), str(stop)],
                               cwd=ROOT, text=True, stdout=subprocess.PIPE)
    assert readline_within(process.stdout, 30).strip() == "capturing"
    return process


def test_the_namespaces_are_separate_machines(network, daemons):
    # The host cannot reach the daemons' addresses: they exist only inside the namespaces.
    assert "10.213.0." not in ip("-4", "addr").stdout
    ping = subprocess.run([*network.exec("c"), "ip", "route", "get", network.hosts["d1"]],
                          capture_output=True, text=True, check=True)
    assert "eth-c" in ping.stdout


def test_the_right_key_serves_from_both_and_the_wire_holds_no_plaintext(network, daemons, keys,
                                                                         tmp_path):
    before = [served(daemon) for daemon in daemons]
    out, stop = tmp_path / "capture.bin", tmp_path / "stop"
    capturing = capture(network, out, stop)
    try:
        summary = run_client(network, "--requests", "60", *key_args(keys))
    finally:
        stop.touch()
        capturing.wait(30)
    assert summary["outcomes"] == {"ok": 60}, summary
    assert summary["health"] == {f"tcp://{network.hosts[h]}:{PORT}": "UP" for h in ("d1", "d2")}
    gained = [served(daemon) - count for daemon, count in zip(daemons, before)]
    assert sum(gained) == 60 and min(gained) > 0, gained
    wire = out.read_bytes()
    assert len(wire) > 60 * 200, len(wire)  # the capture saw the traffic: 60 requests and replies
    assert b"CURVE" in wire  # the ZMTP greeting names its mechanism in the clear: we see the stream
    for plaintext in (b"MWP1", MODEL.encode(), b"timeout_ms", b"tensors", b"float32"):
        assert plaintext not in wire, plaintext


def test_no_key_or_a_wrong_key_gets_nothing_and_the_daemons_log_it(network, daemons, keys):
    before = [served(daemon) for daemon in daemons]
    no_key = run_client(network, "--requests", "1", "--timeout", "2")
    wrong_key = run_client(network, "--requests", "1", "--timeout", "2",
                           *key_args(keys, keys.mallory_secret))
    assert no_key["outcomes"] == {"Timeout": 1} and wrong_key["outcomes"] == {"Timeout": 1}
    assert set(no_key["health"].values()) | set(wrong_key["health"].values()) <= {"DOWN", "UNKNOWN"}
    assert [served(daemon) for daemon in daemons] == before
    mallory = keys.mallory_public.read_text()
    for daemon in daemons:
        poll_until(lambda: f"handshake(s) on {daemon.tcp}" in daemon.log(), 70,
                   message="the handshake without CURVE refused and logged")
        refused = [line for line in daemon.log().splitlines() if REFUSED in line]
        assert refused and network.hosts["c"] in refused[0], refused
        assert any(key in refused[0] for key in mallory.split('"') if len(key) == 40), refused


def test_sigkill_one_daemon_under_load_then_restart_it(network, daemons, keys, tmp_path):
    stop = tmp_path / "stop"
    with load_client(network, keys, stop) as load:
        summary = kill_and_restart_under_load(daemons[0], daemons[1], lambda: stop_load(load, stop),
                                              restart=lambda daemon: daemon.start())
    assert_none_lost(summary, more_than=100)


@pytest.mark.slow  # about 30 s: the link stays cut for CUT_S
def test_a_silent_cut_link_is_caught_by_heartbeats_and_the_daemon_behind_it_serves_once_it_is_back(
        network, daemons, keys, tmp_path):
    """d1's cable pulled out of the switch, and nothing on the client's side says so: its
    neighbour entry for d1 is pinned, so no ARP failure turns into an error on the connection
    (no RST, no FIN, no EHOSTUNREACH): the packets just vanish. Only the client's heartbeats can
    notice the silence; the requests held behind the cut are sent to the other daemon, nothing
    fails; once the link is back, the daemon behind it serves again."""
    from tests.fleet import served

    first, second = daemons
    stop = tmp_path / "stop"
    port = f"{network.tag}d1"  # d1's port on the switch
    mac = json.loads(ip("-n", network.ns("d1"), "-j", "link", "show", "eth-d1").stdout)[0]["address"]
    ip("-n", network.ns("c"), "neigh", "replace", network.hosts["d1"], "lladdr", mac, "dev", "eth-c",
       "nud", "permanent")
    # A request deadline shorter than the cut: a request left waiting behind the cut fails with
    # TIMEOUT; one re-sent after the heartbeats' 5 s is answered by d2 well within it.
    with load_client(network, keys, stop, "--timeout", str(DEADLINE_S)) as load:
        poll_until(lambda: served(first) >= 20 and served(second) >= 20, 60,
                   message="both daemons serving the load")
        ip("-n", network.switch, "link", "set", port, "down")
        try:
            cut_at, across = time.monotonic(), served(second)
            poll_until(lambda: served(second) >= across + 200, 60,
                       message="the other daemon taking the whole load across the cut")
            # Nothing new reaches d1 while it is cut off (what was on the wire waits with it).
            held = served(first)
            poll_until(lambda: time.monotonic() - cut_at > CUT_S and served(second) >= across + 300,
                       CUT_S + 60, message=f"the link cut for {CUT_S}s, longer than a deadline")
            assert served(first) == held
        finally:
            ip("-n", network.switch, "link", "set", port, "up")
            ip("-n", network.ns("c"), "neigh", "del", network.hosts["d1"], "dev", "eth-c", check=False)
        back = served(first)
        poll_until(lambda: served(first) >= back + 20, 60,
                   message="the daemon behind the link serving again once it is back")
        summary = stop_load(load, stop)
    assert_none_lost(summary, more_than=300)
