"""A ZeroMQ ``ipc://`` frontend served by the loop itself: libzmq clients, no libzmq in the daemon.

``ipc://PATH`` in ``[daemon] frontend`` (the default ``RUNTIME/frontend.sock`` among them).
Clients connect with any ZeroMQ library's DEALER or REQ socket, as they always have: the
socket file is a Unix stream socket, and the bytes on it are ZMTP 3.1 (shared/zmtp.py), which
the loop reads and writes itself. Everything else is the local frontend's
(supervisor/routing/localfront.py), which this class is, with ZMTP's codec in place of the
worker link's framing:

* a connection is admitted, or refused, by the listener (supervisor/routing/unixlistener.py):
  the daemon's descriptor budget, its uid's share of connections (``SO_PEERCRED``: the identity
  ``uid:N``, as libzmq's ``Peer-Address`` said it), paused with the other listeners at the
  high-water mark as a libzmq ``ipc://`` listener is: its socket file renamed aside (new
  clients get ENOENT, and libzmq's reconnection brings them in once it resumes;
  supervisor/routing/connections.py ``SocketFileAside``), and taken out of the poller;
* the daemon's greeting and READY go out as soon as it is admitted; the client's must follow
  within HANDSHAKE_S (libzmq's own ``ZMQ_HANDSHAKE_IVL`` default), or the connection is closed:
  a connection that never speaks holds a descriptor and its identity's share;
* a message is handed to the intake with the connection's routing id in front, as a ROUTER
  would (one of more than MAX_FRAMES frames or ``max_message_bytes`` in all is answered
  BAD_REQUEST, as the intake answers it, without being held; a frame past
  ``max_message_bytes`` closes the connection, as libzmq's ``ZMQ_MAXMSGSIZE`` did); a REQ client's empty delimiter stays in the message and comes back in the reply
  (docs/PROTOCOL.md). What the client sent, its shares, its shared memory and its replies'
  budget are those of any frontend; bytes that are not ZMTP close the connection, logged at
  most once a minute per uid;
* a client that does not read its replies is served as a ROUTER serves it (docs/PROTOCOL.md,
  7.3), not held back as on the local frontend: its requests are still read, its replies count
  against ``max_unread_bytes_per_connection`` (past it: OVERLOADED), and once its queue holds
  REPLY_HWM chunks, as many as the ROUTER's ``ZMQ_SNDHWM`` held messages, further replies are
  dropped. A small reply waits as one chunk (shared/zmtp.py ``framed``: about its bytes plus
  200), a large one as two a part; the byte budgets bound those.

Why not libzmq's ROUTER: every request and reply would cross libzmq's I/O thread (about 12 us of
the supervisor's CPU per request, docs/ARCHITECTURE.md). ``tcp://`` frontends (CURVE, the ZAP
handler, BPF-paused listeners) and ``admin.sock`` stay libzmq's, and an abstract
``ipc://@NAME`` too: it has no file, so no permissions, and is what libzmq makes of it.
``control.sock`` is one of these listeners too (supervisor/arbiter.py ``_bind_control``): its
messages go to the daemon's commands instead of the intake.
"""

from __future__ import annotations

import socket

from modelwarden.shared.protocol import SIGNATURE, error_header, pack
from modelwarden.shared.zmtp import ZmtpLink
from modelwarden.supervisor.routing.connections import SocketFileAside
from modelwarden.supervisor.routing.limits import MAX_FRAMES, oversized
from modelwarden.supervisor.routing.localfront import BUFFER_BYTES, LocalFrontend, _Connection

SCHEME = "ipc://"
HANDSHAKE_S = 30.0  # libzmq's ZMQ_HANDSHAKE_IVL default: a greeting and a READY take far less
PEER_TYPES = (b"DEALER", b"REQ", b"ROUTER")  # what ZMTP lets talk to a ROUTER (RFC 28)
REPLY_HWM = 100_000  # chunks waiting for one connection, as the ROUTER's SNDHWM (arbiter.FRONTEND_HWM)


def is_zmtp(endpoint: str) -> bool:
    """An ``ipc://`` endpoint at a path: the loop's own ZMTP frontend."""
    return endpoint.startswith(SCHEME) and not endpoint.startswith(SCHEME + "@")


class ZmtpFrontend(LocalFrontend):
    """One ``ipc://`` listener and its ZMTP connections, in the arbiter's one poller."""

    reads_while_backed_up = True
    # The socket file stays at a clean stop, as libzmq's did: a client finds a socket whose
    # daemon is gone and says so at once (client/ipcaccess.stale_socket), where a missing file
    # would be waited on as a daemon still starting. The next daemon binds over it.
    unlink_at_close = False

    def listen(self) -> None:
        super().listen()
        self._file = SocketFileAside(self.path)

    def pause(self) -> None:
        super().pause()
        self._file.move()

    def resume(self) -> None:
        self._file.restore()
        super().resume()

    def close_listener(self) -> None:
        if self._listener is not None:
            self._file.restore()  # a stale socket at its name, as libzmq leaves one
        super().close_listener()

    def _link(self, sock: socket.socket) -> ZmtpLink:
        # The kernel's default send buffer, as the local frontend's (what a client leaves
        # unread there is kernel memory it makes us hold).
        return ZmtpLink(sock, b"ROUTER", PEER_TYPES, max_bytes=self.max_message_bytes,
                        max_parts=MAX_FRAMES, buffer_bytes=BUFFER_BYTES, send_buffer=None)

    def _started(self, connection: _Connection) -> None:
        connection.link.greet()
        self._later(HANDSHAKE_S, lambda: self._handshake_due(connection))

    def _deliver(self, connection: _Connection, parts) -> None:
        if type(parts) is tuple:  # a message past the bounds, read past (shared/zmtp.py)
            frames, nbytes, delimited = parts
            refusal = oversized(frames + 1, nbytes + len(connection.rid), self.max_message_bytes)
            route = [connection.rid, b""] if delimited else [connection.rid]
            self.send_parts([*route, SIGNATURE, pack(
                error_header(None, refusal.code, refusal.message))])
            return
        super()._deliver(connection, parts)

    def _room_for_reply(self, connection: _Connection) -> bool:
        return len(connection.link.out) < REPLY_HWM

    def _handshake_due(self, connection: _Connection) -> None:
        if connection.link.open or self._by_rid.get(connection.rid) is not connection:
            return
        self.log_per_uid("closed", connection.uid,
                         f"no ZMTP handshake within {HANDSHAKE_S:.0f}s")
        self.disconnect(connection)
