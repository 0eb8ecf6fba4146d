"""One connection to a daemon's ``unix://`` or ``ipc://`` frontend, read and written by the
client itself (supervisor/routing/localfront.py, zmtpfront.py).

A Unix stream socket carrying the messages a DEALER would (``[signature, header, payload...]``):
on ``unix://`` framed as a worker link (shared/link.py), on ``ipc://PATH`` as ZeroMQ frames
(ZMTP 3.1, shared/zmtp.py: the client is a DEALER to any ROUTER on that path, the daemon's own
or libzmq's). No libzmq runs on either side, so no I/O thread: a request costs the client a
``sendmsg`` and its reply a ``recv``. Client, its ``submit`` thread and AsyncClient
(client/client.py) each hold one, as they would a DEALER. ``tcp://`` (CURVE) and an abstract
``ipc://@NAME`` stay libzmq's DEALER (client/connection.py).

Differences from a DEALER that callers handle:

* Connecting happens when the first message is sent, and again after the daemon closed the
  connection (it stopped or restarted). A socket file that is missing or refuses (a daemon
  starting) is tried again until the caller's deadline; one this process may not reach is a
  PermissionError at once (client/ipcaccess.py says who may).
* Sending never waits: what the socket does not take waits in the link's queue and is written
  when the socket is writable (``flush``). The daemon stops reading a ``unix://`` connection
  whose replies back up, so a caller waiting to write must read meanwhile: ``receive`` does both.
* A closed connection is known at once (``lost``): the requests it carried get no reply, and
  the clients fail them with ConnectionLost instead of waiting for their deadlines.
"""

from __future__ import annotations

import select
import socket
import time
from collections import deque
from pathlib import Path

from modelwarden.client.ipcaccess import who_may
from modelwarden.shared.errors import NoDaemon
from modelwarden.shared.link import BUFFER_BYTES, MAX_BYTES, MAX_PARTS, SEND_BUFFER, Link
from modelwarden.shared.zmtp import ZmtpLink

SCHEME = "unix://"
ZMTP_SCHEME = "ipc://"
ROUTER = (b"ROUTER",)  # what a DEALER talks to
_POLLIN, _POLLOUT = select.POLLIN, select.POLLOUT
_RETRY_FIRST_S, _RETRY_MAX_S = 0.005, 0.1  # connecting to a daemon that is (re)starting


def is_local(endpoint: str) -> bool:
    return endpoint.startswith(SCHEME)


def is_direct(endpoint: str) -> bool:
    """An endpoint this module connects to, with no libzmq: ``unix://PATH``, ``ipc://PATH``."""
    return is_local(endpoint) or (endpoint.startswith(ZMTP_SCHEME)
                                  and not endpoint.startswith(ZMTP_SCHEME + "@"))


class LocalConnection:
    """Compiled, an extension type (local.pxd) whose calls into its link are C calls."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.zmtp = not is_local(endpoint)  # ipc://: ZeroMQ's framing
        self.path = endpoint.partition("://")[2]
        self.link: Link | None = None
        self.inbox: deque = deque()  # messages read while waiting to write
        self.lost = 0  # connections the daemon closed
        self.writing = False  # the socket is watched for writing: bytes wait in the link
        self._poll = select.poll()

    # -- connecting ----------------------------------------------------------------------------

    def try_connect(self) -> bool:
        """Connect now if not connected; False when nothing listens at the path yet."""
        if self.link is not None:
            return True
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.connect(self.path)
        except (FileNotFoundError, ConnectionRefusedError):
            sock.close()
            return False
        except PermissionError:
            sock.close()
            raise PermissionError(f"permission denied: {self.path} "
                                  f"({who_may(Path(self.path))})") from None
        except BaseException:
            sock.close()
            raise
        if self.zmtp:
            self.link = ZmtpLink(sock, b"DEALER", ROUTER, max_bytes=MAX_BYTES, max_parts=MAX_PARTS,
                                 buffer_bytes=BUFFER_BYTES, send_buffer=SEND_BUFFER)
            self.link.greet()  # messages may follow at once: the peer reads them after it
        else:
            self.link = Link(sock)
        self.writing = False
        self._poll.register(self.link.fd, _POLLIN)
        return True

    def connect(self, deadline: float) -> None:
        """Connect, trying again while the daemon is not listening, until ``deadline``
        (monotonic seconds); NoDaemon then."""
        delay = _RETRY_FIRST_S
        while not self.try_connect():
            left = deadline - time.monotonic()
            if left <= 0:
                raise NoDaemon(f"no daemon listening at {self.path} (is it running? is this "
                               "its frontend?)")
            time.sleep(min(delay, left))  # a client waiting for a daemon to come up
            delay = min(delay * 2, _RETRY_MAX_S)

    def deliver(self, messages: list, deadline: float) -> None:
        """Send ``messages`` (connected first: ``connect``). A connection the daemon has closed
        is seen when a write fails (EPIPE: nothing of that message went out) or when its close is
        read: either way a new one is made, and the messages go there."""
        if self.closed_by_peer:
            self.drop()
        self.connect(deadline)
        self.send(messages)
        if self.link.broken:
            self.drop()
            self.connect(deadline)
            self.send(messages)

    def drop(self) -> None:
        """Forget a connection the daemon closed (the next send connects again)."""
        if self.link is not None:
            self._poll.unregister(self.link.fd)
            self.link.close()
            self.link = None
            self.lost += 1

    @property
    def closed_by_peer(self) -> bool:
        link = self.link
        return link is not None and (link.eof or link.broken)

    # -- messages ------------------------------------------------------------------------------

    def send(self, messages: list) -> bool:
        """Queue each message (connected already: ``connect``); False, as a DEALER's
        Connection.send says when its socket was not replaced."""
        link = self.link
        for parts in messages:
            link.send(parts)
        self._follow_queue()
        return False

    def flush(self) -> None:
        """Write what waits (the socket is writable)."""
        link = self.link
        if link is not None and link.out:
            link.flush()
            if not link.out:
                self._want_write(False)

    def take(self) -> list:
        """The messages read so far (``pump``, ``read``), each once."""
        messages = list(self.inbox)
        self.inbox.clear()
        return messages

    def read(self) -> None:
        """Read what the socket holds now into ``inbox`` (the socket is readable); the daemon's
        close shows as ``closed_by_peer``."""
        if self.link is not None:
            self._arrived(self.link.receive())
            self._follow_queue()

    def receive(self, timeout_s: float) -> list | None:
        """One message, or None when none came within the timeout (or the daemon closed the
        connection: ``closed_by_peer``). Writes what waits meanwhile."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        while not self.inbox and self.link is not None and not self.closed_by_peer:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self.pump(max(1, int(left * 1000)))
        return self.inbox.popleft() if self.inbox else None

    def watch_also(self, fd: int) -> None:
        """Have ``pump`` wait for ``fd`` to be readable too (the submit thread's wake-up pipe)."""
        self._poll.register(fd, _POLLIN)

    def pump(self, timeout_ms) -> set:
        """Wait up to ``timeout_ms`` (None: for ever) for the socket or the descriptors of
        ``watch_also``: what waits is written when the socket is writable, and what arrived is
        read into ``inbox``. The other descriptors found ready."""
        others = set()
        link = self.link
        for fd, events in self._poll.poll(timeout_ms):
            if link is None or fd != link.fd:
                others.add(fd)
                continue
            if events & _POLLOUT:
                self.flush()
            if events & ~_POLLOUT:  # readable, or hung up: the link's receive says which
                self._arrived(link.receive())
                self._follow_queue()
        return others

    def _arrived(self, messages: list) -> None:
        """Into ``inbox``: every message but what a ZMTP link read past as over its bounds
        (more than MAX_PARTS frames or MAX_BYTES: no daemon sends one)."""
        for message in messages:
            if type(message) is not tuple:
                self.inbox.append(message)

    def _follow_queue(self) -> None:
        """Watch for writing while the link's queue holds bytes: a ZMTP link writes what was
        sent before the daemon's READY when that READY is read (shared/zmtp.py ``held``)."""
        link = self.link
        if link is not None and not link.broken and bool(link.out) != self.writing:
            self._want_write(not self.writing)

    def _want_write(self, wanted: bool) -> None:
        self.writing = wanted
        self._poll.modify(self.link.fd, _POLLIN | (_POLLOUT if wanted else 0))

    def close(self) -> None:
        if self.link is not None:
            self._poll.unregister(self.link.fd)
            self.link.close()
            self.link = None
