"""Messages in, on the request path: each poll round drains the clients' messages from a frontend
and each worker's messages from its link (shared/link.py), here, compiled (intake.pxd), and
hands requests and results to the router. What is not per request goes back to the Arbiter: a
client's ``hello``, every worker message but an authenticated worker's result or results (its
hello, state, heartbeat, failure, and anything the gate refuses: ``Arbiter.worker_message``),
and a link its worker closed or garbled (``Arbiter.link_closed``).

Each drain of a frontend takes at most DRAIN_MAX messages (the poller is level-triggered, so
the next round sees whatever is left), which keeps every socket served in turn; a link's drain
takes what its socket holds, up to 4 MiB (shared/link.py READ_PER_CALL: a worker's large result
streams in over several rounds, between which the other sockets are served). Client messages
arrive through shared/sockets.py, small frames as bytes, with the property that names their
sender; a message is checked (frames and bytes), split, and its header parsed strictly before
anything else is read of it. A bug while handling one message is logged and answered INTERNAL;
it never stops the drain, nor the daemon.
"""

from __future__ import annotations

import logging
from typing import Protocol

import zmq

from modelwarden.shared.protocol import (BAD_REQUEST, CLIENT_HELLO, INFER, INTERNAL, RESULT,
                                         RESULTS, SIGNATURE, ProtocolError, pack, read_result,
                                         reply_route, request_id_of, split_router_message,
                                         unpack_header)
from modelwarden.shared.sockets import recv_routed, send_parts
from modelwarden.shared.states import ALIVE
from modelwarden.supervisor.routing.identity import of_property, property_of
from modelwarden.supervisor.routing.limits import check_message

logger = logging.getLogger(__name__)

DRAIN_MAX = 64  # messages read from one frontend per poll round


class IntakeHost(Protocol):
    """What the intake needs from the Arbiter: its router, sockets and settings; ``clock()``;
    for a worker its pool did not mark as its own (``WorkerHandle.pool``), its pool
    (``pool_of``); and the three things it hands back: a client's ``hello``, a worker message
    off the request path, and a link that is done."""

    router: object
    settings: object
    frontends: list
    frontend_transports: list

    def clock(self) -> float: ...

    def pool_of(self, handle): ...

    def hello(self, index: int) -> dict: ...

    def worker_message(self, handle, frames: list) -> None: ...

    def link_closed(self, handle) -> None: ...


class Intake:
    def __init__(self, host):
        self.host = host
        self.router = host.router
        self.clock = host.clock
        # The last sender, kept across rounds: one peer's messages often come in a row, so its
        # identity is parsed once, and its connection, the key of its byte ledgers, stays one
        # tuple, which their dicts find by identity rather than by hashing a new one.
        self.raw = None  # its identity as the frontend's property gave it
        self.peer = None  # that identity parsed (identity.of_property)
        self.connection = (-1, None)  # (frontend index, routing id)
        # Frontend index -> (socket, transport, the property naming its peers, the bytes a
        # message may hold), read from the host at its first drain: none of them changes while
        # the daemon runs (daemon settings do not apply live), and the host's and pydantic's
        # attribute lookups cost more than the rest of a drain's set-up.
        self.fronts = {}

    # -- clients ------------------------------------------------------------------------------

    def drain_clients(self, index):
        """Up to DRAIN_MAX messages from frontend ``index``."""
        front = self.fronts.get(index)
        if front is None:
            front = self.fronts[index] = self._front(index)
        sock, transport, prop, max_bytes = front
        for _ in range(DRAIN_MAX):
            received = recv_routed(sock, prop)
            if received is None:
                return
            frames, raw = received
            connection = self.connection
            if raw != self.raw or frames[0] != connection[1] or index != connection[0]:
                self.raw = raw
                self.peer = of_property(raw, transport)
                self.connection = connection = (index, frames[0])
            try:
                self.client_message(index, sock, frames, connection, self.peer, max_bytes)
            except Exception:
                logger.exception("error handling a client message")
                self.router.send_error(sock, reply_route(frames), None, INTERNAL,
                                       "internal error; see the daemon's log")

    def _front(self, index):
        host = self.host
        transport = host.frontend_transports[index]
        return (host.frontends[index], transport, property_of(transport).encode(),
                host.settings.daemon.max_message_bytes)

    def client_message(self, index, sock, frames, connection, peer, max_bytes):
        """``frames`` as shared/sockets.py receives them (small ones bytes); ``connection``
        (``index``, the routing id ``frames[0]``); ``peer`` the identity whose shares the
        message counts against."""
        router = self.router
        try:
            check_message(frames, max_bytes)
        except ProtocolError as exc:
            route = reply_route(frames)
            frames.clear()  # release the payload now, not after the reply is queued
            router.send_error(sock, route, None, exc.code, exc.message)
            return
        try:
            envelope = split_router_message(frames)
        except ProtocolError as exc:
            router.send_error(sock, reply_route(frames), None, exc.code, exc.message)
            return
        parsed = router.parses.parse(envelope.header, len(envelope.payload))
        if parsed is not None:  # an infer header seen before, but for its id
            router.accept_parsed(sock, connection, envelope, parsed, peer)
            return
        try:
            header = unpack_header(envelope.header)
        except ProtocolError as exc:
            router.send_error(sock, reply_route(frames), None, exc.code, exc.message)
            return
        kind = header.get("type")
        if kind == INFER:
            router.accept_infer(sock, connection, envelope, header, peer)
            return
        request_id = request_id_of(header)
        if kind != CLIENT_HELLO:
            router.send_error(sock, envelope.route, request_id, BAD_REQUEST,
                              f"unknown request type {str(kind)[:32]!r}")
            return
        try:
            reply = self.host.hello(index)
        except ProtocolError as exc:
            router.send_error(sock, envelope.route, request_id, exc.code, exc.message)
            return
        reply.update(id=request_id, ok=True)
        send_parts(sock, [*envelope.route, SIGNATURE, pack(reply)])

    # -- workers ------------------------------------------------------------------------------

    def drain_link(self, handle):
        """What worker ``handle`` wrote on its link (shared/link.py) since the last round, and
        what waited to be written to it. A link the worker closed, or garbled, goes back to the
        Arbiter (``link_closed``) once the messages before that are handled."""
        link = handle.link
        if link.out:
            link.flush()
        for frames in link.receive():
            try:
                self.worker_message(handle, frames)
            except Exception:
                logger.exception("unexpected error in a message of %s", handle.worker_id)
        if link.eof or link.broken:
            self.host.link_closed(handle)

    def worker_message(self, handle, frames):
        """An authenticated worker's result goes to the router; anything else to the Arbiter."""
        if handle.authenticated and frames:
            header = read_result(frames[0])  # a success as the worker writes it
            if header is None:
                try:
                    header = unpack_header(frames[0], False)
                except ProtocolError:
                    header = None  # the Arbiter refuses it, saying why
            kind = header.get("type") if header is not None else None
            if kind == RESULT or kind == RESULTS:
                if handle.state in ALIVE:  # else declared dead: what it says is too late
                    handle.last_seen = self.clock()
                    pool = handle.pool
                    if pool is None:
                        pool = self.host.pool_of(handle)
                    if kind == RESULT:
                        self.router.on_result(pool, handle, header, frames[1:])
                    else:
                        self.router.on_results(pool, handle, header, frames[1:])
                return
        self.host.worker_message(handle, frames)
