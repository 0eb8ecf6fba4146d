"""The daemon's end of the buffer channel (the wire format is ``shared/fdchannel.py``).

A listening AF_UNIX SOCK_SEQPACKET socket and one socket per client connection, all
non-blocking, all watched by the arbiter's one poller: a readable connection gives one message
per pass. Every descriptor received is either owned by the registry or closed before the
handler returns, whatever went wrong. A client that does not read its answers (its send buffer
is full) is disconnected, like one that hangs up: either way its tokens are revoked.
"""

from __future__ import annotations

import errno
import logging
import socket
import struct
from pathlib import Path
from typing import Callable

from modelwarden.shared import fdchannel
from modelwarden.shared.protocol import (BAD_REQUEST, INTERNAL, ProtocolError, bad, error_header,
                                         request_id_of)
from modelwarden.supervisor.buffers import BufferRegistry, Peer
from modelwarden.supervisor.runtime import DaemonError, check_socket_path, restrict_socket

logger = logging.getLogger(__name__)

MAX_CONNECTIONS = 1024
ACCEPT_PAUSE_S = 1.0  # out of descriptors: stop accepting for a while instead of spinning
_UCRED = struct.Struct("3i")


class ChannelServer:
    def __init__(self, registry: BufferRegistry, path: Path, group: str | None,
                 watch: Callable[[int, Callable[[], None]], None], unwatch: Callable[[int], None],
                 pause: Callable[[float, Callable[[], None]], None],
                 on_revoked: Callable[[list[str]], None],
                 admit: Callable[[], bool] = lambda: True) -> None:
        self.registry = registry
        self.path = path
        self.group = group
        self._watch, self._unwatch, self._pause = watch, unwatch, pause
        self._on_revoked = on_revoked
        self._admit = admit  # the daemon's descriptor budget (connections.ConnectionGuard)
        self._listener: socket.socket | None = None
        self._listening = False
        self._peers: dict[socket.socket, Peer] = {}

    def listen(self) -> None:
        check_socket_path(self.path)  # a socket or nothing: never unlink another kind of file
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            self.path.unlink(missing_ok=True)  # a dead daemon's socket: the runtime lock is ours
            sock.bind(str(self.path))
            restrict_socket(self.path, self.group)
            sock.listen(64)
        except OSError as exc:
            sock.close()
            raise DaemonError(f"cannot listen on {self.path}: {exc}") from None
        sock.setblocking(False)
        self._listener = sock
        self._resume()

    def _accept(self) -> None:
        try:
            conn, _ = self._listener.accept()
        except BlockingIOError:
            return
        except OSError as exc:  # EMFILE/ENFILE: the pending connection would wake us forever
            logger.error("buffer channel: cannot accept (%s); pausing for %.0fs", exc, ACCEPT_PAUSE_S)
            self._listening = False
            self._unwatch(self._listener.fileno())
            self._pause(ACCEPT_PAUSE_S, self._resume)
            return
        admitted = self._admit()
        if len(self._peers) >= MAX_CONNECTIONS or not admitted:
            # Accepted only to be closed: a pending connection left in the backlog would wake the
            # level-triggered poll forever. The descriptor reserve covers this one.
            logger.warning("buffer channel: refusing a connection (%d open; descriptor budget %s)",
                           len(self._peers), "left" if admitted else "spent")
            conn.close()
            return
        conn.setblocking(False)
        pid, uid, gid = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
        peer = Peer(pid, uid, gid)
        self._peers[conn] = peer
        self._watch(conn.fileno(), lambda: self._serve(conn))
        logger.debug("buffer channel: %s connected", peer)

    def _resume(self) -> None:
        if self._listener is not None and not self._listening:
            self._listening = True
            self._watch(self._listener.fileno(), self._accept)

    def _serve(self, conn: socket.socket) -> None:
        peer = self._peers.get(conn)
        if peer is None:
            return
        try:
            message, fds = fdchannel.receive_message(conn)
        except BlockingIOError:
            return
        except ProtocolError as exc:  # truncated: its descriptors are closed already
            self._answer(conn, error_header(None, exc.code, exc.message))
            return
        except OSError:  # end of stream (ChannelClosed), or a reset
            self.disconnect(conn)
            return
        request_id = request_id_of(message) if message is not None else None
        try:
            answer = self._handle(peer, message, fds, request_id)
        except ProtocolError as exc:
            fdchannel.close_all(fds)
            answer = error_header(request_id, exc.code, exc.message)
        except Exception:  # a bug: the registry never took these descriptors; do not leak them
            logger.exception("buffer channel: error handling a message from %s", peer)
            fdchannel.close_all(fds)
            answer = error_header(request_id, INTERNAL, "internal error; see the daemon's log")
        self._answer(conn, answer)

    def _handle(self, peer: Peer, message: dict | None, fds: list[int], request_id) -> dict:
        if message is None:
            raise bad("a channel message is one msgpack map")
        kind = message.get("type")
        if kind == "register":
            if not fds:
                raise bad(f"register carries 1 to {fdchannel.MAX_FDS_PER_MESSAGE} descriptors")
            tokens = self.registry.register(peer, fds)  # owns the fds from here on
            return fdchannel.reply(request_id, tokens=tokens)
        if fds:
            raise bad(f"a {str(kind)[:32]!r} message carries no descriptors")
        if kind == "unregister":
            revoked = self.registry.unregister(peer, fdchannel.parse_token_list(message))
            self._on_revoked(revoked)
            return fdchannel.reply(request_id)
        raise ProtocolError(BAD_REQUEST, f"unknown channel message type {str(kind)[:32]!r}")

    def _answer(self, conn: socket.socket, answer: dict) -> None:
        try:
            fdchannel.send_message(conn, answer)
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
                logger.warning("buffer channel: %s does not read its answers; disconnecting",
                               self._peers.get(conn))
            self.disconnect(conn)

    def disconnect(self, conn: socket.socket) -> None:
        peer = self._peers.pop(conn, None)
        if peer is None:
            return
        self._unwatch(conn.fileno())
        conn.close()
        revoked = self.registry.drop(peer)
        logger.debug("buffer channel: %s gone, %d buffer(s) revoked", peer, len(revoked))
        self._on_revoked(revoked)

    def close(self) -> None:
        for conn in list(self._peers):
            self.disconnect(conn)
        if self._listener is not None:
            if self._listening:
                self._unwatch(self._listener.fileno())
            self._listener.close()
            self._listener = None
            self.path.unlink(missing_ok=True)
