"""The local frontend: clients on this host over a Unix stream socket, with no ZeroMQ between.

``unix://PATH`` in ``[daemon] frontend``. The messages are a ZeroMQ frontend's (docs/PROTOCOL.md)
with no routing id: ``[signature, header, payload...]`` both ways, each framed as on a worker
link (shared/link.py: ``u32 count | count x u64 length | the parts``). What a client may send,
what it is answered, its identity, its shares and its shared memory are an ``ipc://``
frontend's; only the bytes' way differs.

Why it exists. On a ZeroMQ frontend every message crosses libzmq's I/O thread: a request and its
reply wake it, and each wake-up costs an ``epoll_wait``, an eventfd read and two ``epoll_ctl``
calls (about 12 us of the supervisor's CPU per request on a 2-core machine, the largest single
cost of a request with batching off; docs/ARCHITECTURE.md). Here the loop reads and writes the
connection's socket itself, as it does a worker's link: one ``recv`` takes every request the
client has sent since the last round, one ``sendmsg`` writes each reply.

For the router and the intake this object is the frontend's socket, and it behaves as a ROUTER:
a message read from a connection is handed on with the connection's routing id in front (a
number of 8 bytes, never reused while the daemon runs), and ``send_parts`` writes a message to
the connection its first part names, or drops it, as a ROUTER drops what is addressed to a peer
that has left.

What an outsider can make the daemon hold, per connection:

* the descriptor, in the daemon's account and within its identity's share of connections
  (supervisor/routing/connections.py, quotas.py); at the high-water mark the listener is paused
  with the others (taken out of the poller: new clients wait in the backlog);
* a read buffer of BUFFER_BYTES, grown only to hold one small message whole (under 64 KiB plus
  8 bytes per part; a message has at most MAX_FRAMES parts); a large message's parts grow with
  what has arrived, at most ``max_message_bytes`` in all (libzmq allocates the whole declared
  size of a message as soon as its header arrives);
* its replies, counted against ``max_unread_bytes_per_connection`` and ``max_unread_bytes``
  as on a ZeroMQ frontend (the router's ReplyLedger). What the socket does not take waits in the
  link's queue, and while anything waits the connection is not read: a client that does not read
  its replies cannot send more requests either.

A connection that frames garbage (no parts, more than MAX_FRAMES, more than
``max_message_bytes``) is closed: a stream has no next message to resynchronise on. The client
library never sends one. Refused and closed connections are logged at most once a minute per uid.
"""

from __future__ import annotations

import errno
import logging
import socket
import struct
from pathlib import Path
from typing import Callable

from modelwarden.shared.link import Link
from modelwarden.shared.protocol import INTERNAL, SIGNATURE, error_header, pack, reply_route
from modelwarden.supervisor.routing.connections import ConnectionGuard
from modelwarden.supervisor.routing.identity import uid_identity
from modelwarden.supervisor.routing.limits import MAX_FRAMES
from modelwarden.supervisor.routing.unixlistener import UnixListener

logger = logging.getLogger(__name__)

SCHEME = "unix://"
BUFFER_BYTES = 16 * 1024  # a connection's read buffer to start with: a dozen 1 KiB requests
BACKLOG = 256  # connections the kernel queues for accept
_RID = struct.Struct(">Q")


def is_local(endpoint: str) -> bool:
    return endpoint.startswith(SCHEME)


def path_of(endpoint: str) -> Path:
    """The socket's path in ``unix://PATH`` or ``ipc://PATH`` (supervisor/routing/zmtpfront.py)."""
    return Path(endpoint.partition("://")[2])


class _Connection:
    """One accepted client: its link, its routing id and who it is."""

    __slots__ = ("link", "rid", "key", "identity", "uid")

    def __init__(self, link: Link, rid: bytes, key: tuple, identity: str, uid: int) -> None:
        self.link = link
        self.rid = rid
        self.key = key  # (frontend index, routing id): the router's ledgers' key
        self.identity = identity
        self.uid = uid


class LocalFrontend(UnixListener):
    """One ``unix://`` listener (supervisor/routing/unixlistener.py) and its connections, all in
    the arbiter's one poller.

    ``on_message(index, frontend, frames, connection, identity, max_bytes)`` is the intake's
    ``client_message``; ``want_write``/``want_read`` say what a descriptor is watched for
    (shared/sockets.Poller)."""

    def __init__(self, index: int, endpoint: str, group: str | None, max_message_bytes: int,
                 guard: ConnectionGuard, on_message: Callable,
                 watch: Callable[[int, Callable[[], None]], None], unwatch: Callable[[int], None],
                 want_write: Callable[[int, bool], None], want_read: Callable[[int, bool], None],
                 later: Callable[[float, Callable[[], None]], None],
                 clock: Callable[[], float], gateway: Callable[[int], bool] = lambda pid: False,
                 uncapped: set | None = None) -> None:
        super().__init__(path_of(endpoint), socket.SOCK_STREAM, BACKLOG, group, endpoint, guard,
                         watch, unwatch, later, clock)
        self.index = index
        self.endpoint = endpoint
        self.max_message_bytes = max_message_bytes
        self._on_message = on_message
        self._want_write, self._want_read = want_write, want_read
        self.closed = False
        self._by_rid: dict[bytes, _Connection] = {}
        self._next = 1
        # The daemon's own gateway, known by its pid (SO_PEERCRED): its connection's replies are
        # bound by the daemon's cap alone (supervisor/routing/limits.py ``ReplyLedger.uncapped``).
        self._is_gateway, self._uncapped = gateway, uncapped if uncapped is not None else set()

    def listen(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        super().listen()

    @property
    def connections(self) -> int:
        return len(self._by_rid)

    def _admitted(self, sock: socket.socket, pid: int, uid: int, gid: int) -> None:
        rid = _RID.pack(self._next)
        self._next += 1
        # The kernel's default send buffer (no SO_SNDBUF asked): what a client leaves unread
        # there is kernel memory it makes us hold, as on a ZeroMQ ipc frontend.
        link = self._link(sock)
        connection = _Connection(link, rid, (self.index, rid), uid_identity(uid), uid)
        link.on_pending = lambda waiting: self._backed_up(connection, waiting)
        self._by_rid[rid] = connection
        if self._is_gateway(pid):
            self._uncapped.add(connection.key)
        self._watch(link.fd, lambda: self._serve(connection))
        self._started(connection)

    def _link(self, sock: socket.socket) -> Link:
        """The codec of one accepted connection: the worker link's framing."""
        return Link(sock, max_bytes=self.max_message_bytes, max_parts=MAX_FRAMES,
                    buffer_bytes=BUFFER_BYTES, send_buffer=None)

    def _started(self, connection: _Connection) -> None:
        """A connection is in the poller: what its protocol does first (nothing here)."""

    # While replies wait: not read (backpressure, this frontend's rule), or read on, the replies
    # then bounded as a ROUTER bounds them (supervisor/routing/zmtpfront.py).
    reads_while_backed_up = False

    def _backed_up(self, connection: _Connection, waiting: bool) -> None:
        """Replies wait in the link's queue (True) or it has emptied (False): watch the socket
        for writing meanwhile, and do not read it (see the module's docstring)."""
        fd = connection.link.fd
        self._want_write(fd, waiting)
        if not self.reads_while_backed_up:
            self._want_read(fd, not waiting)

    def _serve(self, connection: _Connection) -> None:
        """The connection is readable, writable, or hung up."""
        link = connection.link
        if link.out:
            link.flush()
            if link.out and not link.broken and not self.reads_while_backed_up:
                return  # still backed up: not read until its replies are written
        for parts in link.receive():
            self._deliver(connection, parts)
            if self.closed:
                return
        if link.error is not None:
            self.log_per_uid("closed", connection.uid, link.error)
        if link.eof or link.broken:
            self.disconnect(connection)

    def _deliver(self, connection: _Connection, parts: list) -> None:
        """One message read from ``connection``, to the intake, with its routing id in front."""
        parts.insert(0, connection.rid)
        try:
            self._on_message(self.index, self, parts, connection.key, connection.identity,
                             self.max_message_bytes)
        except Exception:
            logger.exception("error handling a client message")
            self._answer_internal(parts)

    def _answer_internal(self, frames: list) -> None:
        self.send_parts([*reply_route(frames), SIGNATURE, pack(
            error_header(None, INTERNAL, "internal error; see the daemon's log"))])

    def disconnect(self, connection: _Connection) -> None:
        if self._by_rid.pop(connection.rid, None) is None:
            return
        self._uncapped.discard(connection.key)
        self._unwatch(connection.link.fd)
        connection.link.on_pending = None
        connection.link.close()
        self._give_back(connection.identity)

    # -- replies: the router's and the intake's send_parts (shared/sockets.py) -----------------

    def send_parts(self, parts: list) -> None:
        """Write ``parts[1:]`` to the connection ``parts[0]`` names; dropped if it has gone."""
        connection = self._by_rid.get(parts[0])
        if connection is None or not self._room_for_reply(connection):
            return
        try:
            connection.link.send(parts[1:])
        except OSError as exc:  # not a peer that left (the link drops those): say what it was
            logger.warning("%s: a reply could not be written (%s); closing the connection",
                           self.endpoint, errno.errorcode.get(exc.errno, exc))
            self.disconnect(connection)

    def _room_for_reply(self, connection: _Connection) -> bool:
        """Whether a reply to ``connection`` may be queued (here always: while replies wait, the
        connection is not read, so it cannot ask for more)."""
        return True

    def close(self) -> None:
        self.closed = True
        for connection in list(self._by_rid.values()):
            self.disconnect(connection)
        self.close_listener()
