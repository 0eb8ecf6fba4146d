"""Small ZeroMQ helpers shared by the daemon, its workers and the client.

pyzmq's ``send_multipart``/``recv_multipart`` cost about 20 us for a 4-frame message (they combine
IntFlag enums in Python for every frame and query RCVMORE through getsockopt); these do the same
work in about 7 us. At three processes and eight multipart messages per request, that is a large
share of a small request's round trip.
"""

from __future__ import annotations

import zmq

_SNDMORE = int(zmq.SNDMORE)
_NOBLOCK = int(zmq.NOBLOCK)


def send_parts(socket: zmq.Socket, parts: list) -> None:
    """Send a multipart message without copying large parts (pyzmq still copies parts below its
    copy threshold, which is cheaper for them)."""
    last = len(parts) - 1
    send = socket.send
    for index, part in enumerate(parts):
        send(part, _SNDMORE if index < last else 0, copy=False)


def send_queued(socket: zmq.Socket, parts: list) -> bool:
    """Queue a multipart message on a socket without a send high-water mark; False, with nothing
    queued, when the socket has no peer to queue for. A connected DEALER keeps its pipe across
    reconnects, so that happens only once libzmq has given the connection up for good (after a
    handshake the peer refused: see client/connection.py). Once the first part is accepted the
    rest of the message always is (ZeroMQ queues a message whole)."""
    last = len(parts) - 1
    send = socket.send
    try:
        send(parts[0], (_SNDMORE if last else 0) | _NOBLOCK, copy=False)
    except zmq.Again:
        return False
    for index in range(1, last + 1):
        send(parts[index], _SNDMORE if index < last else 0, copy=False)
    return True


def recv_parts(socket: zmq.Socket, flags: int = 0) -> list:
    """Receive one multipart message as zmq.Frame objects (zero-copy)."""
    frame = socket.recv(flags, copy=False)
    parts = [frame]
    while frame.more:
        frame = socket.recv(copy=False)
        parts.append(frame)
    return parts
