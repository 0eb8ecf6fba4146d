"""The daemon's end of the buffer channel (the wire format is ``shared/fdchannel.py``).

A listening AF_UNIX SOCK_SEQPACKET socket and one socket per client connection, all
non-blocking, all watched by the arbiter's one poller: a readable connection gives one message
per pass. Every descriptor received is either owned by the registry or closed before the
handler returns, whatever went wrong. A client that does not read its answers (its send buffer
is full) is disconnected, like one that hangs up: either way its tokens are revoked.

Every descriptor here is in the daemon's one account (supervisor/routing/connections.py): each
connection, and each descriptor received, from the moment ``recvmsg`` installed it until it is
closed or revoked. Under the reserve the listener is paused with the daemon's others and
registrations are refused OVERLOADED. Each peer is its uid (``SO_PEERCRED``), and its connections
are within its identity's share (supervisor/routing/quotas.py). Refused connections are logged at most
once a minute per uid, with a count. The listener's part is supervisor/routing/unixlistener.py's.
"""

from __future__ import annotations

import errno
import logging
import socket
from pathlib import Path
from typing import Callable

from modelwarden.shared import fdchannel
from modelwarden.shared.protocol import (BAD_REQUEST, INTERNAL, OVERLOADED, ProtocolError, bad,
                                         error_header, request_id_of)
from modelwarden.supervisor.routing.buffers import BufferRegistry, Peer
from modelwarden.supervisor.routing.connections import ConnectionGuard
from modelwarden.supervisor.routing.unixlistener import UnixListener

logger = logging.getLogger(__name__)

MAX_CONNECTIONS = 1024
BACKLOG = 64


class BufferServer(UnixListener):
    def __init__(self, registry: BufferRegistry, path: Path, group: str | None,
                 watch: Callable[[int, Callable[[], None]], None], unwatch: Callable[[int], None],
                 pause: Callable[[float, Callable[[], None]], None],
                 on_revoked: Callable[[list[str]], None], guard: ConnectionGuard,
                 clock: Callable[[], float]) -> None:
        super().__init__(path, socket.SOCK_SEQPACKET, BACKLOG, group, "buffer channel", guard,
                         watch, unwatch, pause, clock)
        self.registry = registry
        self.endpoint = str(path)
        self._on_revoked = on_revoked
        self._peers: dict[socket.socket, Peer] = {}

    def _refusal_of_its_own(self) -> str | None:
        if len(self._peers) >= MAX_CONNECTIONS:
            return f"{len(self._peers)} channel connections open"
        return None

    def _admitted(self, conn: socket.socket, pid: int, uid: int, gid: int) -> None:
        peer = Peer(pid, uid, gid)
        self._peers[conn] = peer
        self._watch(conn.fileno(), lambda: self._serve(conn))
        logger.debug("buffer channel: %s connected", peer)

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
        self.guard.charge(len(fds))  # in our table since recvmsg: refunded when closed or revoked
        request_id = request_id_of(message) if message is not None else None
        try:
            answer = self._handle(peer, message, fds, request_id)
        except ProtocolError as exc:
            self._close_received(fds)
            answer = error_header(request_id, exc.code, exc.message)
        except Exception:  # a bug: the registry never took these descriptors; do not leak them
            logger.exception("buffer channel: error handling a message from %s", peer)
            self._close_received(fds)
            answer = error_header(request_id, INTERNAL, "internal error; see the daemon's log")
        self._answer(conn, answer)

    def _close_received(self, fds: list[int]) -> None:
        fdchannel.close_all(fds)
        self.guard.refund(len(fds))

    def _handle(self, peer: Peer, message: dict | None, fds: list[int], request_id) -> dict:
        if message is None:
            raise bad("a channel message is one msgpack map")
        kind = message.get("type")
        if kind == fdchannel.REGISTER:
            if not fds:
                raise bad(f"register carries 1 to {fdchannel.MAX_FDS_PER_MESSAGE} descriptors")
            if not self.guard.can_take():
                raise ProtocolError(OVERLOADED, "the daemon's descriptor budget is spent: no "
                                    "buffer can be registered now; retry later")
            tokens = self.registry.register(peer, fds)  # owns the fds from here on
            return fdchannel.reply(request_id, tokens=tokens)
        if fds:
            raise bad(f"a {str(kind)[:32]!r} message carries no descriptors")
        if kind == fdchannel.UNREGISTER:
            revoked = self.registry.unregister(peer, fdchannel.parse_token_list(message))
            self.guard.refund(len(revoked))
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
        self._give_back(peer.identity)
        revoked = self.registry.drop(peer)
        self.guard.refund(len(revoked))
        logger.debug("buffer channel: %s gone, %d buffer(s) revoked", peer, len(revoked))
        self._on_revoked(revoked)

    def close(self) -> None:
        for conn in list(self._peers):
            self.disconnect(conn)
        self.close_listener()
