"""The client for several daemons: ``modelwarden.connect(["tcp://a:5555", "tcp://b:5555"], ...)``.

``connect`` and ``connect_async`` (client/connect.py) make these when given more than one
endpoint (a list, or a comma-separated string such as ``MODELWARDEN_ENDPOINT=tcp://a:5555,
tcp://b:5555``); with one endpoint they never import this module, so the single-daemon path stays
as it is. The policy (health, least outstanding requests, once-only re-sends) is client/balancer.py;
this module owns the sockets.

One background I/O thread owns one DEALER per endpoint, a socket monitor per DEALER (a dropped
connection, or a refused CURVE handshake, is seen at once) and the heartbeats (a ``hello`` every
``heartbeat_interval``; a daemon silent for ``heartbeat_timeout`` is DOWN: a stopped or hung
daemon, or a cut link, drops no connection). ``infer`` and ``submit`` from any thread hand
requests to it; ``infer`` waits for the future.

What the caller sees:

- a request is answered by one daemon; when the daemon holding it is lost, it is re-sent once to
  another, so a request runs at most twice; lost twice, it fails with Poison;
- OVERLOADED, SHUTTING_DOWN or NO_WORKER from one daemon (the request did not run) tries each
  other UP daemon before failing with that error;
- with no daemon UP, a request waits for one until its deadline (then Timeout);
- ``hello()`` is the offer of the first daemon that answered; ``health()`` says which are UP.

CURVE keys: ``server_key`` is one key for the whole fleet (the daemons share a server key pair,
as in deploy/kubernetes/) or a dict ``{endpoint: key}``; ``client_key`` is one pair. Shared memory
is used per endpoint as by the single client, but ``empty()`` returns an ordinary tensor: which
daemon will read it is not known when it is made.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from modelwarden.shared import protocol
from modelwarden.client.balancer import Balancer, Health, Next, Ticket
from modelwarden.client.connection import Connection
from modelwarden.client.curve import ClientKeys, client_keys
from modelwarden.shared.errors import Poison, RemoteError, Timeout
from modelwarden.client.ipcaccess import check_ipc_endpoint
from modelwarden.shared.protocol import SIGNATURE
from modelwarden.client.session import GRACE_S, HELLO_TIMEOUT_S, Pending, Session
from modelwarden.shared.sockets import recv_frames

logger = logging.getLogger(__name__)

HEARTBEAT_ID = "heartbeat-"  # heartbeat hellos carry str ids; requests carry int ids
# Refusals that prove the request never ran: another daemon may take it.
NOT_RUN = {protocol.OVERLOADED, protocol.SHUTTING_DOWN, protocol.NO_WORKER}
RAN_ANYWAY = "reply dropped"  # an OVERLOADED in place of a result: it did run
CONNECTION_LOST = (zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                   | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


def split_endpoints(endpoint: str | list[str] | tuple[str, ...]) -> list[str]:
    """``"a,b"`` or ``["a", "b"]`` -> ``["a", "b"]`` (spaces around commas allowed)."""
    items = endpoint.split(",") if isinstance(endpoint, str) else list(endpoint)
    endpoints = [item.strip() for item in items if item.strip()]
    if not endpoints:
        raise ValueError(f"no endpoint in {endpoint!r}")
    if len(endpoints) > 1:
        local = [item for item in endpoints if item.startswith("unix://")]
        if local:
            # Several daemons are a fleet's: heartbeats, re-sends and balancing are built on
            # DEALERs. A unix:// endpoint is one local daemon's (Client, AsyncClient).
            raise ValueError(f"{local[0]}: a unix:// endpoint is one daemon's; connect to "
                             "several over ipc:// or tcp://")
    return endpoints


def _keys_for(endpoint: str, server_key: Any, client_key: Any) -> ClientKeys | None:
    if isinstance(server_key, dict):
        server_key = server_key.get(endpoint)
    return client_keys(endpoint, server_key, client_key)


class MultiClient:
    """The synchronous client over several daemons (made by ``Client``, same methods)."""

    def __init__(self, endpoints: list[str], *, timeout: float = 30.0, shm: bool | None = None,
                 copy_outputs: bool = False, server_key: Any = None, client_key: Any = None,
                 heartbeat_interval: float = 1.0, heartbeat_timeout: float = 5.0) -> None:
        self.endpoints = endpoints
        self.endpoint = ",".join(endpoints)
        self.timeout = timeout
        for endpoint in endpoints:
            check_ipc_endpoint(endpoint)  # EACCES now, not a timeout later
        links = [_Link(endpoint, Session(endpoint, shm, copy_outputs),
                       _keys_for(endpoint, server_key, client_key)) for endpoint in endpoints]
        balancer = Balancer(endpoints, time.monotonic, heartbeat_interval, heartbeat_timeout)
        self._io = _BalancingThread(links, balancer)
        self._io.start()
        self._closed = False

    def __enter__(self) -> "MultiClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def hello(self) -> dict:
        """The offer of the first daemon that answered (models, protocol)."""
        try:
            return self._io.first_offer.result(min(self.timeout, HELLO_TIMEOUT_S))
        except concurrent.futures.TimeoutError:
            raise Timeout(f"no daemon of {self.endpoint} answered a hello") from None

    def health(self) -> dict[str, str]:
        """endpoint -> UNKNOWN, UP or DOWN, as the balancer sees it now."""
        return self._io.health()

    def infer(self, model: str, inputs: Any, timeout: float | None = None,
              details: bool = False) -> Any:
        return self.submit(model, inputs, timeout, details).result()

    def submit(self, model: str, inputs: Any, timeout: float | None = None,
               details: bool = False) -> concurrent.futures.Future:
        if self._closed:
            raise RuntimeError("the client is closed")
        timeout = self.timeout if timeout is None else timeout
        return self._io.submit(_Call(model, inputs, timeout, details))

    def empty(self, shape, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._io.stop()


class AsyncMultiClient:
    """``await client.infer(...)`` over several daemons: the same I/O thread, its futures
    awaited from the event loop."""

    def __init__(self, endpoints: list[str], **options: Any) -> None:
        self._client = MultiClient(endpoints, **options)
        self.endpoints = endpoints
        self.endpoint = self._client.endpoint
        self.timeout = self._client.timeout

    async def __aenter__(self) -> "AsyncMultiClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def hello(self) -> dict:
        return await asyncio.to_thread(self._client.hello)

    def health(self) -> dict[str, str]:
        return self._client.health()

    async def infer(self, model: str, inputs: Any, timeout: float | None = None,
                    details: bool = False) -> Any:
        return await asyncio.wrap_future(self._client.submit(model, inputs, timeout, details))

    def empty(self, shape, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self._client.empty(shape, dtype)

    async def close(self) -> None:
        self._client.close()


# -- the I/O thread -----------------------------------------------------------------------------


@dataclass
class _Call:
    model: str
    inputs: Any
    timeout: float
    details: bool


@dataclass(eq=False)
class _Request:
    call: _Call
    future: concurrent.futures.Future
    ticket: Ticket
    sends: dict[str, Pending] = field(default_factory=dict)  # endpoint -> its pending record
    renewed: bool = False  # buffers registered again once already (buffer_not_registered)


class _Link:
    """One endpoint: its connection (a DEALER and the monitor of that DEALER), its session."""

    def __init__(self, endpoint: str, session: Session, curve: ClientKeys | None) -> None:
        self.endpoint = endpoint
        self.session = session
        self.curve = curve
        self.connection: Connection | None = None

    def open(self, context: zmq.Context) -> None:
        self.connection = Connection(context, self.endpoint, self.curve, CONNECTION_LOST)

    @property
    def socket(self) -> zmq.Socket:
        return self.connection.socket

    @property
    def monitor(self) -> zmq.Socket:
        return self.connection.monitor

    def close(self) -> None:
        if self.connection is not None:
            self.connection.close()


class _BalancingThread(threading.Thread):
    def __init__(self, links: list[_Link], balancer: Balancer) -> None:
        super().__init__(name="modelwarden-balancer-io", daemon=True)
        self.links = {link.endpoint: link for link in links}
        self.balancer = balancer
        self.context = zmq.Context()
        self.first_offer: concurrent.futures.Future = concurrent.futures.Future()
        self.inbox: collections.deque = collections.deque()
        self.requests: dict[int, _Request] = {}  # ticket key -> request
        self.waiting: dict[tuple[str, int], _Request] = {}  # (endpoint, request id) -> request
        self.keys = itertools.count(1)
        self.heartbeat_ids = itertools.count(1)
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        self._stopping = False
        self._health_lock = threading.Lock()
        self._health: dict[str, str] = {endpoint: Health.UNKNOWN.value for endpoint in self.links}
        self.poller = zmq.Poller()
        self.by_socket: dict[zmq.Socket, Callable[[], None]] = {}

    # -- called from other threads ------------------------------------------------------------

    def submit(self, call: _Call) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.inbox.append((call, future))
        os.write(self._wake_write, b"x")
        return future

    def health(self) -> dict[str, str]:
        with self._health_lock:
            return dict(self._health)

    def stop(self) -> None:
        self._stopping = True
        os.write(self._wake_write, b"x")
        self.join(5)

    # -- the loop -------------------------------------------------------------------------------

    def run(self) -> None:
        self.poller.register(self._wake_read, zmq.POLLIN)
        for link in self.links.values():
            link.open(self.context)
            self._watch(link)
        try:
            while not self._stopping:
                events = dict(self.poller.poll(self._poll_timeout_ms()))
                if self._wake_read in events:
                    self._take_inbox()
                for socket, handle in list(self.by_socket.items()):
                    if socket in events:
                        handle()
                self._keep_time()
        finally:
            self._close()

    def _watch(self, link: _Link) -> None:
        self.poller.register(link.socket, zmq.POLLIN)
        self.poller.register(link.monitor, zmq.POLLIN)
        self.by_socket[link.socket] = lambda: self._take_replies(link)
        self.by_socket[link.monitor] = lambda: self._take_events(link)

    def _queue(self, link: _Link, messages: list[list]) -> None:
        """Send without waiting; a socket that libzmq gave up (a refused handshake) is replaced
        by a new one (client/connection.py), watched from now on."""
        socket, monitor = link.socket, link.monitor
        if link.connection.send(messages):
            for old in (socket, monitor):
                self.poller.unregister(old)
                del self.by_socket[old]
            self._watch(link)

    def _poll_timeout_ms(self) -> int | None:
        wakeup = self.balancer.next_wakeup()
        return None if wakeup is None else max(0, int((wakeup - time.monotonic()) * 1000) + 1)

    def _keep_time(self) -> None:
        for endpoint in self.balancer.silent():
            self._lose(endpoint, f"no heartbeat answered for {self.balancer.heartbeat_timeout}s")
        for endpoint in self.balancer.heartbeats_due():
            self._send_heartbeat(self.links[endpoint])
        for ticket in self.balancer.expired():
            request = self.requests.get(ticket.key)
            if request is not None:
                self._fail(request, Timeout(
                    f"no daemon of {','.join(self.links)} answered within "
                    f"{request.call.timeout + GRACE_S:.1f}s (are they running? are the CURVE keys "
                    f"right?); health now: {self.health()}"))

    def _take_inbox(self) -> None:
        try:
            os.read(self._wake_read, 4096)
        except BlockingIOError:
            pass
        while self.inbox:
            call, future = self.inbox.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            ticket = self.balancer.add(next(self.keys), call.timeout + GRACE_S)
            request = _Request(call, future, ticket)
            self.requests[ticket.key] = request
            self._route(request)

    # -- sending --------------------------------------------------------------------------------

    def _route(self, request: _Request) -> None:
        endpoint = self.balancer.route(request.ticket)
        if endpoint is not None:  # else parked until a daemon comes up or its deadline
            self._send(request, endpoint)

    def _send(self, request: _Request, endpoint: str) -> None:
        link = self.links[endpoint]
        call = request.call
        # A re-sent request keeps its first deadline: the daemon gets what is left of it.
        left = max(0.0, request.ticket.deadline - GRACE_S - time.monotonic())
        try:
            messages, pending = link.session.build(call.model, call.inputs, left, call.details)
            self._queue(link, messages)
        except BaseException as exc:  # inputs that cannot be encoded: the caller's error
            self._fail(request, exc)
            return
        request.sends[endpoint] = pending
        self.waiting[(endpoint, pending.id)] = request

    def _send_heartbeat(self, link: _Link) -> None:
        header = {"type": protocol.CLIENT_HELLO, "id": f"{HEARTBEAT_ID}{next(self.heartbeat_ids)}"}
        self._queue(link, [[SIGNATURE, protocol.pack(header)]])

    # -- receiving ------------------------------------------------------------------------------

    def _take_replies(self, link: _Link) -> None:
        while True:
            frames = recv_frames(link.socket, zmq.NOBLOCK)
            if frames is None:
                return
            try:
                request_id, header, payload = link.session.split(frames)
            except (RemoteError, protocol.ProtocolError):  # not our protocol: ignore it
                continue
            if isinstance(request_id, str) and request_id.startswith(HEARTBEAT_ID):
                self._heartbeat_answered(link, header)
            else:
                self._request_answered(link, request_id, header, payload)

    def _heartbeat_answered(self, link: _Link, header: Any) -> None:
        if not isinstance(header, dict) or not header.get("ok"):  # an inference reply is no offer
            return
        link.session.accept_offer(header)
        if not self.first_offer.done():
            self.first_offer.set_result(link.session.offer)
        if self.balancer.heartbeat_answered(link.endpoint):
            self._publish_health()
            for ticket in self.balancer.unpark():
                self._route(self.requests[ticket.key])

    def _request_answered(self, link: _Link, request_id: Any, header: dict, payload: list) -> None:
        request = self.waiting.pop((link.endpoint, request_id), None)
        if request is None or request.future.done():
            return  # a reply we stopped waiting for
        pending = request.sends.pop(link.endpoint)
        session = link.session
        reply = session.read(header, payload)
        holds = link.endpoint in request.ticket.held_by
        if holds and not request.renewed and session.forgotten(reply, pending):
            request.renewed = True  # the daemon restarted: buffers registered again, same daemon
            self._send(request, link.endpoint)
            return
        if not reply.ok and reply.error.code in NOT_RUN and not reply.error.message.startswith(RAN_ANYWAY):
            session.release(pending)
            if not holds:
                return  # a late refusal from a daemon already given up on: nothing to learn
            verdict = self.balancer.refused(request.ticket, link.endpoint)
            if verdict is Next.ROUTE:
                self._route(request)
                return
            if verdict is Next.WAIT:
                return
        else:
            self.balancer.finished(request.ticket)
        self._finish(request)
        try:
            request.future.set_result(session.decode(pending, reply, payload))
        except BaseException as exc:
            request.future.set_exception(exc)

    def _take_events(self, link: _Link) -> None:
        while True:
            try:
                event = recv_monitor_message(link.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] & CONNECTION_LOST:
                self._lose(link.endpoint, "its connection dropped")

    # -- losing a daemon, ending a request ------------------------------------------------------

    def _lose(self, endpoint: str, why: str) -> None:
        resend, fail = self.balancer.lost(endpoint, why)
        self._publish_health()
        if resend or fail:
            logger.warning("daemon %s lost: %d request(s) re-sent, %d failed POISON (lost twice)",
                           endpoint, len(resend), len(fail))
        for ticket in fail:
            self._fail(self.requests[ticket.key], Poison(
                f"the request was in flight on two daemons that were both lost (the last: "
                f"{endpoint}, {why}); it is not sent again"))
        for ticket in resend:
            self._route(self.requests[ticket.key])

    def _fail(self, request: _Request, error: BaseException) -> None:
        self.balancer.finished(request.ticket)
        self._finish(request)
        if not request.future.done():
            request.future.set_exception(error)

    def _finish(self, request: _Request) -> None:
        """Forget the request; the buffers of sends that never answered are never reused (a
        worker may still write into them)."""
        self.requests.pop(request.ticket.key, None)
        for endpoint, pending in request.sends.items():
            self.waiting.pop((endpoint, pending.id), None)
            self.links[endpoint].session.discard(pending)
        request.sends.clear()

    def _publish_health(self) -> None:
        with self._health_lock:
            self._health = {endpoint: state.health.value
                            for endpoint, state in self.balancer.endpoints.items()}

    def _close(self) -> None:
        for request in list(self.requests.values()):
            self._fail(request, RuntimeError("the client was closed"))
        while self.inbox:  # submitted but never sent: they must not wait forever either
            future = self.inbox.popleft()[-1]
            if future.set_running_or_notify_cancel():
                future.set_exception(RuntimeError("the client was closed"))
        for link in self.links.values():
            link.close()
            link.session.close()
        os.close(self._wake_read)
        os.close(self._wake_write)
        self.context.term()
