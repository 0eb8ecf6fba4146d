"""The ``ipc://`` frontend the loop serves itself (supervisor/routing/zmtpfront.py, shared/zmtp.py):
the real daemon, real libzmq clients, real Unix sockets. The daemon speaks ZMTP on its socket
file without libzmq (its greeting and READY come whole, before the client says anything, which
libzmq's ROUTER never does); bytes that are not ZMTP close that connection alone, logged; a
connection that never completes its handshake is closed at the deadline and its shares given
back; a reply to a connection whose queue holds REPLY_HWM chunks is dropped, as a ROUTER drops
what passes its ZMQ_SNDHWM. The Python client speaks ZMTP on ``ipc://`` too (client/local.py):
a process that serves its requests there runs no libzmq thread, and it is a DEALER to any
ROUTER, libzmq's included."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import zmq

from modelwarden import Client
from modelwarden.client.local import LocalConnection
from modelwarden.shared import protocol
from modelwarden.shared.zmtp import greeting, ready
from modelwarden.supervisor.routing import zmtpfront
from modelwarden.supervisor.routing.connections import ConnectionGuard
from modelwarden.supervisor.routing.zmtpfront import HANDSHAKE_S, ZmtpFrontend
from tests.helpers import ROOT, Daemon, mlp_model
from tests.test_local import closed_by_daemon


@pytest.fixture(scope="module")
def daemon():
    with Daemon([mlp_model("mlp", workers=1)]) as started:
        started.wait_ready()
        yield started


def raw_connection(endpoint: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(15)
    sock.connect(endpoint[len("ipc://"):])
    return sock


def read_exactly(sock: socket.socket, count: int) -> bytes:
    data = b""
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        assert chunk, f"closed after {len(data)} bytes"
        data += chunk
    return data


def test_the_daemon_speaks_zmtp_itself_and_greets_first(daemon):
    assert daemon.endpoint.startswith("ipc://")
    sock = raw_connection(daemon.endpoint)
    try:
        # libzmq's ROUTER sends 10 bytes and waits for the peer's; the loop sends all of its
        # half of the handshake at once.
        assert read_exactly(sock, 64 + len(ready(b"ROUTER"))) == greeting() + ready(b"ROUTER")
    finally:
        sock.close()


@pytest.mark.parametrize("kind", [zmq.DEALER, zmq.REQ])
def test_libzmq_dealer_and_req_clients_get_what_the_client_library_gets(daemon, kind):
    x = torch.randn(3, 64)
    with Client(daemon.endpoint, timeout=30) as client:
        want = client.infer("mlp", x)
    header = {"type": "infer", "id": 5, "model": "mlp", "inputs": 0,
              "tensors": [{"dtype": "float32", "shape": [3, 64], "frame": 0}]}
    sock = zmq.Context.instance().socket(kind)
    try:
        sock.connect(daemon.endpoint)
        sock.send_multipart([protocol.SIGNATURE, protocol.pack(header), x.numpy().tobytes()])
        assert sock.poll(30_000)
        signature, reply, payload = sock.recv_multipart()
        assert signature == protocol.SIGNATURE and protocol.unpack_header(reply)["id"] == 5
        got = np.frombuffer(payload, np.float32).reshape(want.shape)
        assert np.array_equal(got, want.numpy())
    finally:
        sock.close(0)


@pytest.mark.parametrize("garbage", [b"GET / HTTP/1.1\r\n\r\n", greeting() + ready(b"PUB")])
def test_bytes_that_are_not_zmtp_close_that_connection_alone(daemon, garbage):
    with Client(daemon.endpoint, timeout=30) as bystander:
        x = torch.randn(2, 64)
        want = bystander.infer("mlp", x)
        sock = raw_connection(daemon.endpoint)
        try:
            sock.sendall(garbage)
            assert closed_by_daemon(sock)
        finally:
            sock.close()
        assert torch.equal(bystander.infer("mlp", x), want)
    assert f"frontend.sock: closed 1 connection(s) from uid {os.geteuid()}" in daemon.log()


# -- the frontend's own rules, on a listener of its own (its loop's hooks are the test's) -----------


class Loop:
    """What the arbiter's loop gives a frontend: its poller (callbacks by descriptor) and its
    timers (run when the test says the time has come)."""

    def __init__(self) -> None:
        self.handlers: dict = {}
        self.timers: list = []

    def watch(self, fd, handler) -> None:
        self.handlers[fd] = handler

    def unwatch(self, fd) -> None:
        self.handlers.pop(fd, None)

    def later(self, delay, then) -> None:
        self.timers.append((delay, then))


@pytest.fixture
def front(tmp_path):
    loop = Loop()
    guard = ConnectionGuard(fd_limit=4096, max_connections=None)
    received = []
    frontend = ZmtpFrontend(
        0, f"ipc://{tmp_path}/frontend.sock", None, 1 << 20, guard,
        lambda index, sock, frames, key, identity, max_bytes: received.append(frames),
        watch=loop.watch, unwatch=loop.unwatch, want_write=lambda fd, on: None,
        want_read=lambda fd, on: None, later=loop.later, clock=lambda: 0.0)
    frontend.listen()
    listener = frontend._listener.fileno()
    yield frontend, loop, guard, listener, received
    frontend.close()


def test_a_connection_that_never_completes_its_handshake_is_closed_at_the_deadline(front):
    frontend, loop, guard, listener, _ = front
    silent = raw_connection(frontend.endpoint)
    talking = raw_connection(frontend.endpoint)
    try:
        loop.handlers[listener]()  # accept both
        loop.handlers[listener]()
        assert frontend.connections == 2 and guard.connections == 2
        talking.sendall(greeting() + ready(b"DEALER"))
        for fd, handler in list(loop.handlers.items()):
            if fd != listener:
                handler()
        assert [delay for delay, _ in loop.timers] == [HANDSHAKE_S, HANDSHAKE_S]
        for _, due in loop.timers:
            due()
        assert frontend.connections == 1 and guard.connections == 1  # the silent one went
        assert closed_by_daemon(silent)
    finally:
        silent.close()
        talking.close()


def test_replies_past_the_hwm_are_dropped_as_a_router_drops_them(front, monkeypatch):
    frontend, loop, guard, listener, received = front
    monkeypatch.setattr(zmtpfront, "REPLY_HWM", 3)
    sock = raw_connection(frontend.endpoint)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        loop.handlers[listener]()
        [connection] = frontend._by_rid.values()
        link = connection.link
        sock.sendall(greeting() + ready(b"DEALER") + b"\x00\x02hi")
        loop.handlers[link.fd]()
        assert received == [[connection.rid, b"hi"]]
        big = bytes(1 << 20)  # each fills what the kernel holds for the peer
        for _ in range(10):
            frontend.send_parts([connection.rid, big])
        # The first went partly into the socket (its rest is one chunk), the second waits
        # whole (its head and its part): three chunks, the mark; the other eight were dropped.
        assert len(link.out) == 3
        assert sum(memoryview(chunk).nbytes for chunk in link.out) < 2 * len(big) + 9
    finally:
        sock.close()


# -- the client's side ------------------------------------------------------------------------------


def test_a_client_on_ipc_runs_no_libzmq_thread(daemon):
    script = (
        "import os, torch\n"
        "from modelwarden import Client\n"
        f"with Client({daemon.endpoint!r}, timeout=30) as client:\n"
        "    client.infer('mlp', torch.randn(2, 64))\n"
        "    client.submit('mlp', torch.randn(2, 64)).result(30)\n"
        "    names = [open(f'/proc/self/task/{task}/comm').read().strip()\n"
        "             for task in os.listdir('/proc/self/task')]\n"
        "print(sorted(names))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ZMQbg" not in done.stdout, done.stdout  # libzmq's I/O and reaper threads


def test_the_clients_zmtp_talks_to_a_libzmq_router(tmp_path):
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    endpoint = f"ipc://{tmp_path}/router.sock"
    router.bind(endpoint)
    connection = LocalConnection(endpoint)
    try:
        connection.deliver([[b"MWP1", b"hello", bytes(100_000)]], time.monotonic() + 10)
        # libzmq takes a message before its own READY went out for a protocol error: the
        # client holds it until the router's READY is read.
        deadline = time.monotonic() + 10
        while not router.poll(10):
            assert time.monotonic() < deadline, "the message never reached the router"
            connection.pump(10)
        assert connection.link.open and not connection.link.held
        rid, *frames = router.recv_multipart()
        assert frames == [b"MWP1", b"hello", bytes(100_000)]
        router.send_multipart([rid, b"MWP1", b"reply"])
        reply = connection.receive(10)
        assert [bytes(frame) for frame in reply] == [b"MWP1", b"reply"]
    finally:
        connection.close()
        router.close(0)
        context.term()
