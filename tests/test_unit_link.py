"""shared/link.py on real socket pairs: every message comes out whole, in order and as it went in,
whatever its size and parts; a full socket queues without blocking the supervisor's end and
says so; a worker's end gets writable, aligned parts; garbage, a closed peer and a vanished
peer each end the link the way the module says. Also run uncompiled (tests/test_compiled.py)."""

from __future__ import annotations

import fcntl
import os
import random
import select
import socket
import struct
import termios
import threading
import time

import numpy as np
import pytest

from modelwarden.shared import link as link_module
from modelwarden.shared.link import (ALIGN, BUFFER_BYTES, COPY_BELOW, FAST_PARTS, GROW_FROM,
                                     IOV_MAX, MAX_PARTS, SEND_BUFFER, SMALL_BELOW, Link,
                                     frame_prefix)


def pair(writable: bool = False, **kwargs) -> tuple[Link, Link]:
    """(the supervisor's end, the worker's end): the worker's parts writable when asked."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return Link(ours, **kwargs), Link(theirs, writable=writable)


def receive_all(end: Link, count: int, timeout: float = 10.0) -> list:
    """``count`` messages from ``end``, waiting for them in poll(2)."""
    messages: list = []
    deadline = time.monotonic() + timeout
    while len(messages) < count:
        left = deadline - time.monotonic()
        assert left > 0, f"{len(messages)} of {count} messages came"
        select.select([end.fd], [], [], left)
        messages.extend(end.receive())
    return messages


def as_bytes(message: list) -> list[bytes]:
    return [bytes(part) for part in message]


@pytest.mark.parametrize("writable", [False, True])
def test_messages_of_every_size_come_out_whole_and_in_order(writable):
    rng = random.Random(7)
    sizes = [0, 1, 7, 100, COPY_BELOW - 1, COPY_BELOW, SMALL_BELOW - 20, SMALL_BELOW,
             BUFFER_BYTES + 3, 3 * BUFFER_BYTES]
    messages = [[rng.randbytes(rng.choice(sizes)) for _ in range(rng.randint(1, 5))]
                for _ in range(60)]
    sender, receiver = pair(writable)
    got: list = []
    thread = threading.Thread(target=lambda: got.extend(receive_all(receiver, len(messages))))
    thread.start()
    for message in messages:
        assert sender.send(message, True)
    thread.join(30)
    assert [as_bytes(message) for message in got] == messages


def test_the_supervisors_end_reads_small_parts_as_bytes_and_large_ones_in_place():
    sender, receiver = pair()
    small, large = b"h" * 100, os.urandom(COPY_BELOW)
    sender.send([small, large, small], True)
    [message] = receive_all(receiver, 1)
    assert [type(part) for part in message] == [bytes, memoryview, bytes]
    assert as_bytes(message) == [small, large, small]


def address(part) -> int:
    return np.frombuffer(part, np.uint8).__array_interface__["data"][0]


def test_a_workers_parts_are_writable_and_aligned():
    sender, receiver = pair(writable=True)
    for sizes in ([3, 5, 64, 1000], [3, 70_000, 5, 300_000]):  # split from the buffer; their own
        thread = threading.Thread(target=sender.send,
                                  args=([os.urandom(size) for size in sizes], True))
        thread.start()
        [message] = receive_all(receiver, 1)
        thread.join(10)
        addresses = [address(part) for part in message]
        assert all(at % 16 == 0 for at in addresses), addresses  # malloc's alignment
        for part in message:
            part[0:1] = b"\xff"  # a model may write into its inputs
            assert bytes(part[:1]) == b"\xff"
    sender.send([b"a", b"bc", b"def"], True)
    [small] = receive_all(receiver, 1)  # one buffer, each part at an ALIGN offset of it
    assert [address(part) - address(small[0]) for part in small] == [0, ALIGN, 2 * ALIGN]


def resident_bytes() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_declared_length_costs_the_reader_only_what_was_sent():
    sender, receiver = pair()
    before = resident_bytes()
    sender.sock.sendall(struct.pack("<IQ", 1, 1 << 36) + b"x" * 1000)  # 64 GiB said, 1000 sent
    select.select([receiver.fd], [], [], 5)
    assert receiver.receive() == [] and not receiver.broken
    assert resident_bytes() - before < 4 * GROW_FROM
    more = b"y" * (3 * GROW_FROM)
    writer = threading.Thread(target=lambda: (sender.sock.setblocking(True),
                                              sender.sock.sendall(more)))
    writer.start()
    while writer.is_alive() or select.select([receiver.fd], [], [], 0)[0]:
        select.select([receiver.fd], [], [], 0.5)
        assert receiver.receive() == []  # the part grows with what arrives, no further
    assert resident_bytes() - before < 16 * GROW_FROM


@pytest.mark.parametrize("count", [FAST_PARTS - 1, FAST_PARTS, IOV_MAX + 5, 40_000])
def test_messages_of_many_parts_keep_every_part(count):
    sender, receiver = pair()
    message = [struct.pack("<I", index) for index in range(count)]
    thread = threading.Thread(target=sender.send, args=(message, True))
    thread.start()
    [got] = receive_all(receiver, 1)
    thread.join(10)
    assert got == message


def test_a_full_socket_queues_says_so_and_flush_writes_it_in_order():
    sender, receiver = pair()
    calls: list = []
    sender.on_pending = calls.append
    big = os.urandom(3 * SEND_BUFFER)
    assert sender.send([b"first", big]) is False  # more than a socket buffer: some waits
    assert sender.pending and calls == [True]
    assert sender.send([b"second"]) is False  # behind it, never before it
    assert calls == [True]
    got: list = []
    deadline = time.monotonic() + 10
    while sender.pending:
        assert time.monotonic() < deadline
        got.extend(receiver.receive())
        sender.flush()
    got.extend(receive_all(receiver, 2 - len(got)))
    assert calls == [True, False]
    assert as_bytes(got[0]) == [b"first", big] and got[1] == [b"second"]


def test_a_send_never_blocks_the_supervisors_end():
    sender, _receiver = pair()
    started = time.monotonic()
    for _ in range(20):
        sender.send([bytes(SEND_BUFFER)])
    assert sender.pending and time.monotonic() - started < 5  # 20 buffers' worth, none read


@pytest.mark.parametrize("garbage, said", [
    (struct.pack("<I", 0), "a message of 0 parts"),
    (struct.pack("<I", MAX_PARTS + 1), f"a message of {MAX_PARTS + 1} parts"),
    (struct.pack("<IQ", 1, 1 << 50), f"a message of {1 << 50} bytes"),
    (struct.pack("<IQ", 1, 1 << 63), f"a message of {1 << 63} bytes"),  # negative as a C ssize_t
])
def test_a_frame_that_does_not_parse_breaks_the_link_after_the_messages_before_it(garbage, said):
    sender, receiver = pair()
    receiver.max_bytes = 1 << 30
    sender.send([b"before"], True)
    sender.sock.sendall(garbage)
    sender.send([b"after"], True)
    messages = receive_all(receiver, 1)
    assert messages == [[b"before"]]
    assert receiver.broken and said in receiver.error
    assert receiver.receive() == []  # nothing more is read


def test_a_link_reading_a_client_refuses_more_parts_than_its_bound_and_grows_only_for_a_message():
    """The local frontend's links (supervisor/routing/localfront.py): at most ``max_parts``
    parts, and a small read buffer that grows to hold one small message whole."""
    receiver, sender = pair(max_parts=4, buffer_bytes=1024, send_buffer=None)
    parts = [b"x" * 3000, b"y", b"z" * 100, b""]
    sender.send(parts, True)
    assert receive_all(receiver, 1) == [parts]
    assert 3000 < len(receiver.buffer) < SMALL_BELOW
    sender.send([b"p"] * 5, True)
    select.select([receiver.fd], [], [], 5)
    assert receiver.receive() == []
    assert receiver.broken and "a message of 5 parts" in receiver.error


def test_a_closed_peer_is_eof_once_what_it_wrote_is_read():
    sender, receiver = pair()
    sender.send([b"last words"], True)
    sender.close()
    assert receive_all(receiver, 1) == [[b"last words"]]
    select.select([receiver.fd], [], [], 5)
    assert receiver.receive() == [] and receiver.eof


def test_a_vanished_peer_breaks_the_link_and_drops_what_waits():
    sender, receiver = pair()
    calls: list = []
    sender.on_pending = calls.append
    sender.send([bytes(3 * SEND_BUFFER)])
    receiver.close()
    assert sender.flush() and sender.broken and calls == [True, False]
    assert sender.send([b"more"]) is True  # dropped: nothing waits


def test_frame_prefix_is_the_documented_layout():
    assert frame_prefix([b"ab", b"", memoryview(b"xyz")]) == struct.pack("<IQQQ", 3, 2, 0, 3)
    tensor = np.zeros((2, 3), np.float32)
    assert frame_prefix([memoryview(tensor)]) == struct.pack("<IQ", 1, 24)


def test_a_tensors_view_travels_as_its_bytes():
    sender, receiver = pair(writable=True)
    tensor = np.arange(12, dtype=np.float32).reshape(3, 4)
    sender.send([b"h", memoryview(tensor)], True)
    [message] = receive_all(receiver, 1)
    assert np.array_equal(np.frombuffer(message[1], np.float32).reshape(3, 4), tensor)


def test_the_compiled_fast_paths_are_compiled_with_the_module():
    compiled = not link_module.__file__.endswith(".py")
    assert hasattr(link_module, "_sendmsg_c") is not compiled  # a C function is not an attribute


def queued_bytes(sock: socket.socket) -> int:
    """What the kernel holds unread on ``sock`` (FIONREAD)."""
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0" * 4))[0]


@pytest.mark.parametrize("size, per_call, count", [(16 << 20, 1 << 20, 1), (64, 16 << 10, 50_000)])
def test_one_receive_reads_at_most_its_bound_and_the_rest_waits_in_the_socket(size, per_call, count):
    """A worker's large result (or a flood of small ones) does not hold the supervisor's loop
    while it streams in: a receive reads ``read_per_call`` bytes (one read buffer more at
    most), the rest stays in the socket, which still polls readable, and what comes out in the
    end is every message, whole and in order."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    reader, writer = Link(ours, read_per_call=per_call), Link(theirs)
    rng = random.Random(size)
    messages = [[rng.randbytes(size)] for _ in range(count)]
    thread = threading.Thread(target=lambda: [writer.send(message, True) for message in messages],
                              daemon=True)  # a failed test must not leave pytest waiting on it
    thread.start()
    got: list = []
    waiting = per_call + 2 * BUFFER_BYTES  # more than one bounded receive may take
    deadline = time.monotonic() + 10
    while queued_bytes(ours) < waiting:  # the writer has filled the socket that far
        assert time.monotonic() < deadline, queued_bytes(ours)
        select.select([], [], [], 0.01)
    got.extend(reader.receive())
    assert per_call <= reader.taken <= per_call + BUFFER_BYTES
    assert queued_bytes(ours) > 0 and select.select([reader.fd], [], [], 0)[0]
    while len(got) < count:
        assert select.select([reader.fd], [], [], 10)[0], "the socket stopped polling readable"
        got.extend(reader.receive())
        assert reader.taken <= per_call + BUFFER_BYTES
    thread.join(10)
    assert len(got) == count and all(as_bytes(a) == b for a, b in zip(got, messages))
