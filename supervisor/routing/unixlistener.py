"""A Unix listener the supervisor's loop accepts on itself: ``buffers.sock``
(supervisor/routing/bufferserver.py) and each ``unix://`` frontend
(supervisor/routing/localfront.py).

Bound at a path that holds a socket or nothing, its file's mode and group set before it listens
(``restrict_socket``); in the loop's one poller unless the descriptor guard has paused it
(``Pausable``: what connects meanwhile waits in the kernel's backlog). Each connection is asked
who it is (``SO_PEERCRED``) and admitted within the daemon's descriptor budget and its uid's
share of connections (supervisor/routing/connections.py, quotas.py), or accepted only to be
closed: a pending connection left in the backlog would wake the level-triggered poll for ever,
and the descriptor reserve covers the one it takes. Refusals are logged at most once a minute
per uid, with a count. An accept that fails (EMFILE, ENFILE) stops listening for ACCEPT_PAUSE_S
rather than spin on the connection it could not take.

A subclass says what else refuses a connection (``_refusal_of_its_own``) and what becomes of an
admitted one (``_admitted``); giving the connection's share back when it closes is its own
(``_give_back``).
"""

from __future__ import annotations

import logging
import socket
from pathlib import Path
from typing import Callable

from modelwarden.shared.lograte import LineBudget
from modelwarden.shared.process import DaemonError, check_socket_path, restrict_socket
from modelwarden.shared.protocol import ProtocolError
from modelwarden.supervisor.routing.connections import ConnectionGuard
from modelwarden.supervisor.routing.identity import of_unix_socket, uid_identity

logger = logging.getLogger(__name__)

ACCEPT_PAUSE_S = 1.0  # out of descriptors: stop accepting for a while instead of spinning
LOGGED_EVERY_S = 60.0


class UnixListener:
    """``kind`` SOCK_STREAM or SOCK_SEQPACKET; ``label`` names it in the log; ``watch`` and
    ``unwatch`` put a descriptor in the loop's poller or take it out; ``later(delay, then)``
    runs ``then`` after ``delay`` seconds (the loop's timers)."""

    def __init__(self, path: Path, kind: int, backlog: int, group: str | None, label: str,
                 guard: ConnectionGuard, watch: Callable[[int, Callable[[], None]], None],
                 unwatch: Callable[[int], None],
                 later: Callable[[float, Callable[[], None]], None],
                 clock: Callable[[], float]) -> None:
        self.path = path
        self.kind, self.backlog, self.group, self.label = kind, backlog, group, label
        self.guard = guard  # the daemon's descriptor account and the identities' shares
        self._watch, self._unwatch, self._later = watch, unwatch, later
        self._clock = clock
        self._listener: socket.socket | None = None
        self._listening = False
        self.paused = False  # by the guard: the listener is out of the poller
        self._logged = LineBudget(LOGGED_EVERY_S)  # lines per uid

    def listen(self) -> None:
        check_socket_path(self.path)  # a socket or nothing: never unlink another kind of file
        sock = socket.socket(socket.AF_UNIX, self.kind | socket.SOCK_CLOEXEC)
        try:
            self.path.unlink(missing_ok=True)  # a dead daemon's socket: the runtime lock is ours
            sock.bind(str(self.path))
            restrict_socket(self.path, self.group)
            sock.listen(self.backlog)
        except OSError as exc:
            sock.close()
            raise DaemonError(f"cannot listen on {self.path}: {exc}") from None
        sock.setblocking(False)
        self._listener = sock
        self._listen_again()

    # -- the guard pauses and resumes this listener with the daemon's others (Pausable) --------

    def pause(self) -> None:
        self.paused = True
        self._stop_listening()

    def resume(self) -> None:
        self.paused = False
        self._listen_again()

    def _stop_listening(self) -> None:
        if self._listener is not None and self._listening:
            self._listening = False
            self._unwatch(self._listener.fileno())

    def _listen_again(self) -> None:
        if self._listener is not None and not self._listening and not self.paused:
            self._listening = True
            self._watch(self._listener.fileno(), self._accept)

    # Whether the socket file goes with the listener at a clean stop (else it stays, as
    # libzmq leaves an ipc:// one: see supervisor/routing/zmtpfront.py).
    unlink_at_close = True

    def close_listener(self) -> None:
        if self._listener is not None:
            self._stop_listening()
            self._listener.close()
            self._listener = None
            if self.unlink_at_close:
                self.path.unlink(missing_ok=True)

    # -- connections ---------------------------------------------------------------------------

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except BlockingIOError:
            return
        except OSError as exc:  # EMFILE/ENFILE: the pending connection would wake us forever
            logger.error("%s: cannot accept (%s); pausing for %.0fs", self.label, exc, ACCEPT_PAUSE_S)
            self._stop_listening()
            self._later(ACCEPT_PAUSE_S, self._listen_again)
            return
        try:
            pid, uid, gid = of_unix_socket(sock)
        except OSError:  # gone before we could ask
            sock.close()
            return
        refusal = self._refusal(uid_identity(uid))
        if refusal is not None:
            self.log_per_uid("refused", uid, refusal)
            sock.close()
            return
        self.guard.opened()
        sock.setblocking(False)
        self._admitted(sock, pid, uid, gid)

    def _refusal(self, identity: str) -> str | None:
        """Why this connection may not stay, or None (its identity's share is then taken)."""
        refusal = self._refusal_of_its_own()
        if refusal is not None:
            return refusal
        if not self.guard.can_accept():
            return "the daemon's descriptor budget is spent"
        if self.guard.quotas is not None:
            try:
                self.guard.quotas.take(identity, "connections")
            except ProtocolError as exc:
                return exc.message
        return None

    def _give_back(self, identity: str) -> None:
        """A connection admitted here has closed: its descriptor and its share."""
        self.guard.closed()
        if self.guard.quotas is not None:
            self.guard.quotas.give_back(identity, "connections")

    def log_per_uid(self, done: str, uid: int, why: str) -> None:
        """``LABEL: DONE N connection(s) from uid U: WHY``, at most once a minute per uid, with
        the count since the last line."""
        count = self._logged.due(str(uid), self._clock())
        if count:
            logger.warning("%s: %s %d connection(s) from uid %d%s: %s", self.label, done, count,
                           uid, " since the last report" if count > 1 else "", why)

    def _refusal_of_its_own(self) -> str | None:
        return None

    def _admitted(self, sock: socket.socket, pid: int, uid: int, gid: int) -> None:
        raise NotImplementedError
