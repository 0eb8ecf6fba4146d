"""shared/sockets.py on real ZeroMQ sockets (ipc:// in a temporary directory): what a message
becomes when it is received, what goes out when parts are sent, and the edges -- nothing
waiting, a peerless socket, a closed socket. tests/test_compiled.py runs this file again on the
uncompiled path, where the same functions go through pyzmq."""

from __future__ import annotations

import gc
import os
import threading

import numpy as np
import pytest
import zmq

from modelwarden.shared import sockets
from modelwarden.shared.sockets import (COPY_BELOW, recv_frames, recv_message, recv_parts, recv_routed,
                                        send_parts, send_queued)
from modelwarden.testing import poll_until


@pytest.fixture
def pair(tmp_path):
    """A DEALER connected to a ROUTER over ipc://, no high-water marks; (dealer, router)."""
    context = zmq.Context()
    router, dealer = context.socket(zmq.ROUTER), context.socket(zmq.DEALER)
    for sock in (router, dealer):
        sock.sndhwm = sock.rcvhwm = 0
        sock.linger = 0
    endpoint = f"ipc://{tmp_path}/s.sock"
    router.bind(endpoint)
    dealer.connect(endpoint)
    yield dealer, router
    dealer.close()
    router.close()
    context.term()


def arrived(sock, flags=zmq.NOBLOCK, receive=recv_message):
    """The next message on ``sock`` (what ``receive(sock, flags)`` returns), waiting for it."""
    box = []
    poll_until(lambda: box.append(receive(sock, flags)) or box[-1] is not None, timeout=10)
    return box[-1]


def test_small_parts_arrive_as_bytes_and_large_ones_stay_zero_copy_buffers(pair):
    dealer, router = pair
    big = os.urandom(COPY_BELOW + 1)
    send_parts(dealer, [b"", b"MWP1", b"h" * (COPY_BELOW - 1), big])
    identity, empty, signature, header, payload = arrived(router)
    assert [type(part) for part in (identity, empty, signature, header)] == [bytes] * 4
    assert (empty, signature, header) == (b"", b"MWP1", b"h" * (COPY_BELOW - 1))
    assert type(payload) is not bytes and len(payload) == len(big)
    assert bytes(payload) == big and payload.bytes == big
    assert payload.buffer.tobytes() == big and memoryview(payload).nbytes == len(big)
    assert np.frombuffer(payload, np.uint8)[:8].tobytes() == big[:8]


def test_a_received_large_part_forwarded_arrives_whole(pair):
    """The supervisor relays payload frames as it received them: a large one goes out again
    without being turned into bytes, and arrives intact."""
    dealer, router = pair
    big = os.urandom(4 << 20)
    send_parts(dealer, [b"", b"x", big])
    route, empty, _, payload = arrived(router)
    send_parts(router, [route, b"", b"y", payload, b"tail"])
    back = arrived(dealer)
    assert back[:2] == [b"", b"y"] and len(back[2]) == len(big) and bytes(back[2]) == big
    assert back[3] == b"tail"


def test_frames_of_every_kind_can_be_sent_together(pair):
    dealer, router = pair
    frame = zmq.Frame(b"f" * 100)
    send_parts(dealer, [b"", frame, memoryview(b"m" * 10), bytearray(b"a" * 3), b"b" * (1 << 17)])
    _, *parts = arrived(router)
    assert [bytes(part) for part in parts] == [b"", b"f" * 100, b"m" * 10, b"a" * 3, b"b" * (1 << 17)]


def test_an_empty_socket_answers_none_and_then_the_next_message(pair):
    dealer, router = pair
    assert recv_message(router, zmq.NOBLOCK) is None
    assert recv_routed(router, "Peer-Address") is None
    send_parts(dealer, [b"one"])
    assert arrived(router)[1:] == [b"one"]
    assert recv_message(router, zmq.NOBLOCK) is None


def test_a_blocking_receive_waits_for_the_message(pair):
    dealer, router = pair
    send_parts(router, [_routing_id(dealer, router), b"late"])
    assert recv_message(dealer) == [b"late"]


class CountingPolls(zmq.Socket):
    """A real zmq socket that counts the times it is asked to poll."""

    polls: int = 0  # declared here: pyzmq takes any other attribute for a socket option

    def poll(self, *args, **kwargs):
        self.polls += 1
        return super().poll(*args, **kwargs)


def test_a_blocking_receive_takes_a_waiting_message_without_polling_and_polls_for_a_late_one(tmp_path):
    """A loop that polled already (the worker's, the client's) pays no second poll: pyzmq's
    Socket.poll makes a Poller in Python, about 11,000 instructions. Uncompiled, pyzmq's own
    blocking receive waits (no poll either)."""
    context = zmq.Context()
    receiver = context.socket(zmq.PAIR, socket_class=CountingPolls)
    sender = context.socket(zmq.PAIR)
    endpoint = f"ipc://{tmp_path}/p.sock"
    receiver.bind(endpoint)
    sender.connect(endpoint)
    try:
        send_parts(sender, [b"waiting", b"two"])
        poll_until(lambda: receiver.get(zmq.EVENTS) & zmq.POLLIN, timeout=10)
        assert [part.bytes for part in recv_frames(receiver)] == [b"waiting", b"two"]
        assert receiver.polls == 0

        def send_once_it_waits():
            poll_until(lambda: receiver.polls > 0 or not sockets.COMPILED, timeout=10)
            send_parts(sender, [b"late"])

        late = threading.Thread(target=send_once_it_waits)
        late.start()
        assert [part.bytes for part in recv_frames(receiver)] == [b"late"]
        late.join()
    finally:
        receiver.close(0)
        sender.close(0)
        context.term()


def _routing_id(dealer, router) -> bytes:
    send_parts(dealer, [b"hello"])
    return arrived(router)[0]


def test_the_peer_address_says_the_sending_process_uid(pair):
    dealer, router = pair
    send_parts(dealer, [b"x"])
    parts, peer = arrived(router, "Peer-Address", recv_routed)
    assert parts[1:] == [b"x"]
    assert peer.rsplit(":", 3)[1:] == [str(os.getuid()), str(os.getgid()), str(os.getpid())]


def test_a_property_the_transport_lacks_is_empty(pair):
    dealer, router = pair
    send_parts(dealer, [b"x"])
    assert arrived(router, "User-Id", recv_routed)[1] == ""


def test_send_queued_refuses_without_a_peer_and_queues_with_one(tmp_path):
    context = zmq.Context()
    lonely = context.socket(zmq.DEALER)
    lonely.linger = 0
    try:
        assert send_queued(lonely, [b"a", b"b"]) is False  # never connected: no pipe
        lonely.connect(f"ipc://{tmp_path}/nobody.sock")
        assert send_queued(lonely, [b"a", b"b"]) is True  # a connect's pipe queues
    finally:
        lonely.close()
        context.term()


def test_an_error_from_libzmq_is_raised_as_its_zmq_error(pair):
    """ROUTER_MANDATORY reports an unknown peer as EHOSTUNREACH: the send raises it."""
    dealer, router = pair
    router.router_mandatory = True
    with pytest.raises(zmq.ZMQError) as error:
        send_parts(router, [b"nobody", b"x"])
    assert error.value.errno == zmq.EHOSTUNREACH


def test_a_closed_socket_raises_instead_of_touching_freed_memory(pair):
    dealer, router = pair
    router.close()
    with pytest.raises(zmq.ZMQError):
        recv_message(router, zmq.NOBLOCK)
    with pytest.raises(zmq.ZMQError):
        send_parts(router, [b"x"])


def test_recv_parts_still_gives_frames(pair):
    dealer, router = pair
    send_parts(dealer, [b"x", b"y"])
    poll_until(lambda: router.poll(0), timeout=10)
    parts = recv_parts(router)
    assert all(isinstance(part, zmq.Frame) for part in parts) and parts[1].bytes == b"x"


def test_the_compiled_module_calls_libzmq_itself():
    """When compiled, large parts are its own type, not pyzmq's: the libzmq path is in use."""
    if not sockets.COMPILED:
        pytest.skip("the uncompiled path (tests/test_compiled.py runs this file both ways)")
    assert sockets.Part is not zmq.Frame and sockets.Part.__module__ == "modelwarden.shared.sockets"


def test_a_send_that_must_wait_waits_without_holding_the_gil(tmp_path):
    """A DEALER whose peer stops reading blocks in send_parts: the wait is pyzmq's (GIL released),
    so this thread keeps running and sees the sender stuck; once the peer reads, every message
    arrives. Held in C with the GIL, this test could not run a line until the peer read."""
    import sys
    import threading

    context = zmq.Context()
    router, dealer = context.socket(zmq.ROUTER), context.socket(zmq.DEALER)
    for sock in (router, dealer):
        sock.sndhwm = sock.rcvhwm = 1
        sock.linger = 0
    router.bind(f"ipc://{tmp_path}/full.sock")
    dealer.connect(f"ipc://{tmp_path}/full.sock")
    total, sent = 2000, [0]

    def sender():
        for index in range(total):
            send_parts(dealer, [b"n", index.to_bytes(4, "big") * 4096])  # 16 KiB: bytes path
            sent[0] += 1

    thread = threading.Thread(target=sender, daemon=True)
    thread.start()
    try:
        def stuck() -> bool:  # the sender's innermost Python frame is pyzmq's waiting send
            frame = sys._current_frames().get(thread.ident)
            return frame is not None and frame.f_code.co_name == "send" and sent[0] < total

        poll_until(stuck, timeout=30, interval=0.01, message="the sender waiting on the full pipe")
        received = 0
        while received < total:
            assert router.poll(10_000), f"only {received} of {total} arrived"
            parts = recv_message(router, zmq.NOBLOCK)
            assert int.from_bytes(bytes(parts[2][:4]), "big") == received
            received += 1
        thread.join(10)
        assert not thread.is_alive() and sent[0] == total
    finally:
        dealer.close()
        router.close()
        context.term()


# -- the loop's poller ---------------------------------------------------------------------------


def test_a_signal_inside_the_poll_never_escapes_it_as_an_error(pair):
    """A signal can interrupt the wait, and also libzmq's own poll of a socket's mailbox when
    the poller asks it for ZMQ_EVENTS: either way the handler runs and the poll answers [] (or
    what is ready), as zmq_poll does; it never raises (a SIGTERM there once stopped the daemon
    with a traceback). A storm of signals makes both windows certain to be hit."""
    import signal
    import time

    dealer, router = pair
    poller = sockets.Poller()
    poller.register(router)
    poller.register(dealer, quiet=True)
    fired = []
    previous = signal.signal(signal.SIGALRM, lambda *_: fired.append(True))
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.00002, 0.00002)
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            assert poller.poll(0) == []
            assert poller.poll(1) == []
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert len(fired) > 1000


def test_the_poller_answers_the_items_that_are_ready_and_follows_registrations(pair):
    import signal
    import socket
    import time

    dealer, router = pair
    reader, writer = socket.socketpair()
    poller = sockets.Poller()
    for item in (router, reader.fileno(), reader):  # a zmq socket, a descriptor, a file object
        poller.register(item)
    poller.register(router)  # twice: still one item
    assert poller.poll(0) == []
    send_parts(dealer, [b"x"])
    assert poller.poll(5000) == [router]  # level-triggered: ready until read
    assert poller.poll(0) == [router]
    arrived(router)
    writer.send(b"!")
    assert poller.poll(5000) == [reader.fileno(), reader]  # both names of the descriptor
    poller.unregister(reader)
    assert poller.poll(0) == [reader.fileno()]
    reader.recv(1)
    started = time.monotonic()
    assert poller.poll(50) == [] and time.monotonic() - started >= 0.04  # the timeout is waited
    # A signal during an endless wait runs its handler, whose byte (the loop's wakeup pattern)
    # ends the wait: compiled, the interrupted poll answers [] at once and the next one finds it.
    fired = []

    def handler(*_):
        fired.append(True)
        writer.send(b"!")

    previous = signal.signal(signal.SIGALRM, handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        assert poller.poll(None) in ([], [reader.fileno()]) and fired
        assert poller.poll(5000) == [reader.fileno()]
    finally:
        signal.signal(signal.SIGALRM, previous)
    poller.unregister(reader.fileno())
    assert poller.poll(0) == []
    reader.close()
    writer.close()


def test_a_tracked_frame_is_given_to_libzmq_itself_however_small(tmp_path):
    """A small zmq.Frame is not copied like bytes: its tracker must say when libzmq let go of
    the message (the reply ledger counts unread replies by it), not when our copy was made."""
    context = zmq.Context()
    dealer, router = context.socket(zmq.DEALER), context.socket(zmq.ROUTER)
    dealer.linger = router.linger = 0
    endpoint = f"ipc://{tmp_path}/late.sock"
    dealer.connect(endpoint)  # nobody there yet: libzmq queues what is sent
    try:
        frame = zmq.Frame(b"x" * 1024, copy=False, track=True)  # as the reply ledger makes one
        tracker = frame.tracker
        send_parts(dealer, [b"head", frame])
        del frame
        gc.collect()
        assert not tracker.done, "the frame's message was not the one queued"
        router.bind(endpoint)
        _, head, body = arrived(router, receive=recv_parts)
        assert head.bytes == b"head" and body.bytes == b"x" * 1024
        poll_until(lambda: tracker.done, timeout=10, message="libzmq done with the message")
    finally:
        dealer.close()
        router.close()
        context.term()


def test_a_descriptor_not_wanted_for_reading_is_reported_only_when_writable_or_hung_up():
    """Poller.want_read: a local client's connection whose replies back up is not read
    (supervisor/routing/localfront.py); a level-triggered poll would report it at once, for ever."""
    import socket

    ours, theirs = socket.socketpair()
    poller = sockets.Poller()
    poller.register(ours.fileno())
    theirs.send(b"a request")
    assert poller.poll(0) == [ours.fileno()]
    poller.want_read(ours.fileno(), False)
    assert poller.poll(0) == []  # readable, but not wanted
    poller.want_write(ours.fileno(), True)
    assert poller.poll(0) == [ours.fileno()]  # writable
    poller.want_write(ours.fileno(), False)
    poller.want_read(ours.fileno(), True)
    assert poller.poll(0) == [ours.fileno()]  # read again
    poller.want_read(ours.fileno(), False)
    theirs.close()
    assert poller.poll(0) == [ours.fileno()]  # the peer's close is reported all the same
    poller.unregister(ours.fileno())
    assert poller.poll(0) == [] and not poller.muted
    ours.close()
