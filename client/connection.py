"""One DEALER to one daemon, as every client opens it (client.py's threads and AsyncClient,
multiclient.py's links), and what is done when libzmq gives it up.

A connected DEALER with no high-water mark queues for a daemon that is away (a restart, a cut
link) and sends once it is back: the clients rely on that. One case breaks it: libzmq does not
reconnect after a handshake the daemon refused (a wrong or missing CURVE key, a plaintext client
at a CURVE endpoint, ZMQ_HANDSHAKE_FAILED_*). The socket is then left with no pipe, and a
blocking send on it would wait for ever, deadline or not. So every send here is non-blocking, and
a refused one replaces the socket by a fresh one, connected again, and queues there: a daemon
that has since allowed our key (SIGHUP rereads them) answers, and a request sent into a handshake
refused again is dropped by libzmq and ends in the client's Timeout, which names the keys. One
new connection per send at most: a caller retrying against a daemon that refuses it costs the
daemon one handshake per request, as a fresh client would.
"""

from __future__ import annotations

import zmq

from modelwarden.client.curve import ClientKeys, make_curve_client
from modelwarden.shared.sockets import send_queued


class Connection:
    def __init__(self, context: zmq.Context, endpoint: str, curve: ClientKeys | None = None,
                 monitor_events: int = 0) -> None:
        self.context = context
        self.endpoint = endpoint
        self.curve = curve
        self.monitor_events = monitor_events  # 0: no monitor socket
        self.monitor: zmq.Socket | None = None
        self.socket = self._open()

    def _open(self) -> zmq.Socket:
        socket = self.context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDHWM, 0)
        socket.setsockopt(zmq.RCVHWM, 0)
        if self.curve is not None:
            make_curve_client(socket, self.curve)
        if self.monitor_events:
            self.monitor = socket.get_monitor_socket(self.monitor_events)
        socket.connect(self.endpoint)
        return socket

    def send(self, messages: list[list]) -> bool:
        """Queue each message; True when the socket was replaced on the way (a caller polling
        ``socket`` or ``monitor`` watches the new ones)."""
        replaced = False
        for parts in messages:
            if send_queued(self.socket, parts):
                continue
            self.replace()
            replaced = True
            if not send_queued(self.socket, parts):  # a socket connected just now has its pipe
                raise ConnectionError(f"a new connection to {self.endpoint} refused a message")
        return replaced

    def replace(self) -> None:
        self._close_sockets()
        self.socket = self._open()

    def close(self) -> None:
        if not self.socket.closed:
            self._close_sockets()

    def _close_sockets(self) -> None:
        if self.monitor is not None:
            self.socket.disable_monitor()
            self.monitor.close(0)
            self.monitor = None
        self.socket.close(0)
