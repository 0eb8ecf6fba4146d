"""CURVE on tcp frontends, end to end: keys made by the real ``modelwarden keygen``, a real daemon
on 127.0.0.1, real clients with right and wrong keys, SIGHUP key rotation, the configuration
rules, and a byte capture of the tcp traffic through a relay that proves it holds no plaintext."""

from __future__ import annotations

import json
import selectors
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import zmq
from zmq.auth.certs import load_certificate
from zmq.utils.monitor import recv_monitor_message

from modelwarden.shared import protocol
from modelwarden.client.client import AsyncClient, Client, Timeout
from tests.helpers import ROOT, Daemon, free_port, mlp_model, poll_until, render_config
from tests.test_config import assert_config_error
from tests.test_config import serve_check as check_config_file

MODEL = "curvemlp"  # a name that a capture cannot hold by chance
REFUSED = "CURVE: refused"


def keygen(directory: Path, name: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "modelwarden", "keygen", str(directory), "--name", name],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)


def make_pair(directory: Path, name: str) -> tuple[Path, Path]:
    result = keygen(directory, name)
    assert result.returncode == 0, result.stderr
    return directory / f"{name}.key", directory / f"{name}.key_secret"



def z85_public(path: Path) -> str:
    return load_certificate(path)[0].decode()


def served(daemon: Daemon) -> int:
    return sum(worker["requests"] for worker in daemon.status()["workers"])


def sample_input() -> torch.Tensor:
    # Distinctive bytes: a capture holding any 16 of them in a row holds the tensor.
    return torch.arange(8 * 64, dtype=torch.float32).reshape(8, 64) * 0.731 + 1000.25


def model_config() -> dict:
    return mlp_model(MODEL, workers=1, probe={"interval": 0})


class Keys:
    def __init__(self, root: Path) -> None:
        self.server_public, self.server_secret = make_pair(root / "server", "server")
        self.alice_public, self.alice_secret = make_pair(root / "alice", "alice")
        self.mallory_public, self.mallory_secret = make_pair(root / "mallory", "mallory")
        self.allowed = root / "allowed"
        self.allowed.mkdir()
        shutil.copy(self.alice_public, self.allowed)


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Keys:
    return Keys(tmp_path_factory.mktemp("keys"))


@pytest.fixture(scope="module")
def curve_daemon(keys):
    port = free_port()
    tcp = f"tcp://127.0.0.1:{port}"
    curve = {"server_secret_key": str(keys.server_secret), "client_keys": str(keys.allowed)}
    with Daemon([model_config()], daemon={"curve": curve}, extra_frontends=[tcp]) as running:
        running.wait_ready()
        running.tcp, running.port = tcp, port
        yield running


def alice(daemon: Daemon, keys: Keys, endpoint: str | None = None, **extra) -> Client:
    return Client(endpoint or daemon.tcp, server_key=keys.server_public,
                  client_key=keys.alice_secret, **extra)


# -- keygen -------------------------------------------------------------------------------------


def test_keygen_writes_a_private_pair_and_never_overwrites(tmp_path):
    public, secret = make_pair(tmp_path / "new" / "keys", "node1")
    assert stat.S_IMODE((tmp_path / "new" / "keys").stat().st_mode) == 0o700
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    public_key, secret_key = load_certificate(secret)
    assert load_certificate(public) == (public_key, None) and len(secret_key) == 40
    before = secret.read_bytes()
    again = keygen(tmp_path / "new" / "keys", "node1")
    assert again.returncode != 0 and "refusing to overwrite" in again.stderr
    assert secret.read_bytes() == before


# -- the right keys -----------------------------------------------------------------------------


def test_the_right_keys_are_served(curve_daemon, keys):
    x = sample_input()
    with alice(curve_daemon, keys) as client:
        assert client.hello()["shm"]["enabled"] is False
        assert client.infer(MODEL, x).shape == (8, 10)


def test_keys_from_the_environment_and_the_async_client(curve_daemon, keys, monkeypatch):
    import asyncio

    monkeypatch.setenv("MODELWARDEN_SERVER_KEY", str(keys.server_public))
    monkeypatch.setenv("MODELWARDEN_CLIENT_KEY", str(keys.alice_secret))
    with Client(curve_daemon.tcp) as client:
        assert client.infer(MODEL, sample_input()).shape == (8, 10)

    async def main():
        async with AsyncClient(curve_daemon.tcp, server_key=z85_public(keys.server_public)) as client:
            return await client.infer(MODEL, sample_input())

    assert asyncio.run(main()).shape == (8, 10)


def test_infer_command_with_keys(curve_daemon, keys, tmp_path):
    np.save(tmp_path / "x.npy", sample_input().numpy())
    command = [sys.executable, "-m", "modelwarden", "infer", MODEL, "-i", str(tmp_path / "x.npy"),
               "--endpoint", curve_daemon.tcp, "--timeout", "2"]
    ok = subprocess.run([*command, "--server-key", str(keys.server_public), "--client-key",
                         str(keys.alice_secret)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert "[8, 10]" in ok.stdout
    refused = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1
    assert "check server_key/client_key" in refused.stderr


# -- wrong or missing keys ----------------------------------------------------------------------


def refused_lines(daemon: Daemon, public: Path) -> list[str]:
    key = z85_public(public)
    return [line for line in daemon.log().splitlines() if REFUSED in line and key in line]


def assert_no_answer(client: Client) -> None:
    with client, pytest.raises(Timeout, match="check server_key/client_key"):
        client.infer(MODEL, sample_input())


def test_wrong_or_missing_keys_get_nothing_and_refusals_are_logged_once(curve_daemon, keys, monkeypatch):
    monkeypatch.delenv("MODELWARDEN_SERVER_KEY", raising=False)
    monkeypatch.delenv("MODELWARDEN_CLIENT_KEY", raising=False)
    before = served(curve_daemon)
    assert_no_answer(Client(curve_daemon.tcp, timeout=1.0))  # NULL against a CURVE server
    assert_no_answer(Client(curve_daemon.tcp, timeout=1.0, server_key=keys.mallory_public,
                            client_key=keys.alice_secret))  # an allowed key, the wrong server
    # Both fail inside libzmq's handshake, before ZAP: logged per endpoint, once a minute.
    poll_until(lambda: f"handshake(s) on {curve_daemon.tcp}" in curve_daemon.log(), 10,
               message="the refused handshakes in the log")
    for _ in range(3):  # an unknown client key, three connections: one line
        assert_no_answer(Client(curve_daemon.tcp, timeout=1.0, server_key=keys.server_public,
                                client_key=keys.mallory_secret))
    assert served(curve_daemon) == before
    lines = refused_lines(curve_daemon, keys.mallory_public)
    assert len(lines) == 1, lines
    assert "127.0.0.1" in lines[0] and "WARNING" in lines[0]
    assert not refused_lines(curve_daemon, keys.alice_public)
    with alice(curve_daemon, keys) as client:  # the daemon serves on
        assert client.infer(MODEL, sample_input()).shape == (8, 10)


FRESH_KEYS = 60


def refused_by_zap(context: zmq.Context, endpoint: str, server_public: bytes) -> bool:
    """One handshake with a key pair made for it alone: whether the server refused it (the
    client's monitor sees the server's ERROR: ZAP said no)."""
    public, secret = zmq.curve_keypair()
    sock = context.socket(zmq.DEALER)
    sock.linger = 0
    sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = server_public, public, secret
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    try:
        sock.connect(endpoint)
        return bool(monitor.poll(10_000)) and recv_monitor_message(monitor)["event"] == \
            zmq.EVENT_HANDSHAKE_FAILED_AUTH
    finally:
        sock.disable_monitor()
        monitor.close()
        sock.close()


def test_fresh_keys_from_one_address_get_one_line(keys):
    """A scan of keys is one source: one WARNING a minute for its address, not one per key."""
    tcp = f"tcp://127.0.0.1:{free_port()}"
    curve = {"server_secret_key": str(keys.server_secret), "client_keys": str(keys.allowed)}
    with Daemon([], daemon={"curve": curve}, extra_frontends=[tcp]) as daemon:
        poll_until(lambda: daemon.status(), 30, message="the daemon answering")
        context = zmq.Context()
        try:
            server_public = z85_public(keys.server_public).encode()
            refused = sum(refused_by_zap(context, tcp, server_public) for _ in range(FRESH_KEYS))
        finally:
            context.term()
        assert refused == FRESH_KEYS
        lines = [line for line in daemon.log().splitlines() if REFUSED in line]
        assert len(lines) == 1, lines[:3]
        assert "from 127.0.0.1" in lines[0] and "1 refusal(s) from this address" in lines[0]
        assert daemon.status()["daemon"]["pid"] == daemon.process.pid


def test_a_key_file_that_cannot_be_used_is_a_clear_error(curve_daemon, keys):
    with pytest.raises(ValueError, match="both keys"):
        Client(curve_daemon.tcp, server_key=keys.server_public)
    with pytest.raises(ValueError, match="holds no secret key"):
        Client(curve_daemon.tcp, server_key=keys.server_public, client_key=keys.alice_public)
    with pytest.raises(ValueError, match="cannot read CURVE key file"):
        Client(curve_daemon.tcp, server_key="/nonexistent.key", client_key=keys.alice_secret)


# -- the capture --------------------------------------------------------------------------------


class Relay(threading.Thread):
    """Forwards tcp connections from 127.0.0.1:<port> to 127.0.0.1:<target>, recording every
    byte in both directions: the view of anyone on the path."""

    def __init__(self, target: int) -> None:
        super().__init__(name="relay", daemon=True)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.target = target
        self._recorded = bytearray()
        self._lock = threading.Lock()
        self._stop_read, self._stop_write = socket.socketpair()

    def recorded(self) -> bytes:
        with self._lock:
            return bytes(self._recorded)

    def run(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self.listener, selectors.EVENT_READ)
        selector.register(self._stop_read, selectors.EVENT_READ)
        peers: dict[socket.socket, socket.socket] = {}
        while True:
            for key, _ in selector.select():
                if key.fileobj is self._stop_read:
                    for sock in [*peers, self.listener, self._stop_read, self._stop_write]:
                        sock.close()
                    return
                if key.fileobj is self.listener:
                    near, _ = self.listener.accept()
                    far = socket.create_connection(("127.0.0.1", self.target))
                    peers[near], peers[far] = far, near
                    selector.register(near, selectors.EVENT_READ)
                    selector.register(far, selectors.EVENT_READ)
                elif key.fileobj in peers:
                    self._forward(key.fileobj, peers, selector)

    def _forward(self, source: socket.socket, peers: dict, selector) -> None:
        try:
            data = source.recv(65536)
        except OSError:
            data = b""
        if not data:
            other = peers.pop(source)
            peers.pop(other, None)
            for sock in (source, other):
                selector.unregister(sock)
                sock.close()
            return
        with self._lock:
            self._recorded += data
        peers[source].sendall(data)

    def stop(self) -> None:
        self._stop_write.send(b"x")
        self.join(5)


def secrets_in(capture: bytes, x: torch.Tensor) -> list[str]:
    raw = x.numpy().tobytes()
    found = [name for name, needle in (("signature", protocol.SIGNATURE), ("infer", b"infer"),
                                       ("model name", MODEL.encode())) if needle in capture]
    if any(raw[i:i + 16] in capture for i in range(0, len(raw), 16)):
        found.append("input tensor bytes")
    return found


def capture_one_request(port: int, **client_args) -> bytes:
    relay = Relay(port)
    relay.start()
    try:
        with Client(relay.endpoint, **client_args) as client:
            assert client.infer(MODEL, sample_input()).shape == (8, 10)
    finally:
        relay.stop()
    return relay.recorded()


def test_curve_traffic_holds_no_plaintext(curve_daemon, keys):
    capture = capture_one_request(curve_daemon.port, server_key=keys.server_public,
                                  client_key=keys.alice_secret)
    assert len(capture) > sample_input().numel() * 4  # the request did cross the relay
    assert secrets_in(capture, sample_input()) == []


@pytest.fixture(scope="module")
def plaintext_daemon():
    loopback, exposed = free_port(), free_port()
    frontends = [f"tcp://127.0.0.1:{loopback}", f"tcp://0.0.0.0:{exposed}"]
    with Daemon([model_config()], daemon={"frontend": frontends, "allow_plaintext_tcp": True}) as running:
        running.wait_ready()
        running.loopback, running.exposed = loopback, exposed
        yield running


def test_the_capture_sees_plaintext_on_a_plaintext_frontend(plaintext_daemon):
    capture = capture_one_request(plaintext_daemon.loopback)
    assert secrets_in(capture, sample_input()) == ["signature", "infer", "model name",
                                                   "input tensor bytes"]


def test_allow_plaintext_tcp_starts_with_a_warning_per_exposed_frontend(plaintext_daemon):
    warnings = [line for line in plaintext_daemon.log().splitlines() if "PLAINTEXT tcp frontend" in line]
    assert len(warnings) == 1 and "WARNING" in warnings[0], warnings
    assert f"0.0.0.0:{plaintext_daemon.exposed}" in warnings[0]


# -- rotation -----------------------------------------------------------------------------------


def reload_counter(daemon: Daemon):
    """reloaded(n): whether the daemon has reloaded its client keys to n keys since this call
    (the module's daemon logs the same line at every test's reload)."""
    line = "client keys reloaded: {} key(s) allowed now"
    before = {n: daemon.log().count(line.format(n)) for n in (1, 2, 3)}
    return lambda n: daemon.log().count(line.format(n)) > before[n]


def test_sighup_rereads_client_keys_without_a_restart(curve_daemon, keys, tmp_path):
    bob_public, bob_secret = make_pair(tmp_path / "bob", "bob")
    bob = dict(server_key=keys.server_public, client_key=bob_secret)
    assert_no_answer(Client(curve_daemon.tcp, timeout=1.0, **bob))
    pid = curve_daemon.process.pid
    reloaded = reload_counter(curve_daemon)
    shutil.copy(bob_public, keys.allowed)
    curve_daemon.process.send_signal(signal.SIGHUP)
    poll_until(lambda: reloaded(2), message="the daemon to reload its client keys")
    with Client(curve_daemon.tcp, timeout=30.0, **bob) as client:
        assert client.infer(MODEL, sample_input()).shape == (8, 10)
    reloaded = reload_counter(curve_daemon)
    (keys.allowed / bob_public.name).unlink()  # revoke: the next handshake is refused
    curve_daemon.process.send_signal(signal.SIGHUP)
    poll_until(lambda: reloaded(1), message="the daemon to reload its client keys again")
    assert_no_answer(Client(curve_daemon.tcp, timeout=1.0, **bob))
    assert curve_daemon.process.pid == pid and curve_daemon.process.poll() is None


REFUSED_KINDS = ["infer", "submit", "async", "several"]


def test_a_refused_handshake_never_holds_a_client_past_its_deadline_and_it_recovers(
        curve_daemon, keys, tmp_path):
    """libzmq never reconnects after a handshake the daemon refused, and its DEALER then takes
    no message: every client sends without waiting, so the next request still ends in Timeout
    at its deadline, and once the daemon allows the key the same client object is served
    (client/connection.py gives up the dead socket for a new one). Each client runs in its own
    process (tests/refused.py): one that waits for ever is this test's timeout, not a hang."""
    carol_public, carol_secret = make_pair(tmp_path / "carol", "carol")
    clients = {kind: subprocess.Popen(
        [sys.executable, "-m", "tests.refused", kind, curve_daemon.tcp, str(keys.server_public),
         str(carol_secret), MODEL], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True) for kind in REFUSED_KINDS}
    try:
        for kind, process in clients.items():
            line = line_within(process, 60)  # each call is bounded: 2 x (1 s + the grace)
            assert json.loads(line) == {"refused": ["Timeout", "Timeout"]}, (kind, line)
        reloaded = reload_counter(curve_daemon)
        shutil.copy(carol_public, keys.allowed)
        curve_daemon.process.send_signal(signal.SIGHUP)
        poll_until(lambda: reloaded(2), message="the daemon to reload its client keys")
        for kind, process in clients.items():
            out, err = process.communicate("allowed\n", timeout=120)
            assert process.returncode == 0, (kind, err)
            assert json.loads(out.splitlines()[-1]) == {"allowed": "ok"}, (kind, out, err)
    finally:
        for process in clients.values():
            process.kill()
            process.wait()
        reloaded = reload_counter(curve_daemon)
        (keys.allowed / carol_public.name).unlink(missing_ok=True)
        curve_daemon.process.send_signal(signal.SIGHUP)
        poll_until(lambda: reloaded(1), message="the daemon to forget carol's key")


def line_within(process: subprocess.Popen, timeout: float) -> str:
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        assert selector.select(timeout), f"{process.args[3]}: no line within {timeout}s (a client waiting for ever?)"
    line = process.stdout.readline()
    assert line, f"{process.args[3]} ended: {process.stderr.read()}"
    return line


# -- configuration ------------------------------------------------------------------------------


def serve_check(tmp_path: Path, daemon: dict, env: dict | None = None) -> subprocess.CompletedProcess:
    path = tmp_path / "mw.toml"
    path.write_text(render_config({"runtime_dir": str(tmp_path / "run"), **daemon}, [model_config()]))
    return check_config_file(path, env)


@pytest.mark.parametrize("host", ["0.0.0.0", "*", "10.1.2.3", "eth0"])
def test_exposed_plaintext_tcp_is_a_config_error(tmp_path, host):
    result = serve_check(tmp_path, {"frontend": [f"tcp://{host}:5555"]})
    assert_config_error(result, "daemon.frontend", f"tcp://{host}:5555", "allow_plaintext_tcp",
                        "daemon.curve")


@pytest.mark.parametrize("host", ["127.0.0.1", "127.9.9.9", "localhost"])
def test_loopback_plaintext_tcp_is_allowed(tmp_path, host):
    result = serve_check(tmp_path, {"frontend": [f"tcp://{host}:5555"]})
    assert result.returncode == 0, result.stderr


def test_control_endpoint_on_tcp_is_a_config_error(tmp_path):
    assert_config_error(serve_check(tmp_path, {"control": "tcp://127.0.0.1:5556"}), "daemon.control", "ipc://")


def test_client_key_variables_are_not_config_overrides(tmp_path):
    env = {"MODELWARDEN_SERVER_KEY": "/x.key", "MODELWARDEN_CLIENT_KEY": "/y.key_secret"}
    assert serve_check(tmp_path, {}, env).returncode == 0


def test_unreadable_curve_keys_are_config_errors_naming_the_file(tmp_path, keys):
    tcp = {"frontend": ["tcp://0.0.0.0:5555"]}
    missing = tmp_path / "nope.key_secret"
    result = serve_check(tmp_path, {**tcp, "curve": {"server_secret_key": str(missing),
                                                     "client_keys": str(keys.allowed)}})
    assert_config_error(result, "daemon.curve.server_secret_key", str(missing))
    result = serve_check(tmp_path, {**tcp, "curve": {"server_secret_key": str(keys.server_public),
                                                     "client_keys": str(keys.allowed)}})
    assert_config_error(result, "daemon.curve.server_secret_key", "holds no secret key")
    broken = tmp_path / "clients"
    broken.mkdir()
    (broken / "eve.key").write_text("not a certificate\n")
    result = serve_check(tmp_path, {**tcp, "curve": {"server_secret_key": str(keys.server_secret),
                                                     "client_keys": str(broken)}})
    assert_config_error(result, "daemon.curve.client_keys", str(broken / "eve.key"))
    result = serve_check(tmp_path, {**tcp, "curve": {"server_secret_key": str(keys.server_secret),
                                                     "client_keys": str(keys.allowed)}})
    assert result.returncode == 0, result.stderr


def test_a_curve_client_is_known_by_its_key_and_held_to_its_share(keys):
    """The identity of a CURVE client is its key's file name, which the ZAP handler gives libzmq
    as the User-Id (supervisor/routing/identity.py): its requests count against that share."""
    from modelwarden.shared.errors import Overloaded

    port = free_port()
    tcp = f"tcp://127.0.0.1:{port}"
    curve = {"server_secret_key": str(keys.server_secret), "client_keys": str(keys.allowed)}
    slow = {"name": "slow", "source": "python:tests.faulty:make_echo", "workers": 1, "warmup": 0,
            "kwargs": {"delay": 1.0}}
    with Daemon([slow], daemon={"curve": curve, "max_requests_per_identity": 1},
                extra_frontends=[tcp]) as daemon:
        daemon.wait_ready()
        with alice(daemon, keys, tcp, timeout=20) as client:
            first = client.submit("slow", torch.ones(2))
            poll_until(lambda: any(row["identity"] == "key:alice" and row["requests"] == 1
                                   for row in daemon.status()["daemon"]["identities"]), 10,
                       message="alice's request counted under her key")
            with pytest.raises(Overloaded, match=r"key:alice holds 1 requests in flight"):
                client.infer("slow", torch.ones(2))
            assert torch.equal(first.result(), torch.ones(2))
