"""shared/zmtp.py against libzmq itself and against hostile bytes: libzmq's DEALER and REQ complete
the handshake with it and exchange messages of every size both ways, a heartbeat's PING is
answered, a silent peer's replies wait in order; bytes that are not ZMTP 3 with NULL break the
link at once, saying what they were; a message past the bounds is read past, not held, and
handed on for a typed refusal. Also run uncompiled (tests/test_compiled.py)."""

from __future__ import annotations

import random
import select
import socket
import threading
import time

import pytest
import zmq

from modelwarden.shared import zmtp
from modelwarden.shared.link import GROW_FROM, SMALL_BELOW
from modelwarden.shared.zmtp import (COMMAND, LONG, MAX_COMMAND, MORE, OPEN, ZmtpLink, command,
                                     frame_head, greeting, property_bytes, ready)
from tests.test_unit_link import receive_all

MAX_BYTES = 1 << 30


def router_link(sock: socket.socket, **kwargs) -> ZmtpLink:
    bounds = {"max_bytes": MAX_BYTES, "max_parts": 64, "buffer_bytes": 16 * 1024, **kwargs}
    link = ZmtpLink(sock, b"ROUTER", (b"DEALER", b"REQ"), **bounds)
    link.greet()
    return link


def read_until_broken(link: ZmtpLink, timeout: float = 5.0) -> str:
    deadline = time.monotonic() + timeout
    while not link.broken:
        assert time.monotonic() < deadline, "the link took the bytes"
        select.select([link.fd], [], [], 0.1)
        link.receive()
    return link.error


@pytest.fixture
def zmq_peer(tmp_path):
    """(make(kind, **options) -> (libzmq socket, our link on its connection))."""
    context = zmq.Context()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    path = tmp_path / "z.sock"
    listener.bind(str(path))
    listener.listen(4)
    made = []

    def make(kind, **options):
        peer = context.socket(kind)
        for name, value in options.items():
            peer.setsockopt(getattr(zmq, name), value)
        peer.connect(f"ipc://{path}")
        conn, _ = listener.accept()
        link = router_link(conn)
        made.append((peer, link))
        return peer, link

    yield make
    for peer, link in made:
        peer.close(0)
        link.close()
    listener.close()
    context.term()


def raw_pair(**kwargs) -> tuple[ZmtpLink, socket.socket]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    theirs.settimeout(5)
    return router_link(ours, **kwargs), theirs


def handshaken(**kwargs) -> tuple[ZmtpLink, socket.socket]:
    """Our link, and a raw peer that has sent its greeting and a DEALER's READY."""
    link, peer = raw_pair(**kwargs)
    peer.sendall(greeting() + ready(b"DEALER"))
    assert receive_all(link, 0) == [] and link.receive() == []
    assert link.open
    return link, peer


def read_exactly(peer: socket.socket, count: int) -> bytes:
    data = b""
    while len(data) < count:
        chunk = peer.recv(count - len(data))
        assert chunk, "the link closed"
        data += chunk
    return data


# -- libzmq's own sockets -----------------------------------------------------------------------


@pytest.mark.parametrize("kind", [zmq.DEALER, zmq.REQ])
def test_libzmq_sockets_handshake_and_messages_of_every_size_go_both_ways_whole(zmq_peer, kind):
    rng = random.Random(3)
    sizes = [0, 1, 255, 256, 1000, SMALL_BELOW - 1, SMALL_BELOW, 3 * SMALL_BELOW + 5]
    peer, link = zmq_peer(kind)
    for round_ in range(12 if kind == zmq.DEALER else 6):
        message = [rng.randbytes(rng.choice(sizes)) for _ in range(rng.randint(1, 5))]
        peer.send_multipart(message)
        (got,) = receive_all(link, 1)
        expected = [b"", *message] if kind == zmq.REQ else message  # REQ's delimiter
        assert [bytes(frame) for frame in got] == expected
        assert link.peer_type == (b"REQ" if kind == zmq.REQ else b"DEALER")
        link.send(list(got))  # REQ strips the delimiter that went out and came back
        assert peer.poll(5000), f"round {round_}: no reply"
        assert peer.recv_multipart() == message


def test_a_heartbeating_libzmq_peer_is_answered_and_stays_connected(zmq_peer):
    peer, link = zmq_peer(zmq.DEALER, HEARTBEAT_IVL=30, HEARTBEAT_TIMEOUT=150)
    monitor = peer.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        deadline = time.monotonic() + 1.0  # more than six of its heartbeat timeouts
        while time.monotonic() < deadline:
            select.select([link.fd], [], [], 0.05)
            assert link.receive() == [] and not link.broken, link.error
        assert not monitor.poll(0), "libzmq gave the connection up: its PINGs went unanswered"
        peer.send_multipart([b"still", b"here"])
        assert [bytes(f) for f in receive_all(link, 1)[0]] == [b"still", b"here"]
    finally:
        peer.disable_monitor()
        monitor.close(0)


def test_a_peer_that_does_not_read_has_its_replies_queued_in_order_and_flushed(zmq_peer):
    peer, link = zmq_peer(zmq.DEALER, RCVHWM=1, RCVBUF=4096)
    peer.send(b"go")
    receive_all(link, 1)
    replies = [[b"%d" % index, bytes(8192)] for index in range(400)]
    for reply in replies:
        link.send(reply)
    assert link.pending, "3 MiB went into a 4 KiB receive buffer"
    got = []
    deadline = time.monotonic() + 10
    while len(got) < len(replies):
        assert time.monotonic() < deadline, f"{len(got)} replies came"
        link.flush()
        if peer.poll(10):
            got.append(peer.recv_multipart())
    assert got == replies and not link.pending


def test_small_messages_of_bytes_wait_as_one_chunk_and_tracked_parts_as_they_are():
    assert zmtp.framed([b"MWP1", b"header"]) == [frame_head(MORE, 4) + b"MWP1" + frame_head(0, 6) + b"header"]
    tracked = zmq.Frame(b"x" * 10, track=True)
    chunks = zmtp.framed([b"MWP1", tracked])
    assert chunks[-1] is tracked and len(chunks) == 4


def test_frame_heads_are_short_below_256_bytes_and_long_from_it():
    assert frame_head(0, 255) == b"\x00\xff"
    assert frame_head(MORE, 256) == bytes([MORE | LONG]) + (256).to_bytes(8, "big")
    assert greeting()[:11] == b"\xff" + bytes(7) + b"\x01\x7f\x03" and len(greeting()) == 64
    assert greeting()[12:16] == b"NULL"


# -- PING, and bytes that are not ZMTP -----------------------------------------------------------


def test_a_ping_is_answered_with_a_pong_carrying_its_context():
    link, peer = handshaken()
    read_exactly(peer, 64 + len(ready(b"ROUTER")))
    peer.sendall(command(b"PING", b"\x00\x0a" + b"context-of-16-by"))
    assert receive_all(link, 0) == [] and link.receive() == []
    assert read_exactly(peer, len(command(b"PONG", b"context-of-16-by"))) == command(
        b"PONG", b"context-of-16-by")
    peer.sendall(command(b"PONG", b"") + frame_head(0, 2) + b"ok")  # a PONG is read past
    assert [bytes(f) for f in receive_all(link, 1)[0]] == [b"ok"]


GREETING = greeting()


@pytest.mark.parametrize("garbage, said", [
    (b"\x01\x00MWP1", "ZMTP 1.0 is not spoken"),  # a ZMTP 1.0 peer's first frame
    (GREETING[:9] + b"\x7e", "ZMTP 1.0 is not spoken"),
    (GREETING[:10] + b"\x02\x00", "ZMTP 2.x"),
    (GREETING[:12] + b"CURVE".ljust(20, b"\0") + GREETING[32:], "'CURVE' mechanism"),
    (GREETING + ready(b"PUB"), "socket type b'PUB'"),
    (GREETING + command(b"READY", b""), "socket type b'none'"),
    (GREETING + command(b"READY", b"\x0bSocket-Type\x00\x00\x01\x00DEALER"), "runs past"),
    (GREETING + frame_head(0, 4) + b"MWP1", "before the handshake's READY"),
    (GREETING + command(b"PING", b"\x00\x01"), "in the handshake"),
    (GREETING + ready(b"DEALER") + b"\x08\x01x", "reserved flags 0x08"),
    (GREETING + ready(b"DEALER") + bytes([COMMAND | MORE, 5]) + b"\x04PING", "command frame with MORE"),
    (GREETING + ready(b"DEALER") + bytes([COMMAND | LONG]) + (MAX_COMMAND + 1).to_bytes(8, "big"),
     f"a command of {MAX_COMMAND + 1} bytes"),
    (GREETING + ready(b"DEALER") + command(b"SUBSCRIBE", b""), "the command b'SUBSCRIBE'"),
    (GREETING + ready(b"DEALER") + command(b"ERROR", b"\x04oops"), "ERROR 'oops'"),
    (GREETING + ready(b"DEALER") + command(b"", b""), "a command without a name"),
    (GREETING + ready(b"DEALER") + bytes([0, 2, 0xFF]), None),  # incomplete: waits, no error
], ids=lambda value: value if isinstance(value, str) else "incomplete" if value is None else None)
def test_bytes_that_are_not_zmtp_break_the_link_saying_what_they_were(garbage, said):
    link, peer = raw_pair()
    peer.sendall(garbage)
    if said is None:
        select.select([link.fd], [], [], 1)
        assert link.receive() == [] and not link.broken
        return
    assert said in read_until_broken(link)


def test_a_frame_past_max_bytes_breaks_the_link_at_its_header():
    link, peer = handshaken(max_bytes=1 << 20)
    peer.sendall(bytes([LONG]) + (1 << 40).to_bytes(8, "big"))  # and none of its bytes
    assert f"a frame of {1 << 40} bytes" in read_until_broken(link)


def test_a_declared_frame_costs_only_what_was_sent():
    link, peer = handshaken()
    peer.sendall(bytes([LONG]) + (512 << 20).to_bytes(8, "big") + bytes(100_000))
    deadline = time.monotonic() + 5
    while link.big is None or link.big[3] < 100_000:
        assert time.monotonic() < deadline and not link.broken, link.error
        select.select([link.fd], [], [], 0.1)
        assert link.receive() == []
    assert len(link.big[2]) <= 2 * max(GROW_FROM, 100_000)


@pytest.mark.parametrize("first", [b"", b"MWP1"])
def test_a_message_past_its_bounds_is_read_past_not_held_and_said_then_the_next_comes(first):
    link, peer = handshaken(max_parts=8, max_bytes=200_000)
    too_many = [first] + [b"x"] * 12
    too_big = [first, bytes(150_000), bytes(100_000)]
    stream = b"".join(frame_head(MORE if index < len(message) - 1 else 0, len(frame)) + frame
                      for message in (too_many, too_big, [b"next"])
                      for index, frame in enumerate(message))
    writer = threading.Thread(target=peer.sendall, args=(stream,))  # more than the socket holds
    writer.start()
    got = receive_all(link, 3)
    writer.join()
    delimited = first == b""
    assert got[0] == (13, 16 - 4 * delimited, delimited)
    assert got[1] == (3, 250_004 - 4 * delimited, delimited)
    assert [bytes(f) for f in got[2]] == [b"next"]
    assert not link.frames and not link.discarding


def test_a_closed_peer_is_eof_after_what_it_wrote():
    link, peer = handshaken()
    read_exactly(peer, 64 + len(ready(b"ROUTER")))  # a close with unread bytes is a reset
    peer.sendall(frame_head(0, 3) + b"bye")
    peer.close()
    deadline = time.monotonic() + 5
    got = []
    while not link.eof:
        assert time.monotonic() < deadline
        select.select([link.fd], [], [], 0.1)
        got.extend(link.receive())
    assert [bytes(f) for f in got[0]] == [b"bye"]


def test_our_greeting_and_ready_are_what_libzmq_is_sent():
    link, peer = raw_pair()
    assert read_exactly(peer, 64) == greeting()
    assert read_exactly(peer, len(ready(b"ROUTER"))) == (
        bytes([COMMAND, 28]) + b"\x05READY" + property_bytes(b"Socket-Type", b"ROUTER"))
    assert link.stage != OPEN


def test_a_message_sent_before_the_peers_ready_waits_for_it():
    """libzmq reads what follows its peer's READY as handshake until it has written its own
    READY: a message before that is a protocol error to it, so the link holds it."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    theirs.settimeout(5)
    dealer = ZmtpLink(ours, b"DEALER", (b"ROUTER",), max_bytes=MAX_BYTES, max_parts=64,
                      buffer_bytes=16 * 1024)
    dealer.greet()
    assert dealer.send([b"MWP1", b"early"]) is False and dealer.held
    assert read_exactly(theirs, 64 + len(ready(b"DEALER"))) == greeting() + ready(b"DEALER")
    theirs.setblocking(False)
    with pytest.raises(BlockingIOError):
        theirs.recv(1)  # the message is not on the wire
    theirs.setblocking(True)
    theirs.sendall(greeting() + ready(b"ROUTER"))
    select.select([dealer.fd], [], [], 5)
    assert dealer.receive() == [] and dealer.open and not dealer.held
    expected = b"".join(bytes(chunk) for chunk in zmtp.framed([b"MWP1", b"early"]))
    assert read_exactly(theirs, len(expected)) == expected
