"""The modelwarden client.

    from modelwarden import Client
    with Client() as client:                     # MODELWARDEN_ENDPOINT, or the local daemon
        y = client.infer("mlp", torch.randn(8, 64))
        futures = [client.submit("mlp", x) for x in batch]   # many in flight

Inputs are a tensor, a list/tuple of tensors, or a dict of named tensors (numpy arrays work too);
outputs come back in the model's own structure. If every input is a numpy array, outputs are
numpy arrays too (bfloat16 outputs stay torch tensors: numpy has no bfloat16).

Shared memory. On an ``ipc://`` or ``unix://`` endpoint, tensors of ``shm_threshold`` bytes or more (the
daemon's setting, 64 KiB by default) travel in shared memory: the client copies an ordinary
tensor once into a reused buffer, and a tensor made by ``client.empty()`` is sent with no copy
at all. Outputs of that size come back as tensors *over shared memory* (no copy): they stay
valid for as long as you hold them, and their buffer is reused only after they are freed. Pass
``copy_outputs=True`` for ordinary tensors instead. Over ``tcp://`` everything travels inline:
same API, same results. The buffers are sealed memfds, registered once each on the daemon's buffer
channel (one Unix connection per client, ``shared/fdchannel.py``); after a daemon restart they are
registered again on the next request that needs them.

Do not modify an input tensor while its request is in flight (after ``submit`` returns and
before its future is done): the worker may be reading it in place.

Threads. A Client may be shared by any number of threads: ``infer`` talks over a socket owned by
the calling thread, and ``submit`` hands requests to one background I/O thread. An AsyncClient
is used from one event loop at a time (a later loop takes it over).

The local frontend. ``Client("unix:///run/modelwarden/local.sock")`` talks to a daemon's
``unix://`` frontend (client/local.py): the same requests and answers with no ZeroMQ on either
side, so less CPU per request in the client and the supervisor. A daemon not listening there is
waited for until the timeout, then NoDaemon; one that closes the connection (it stopped or
restarted) fails what waited on it at once with ConnectionLost, and the next request connects
again.

CURVE. A ``tcp://`` frontend of a daemon with ``[daemon.curve]`` answers only a client that has
the server's public key and an allowed key pair: ``Client("tcp://host:5555",
server_key="server.key", client_key="me.key_secret")`` (or MODELWARDEN_SERVER_KEY and
MODELWARDEN_CLIENT_KEY); see modelwarden.client.curve. A wrong or missing key gets no answer
at all, so it shows as a Timeout.

Several daemons. ``modelwarden.connect(["tcp://a:5555", "tcp://b:5555"], ...)`` (or commas in the
string, or in MODELWARDEN_ENDPOINT) returns a MultiClient (client/multiclient.py) with the same
methods as Client, and ``Client`` itself for one endpoint: each
request goes to the healthy daemon with the fewest outstanding requests; a daemon that stops
answering heartbeats or drops its connection is set aside and its requests are re-sent once to
another (a request runs at most twice: Poison after a second loss); OVERLOADED tries another
daemon first. docs/PROTOCOL.md section 11 has the rules. One endpoint: nothing of that is loaded.

Errors. A failed request raises a subclass of RemoteError whose ``code`` is the protocol's error
code (``BadInput``, ``ModelError``, ``Timeout``...). A daemon that does not answer within the
timeout (plus a grace second) raises Timeout too, saying so. An ``ipc://`` socket that exists
but that this process may not reach (file permissions: see docs/ARCHITECTURE.md, "Trust
boundary") raises PermissionError at once, naming the path and who may reach it. With no
endpoint and no configuration, a runtime directory or socket that another user made (say a
squatted ``/tmp/modelwarden-UID``) raises UntrustedRuntimeDir, a PermissionError, at once, and
so does a ``buffers.sock`` in such a directory that the daemon's hello names: nothing is sent.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import heapq
import os
import threading
import time
import warnings
import weakref
from typing import Any

import torch
import zmq

from modelwarden.shared import protocol
from modelwarden.client.control import control_request
from modelwarden.client.connection import Connection
from modelwarden.client.local import LocalConnection, is_direct, is_local
from modelwarden.client.curve import ClientKeys, client_keys
from modelwarden.shared.errors import (BadInput, BadRequest, ConnectionLost, InternalError,
                                       ModelError, NoDaemon, NoWorker, OutOfMemory, Overloaded,
                                       Poison, RemoteError, ShuttingDown, Timeout, UnknownModel,
                                       WorkerDied)
from modelwarden.client.ipcaccess import check_ipc_endpoint
from modelwarden.shared.rawconfig import (ENV_CONFIG, ENV_ENDPOINT, client_runtime_dir,
                                          discovered_frontend, frontend_endpoints)
from modelwarden.client.session import GRACE_S, HELLO_TIMEOUT_S, Reply, Session
from modelwarden.shared.sockets import Poller, recv_frames


# -- finding the daemon -------------------------------------------------------------------------


def default_endpoint() -> str:
    """MODELWARDEN_ENDPOINT; else the first ``unix://`` frontend of MODELWARDEN_CONFIG, its first
    ``ipc://`` one, or its first; else the local daemon's own socket in its default directory
    (``local.sock`` where it made one, else ``frontend.sock``), once the directory and the
    socket show that this user, root or the system daemon made them (shared/trustdir.py:
    UntrustedRuntimeDir, a PermissionError, naming the path and its owner; NoDaemon when the
    directory does not exist)."""
    if os.environ.get(ENV_ENDPOINT):
        return os.environ[ENV_ENDPOINT]
    if os.environ.get(ENV_CONFIG):
        chosen = preferred_frontend(frontend_endpoints())
        if chosen is not None:
            return chosen
    return discovered_frontend(client_runtime_dir())


def preferred_frontend(frontends: list[str]) -> str | None:
    """Of a configuration's frontends, the one a client on the daemon's host uses: the first
    ``unix://`` one (no ZeroMQ between), else the first ``ipc://`` one (shared memory), else
    the first; None when there is none."""
    on_this_host = [endpoint for endpoint in frontends if endpoint.startswith(("unix://", "ipc://"))]
    on_this_host.sort(key=lambda endpoint: not is_local(endpoint))
    return (on_this_host or frontends or [None])[0]


# -- one socket ---------------------------------------------------------------------------------


class _Connection(Connection):
    """One DEALER socket owned by one thread: one connection as the daemon sees it. Its poller
    follows the socket when it is replaced; the I/O thread adds its wake-up pipe to it."""

    def __init__(self, context: zmq.Context, endpoint: str, curve: ClientKeys | None = None) -> None:
        check_ipc_endpoint(endpoint)  # EACCES now, not a timeout later
        super().__init__(context, endpoint, curve)
        self.poller = Poller()
        self.poller.register(self.socket)

    def replace(self) -> None:
        self.poller.unregister(self.socket)
        super().replace()
        self.poller.register(self.socket)

    def receive(self, timeout_s: float) -> list | None:
        """One message's frames, or None when nothing came within the timeout."""
        if not self.poller.poll(max(0, int(timeout_s * 1000))):
            return None
        return recv_frames(self.socket)

    def __del__(self) -> None:
        # The thread that owned this connection has ended (its threading.local is gone): its
        # socket would otherwise stay open until the client closes.
        try:
            self.close()
        except Exception:  # interpreter shutdown: nothing left to clean
            pass


def _deadline_error(endpoint: str, timeout: float) -> Timeout:
    path = endpoint.partition("://")[2] if endpoint.startswith(("ipc://", "unix://")) else None
    if path is not None and not os.path.exists(path):
        return Timeout(f"no daemon at {endpoint}: the socket file does not exist "
                       "(is the daemon running? is this its runtime directory?)")
    if endpoint.startswith("tcp://"):
        # A CURVE server drops a handshake with a wrong or missing key without a word.
        return Timeout(f"no answer from the daemon at {endpoint} within {timeout:.1f}s: if this "
                       "is a CURVE endpoint, check server_key/client_key (is the daemon running? "
                       "is it overloaded?)")
    return Timeout(f"no reply from the daemon at {endpoint} within {timeout:.1f}s "
                   "(is it running? is it overloaded?)")


def _several_endpoints(endpoint: str | list[str] | None) -> list[str] | None:
    """The endpoints when there are several (a list, or commas); None for one: then nothing of
    the multi-endpoint client (client/multiclient.py) is imported."""
    endpoint = endpoint or default_endpoint()
    if isinstance(endpoint, str) and "," not in endpoint:
        return None
    from modelwarden.client.multiclient import split_endpoints

    endpoints = split_endpoints(endpoint)
    return endpoints if len(endpoints) > 1 else None


def _several_daemons(endpoint: str | list[str] | None, options: dict, asynchronous: bool):
    """Client or AsyncClient given several endpoints: the client of several daemons, with a
    DeprecationWarning naming the explicit way (client/connect.py); None for one endpoint."""
    endpoints = _several_endpoints(endpoint)
    if endpoints is None:
        return None
    from modelwarden.client import multiclient

    cls, factory = ((multiclient.AsyncMultiClient, "connect_async") if asynchronous
                    else (multiclient.MultiClient, "connect"))
    warnings.warn(f"{'AsyncClient' if asynchronous else 'Client'}(several endpoints) makes a client "
                  f"of several daemons: call modelwarden.{factory}(endpoints) for that",
                  DeprecationWarning, stacklevel=3)
    return cls(endpoints, **options)


def _one_endpoint(endpoint: str | list[str] | None) -> str:
    if endpoint is not None and not isinstance(endpoint, str):
        endpoint = endpoint[0]  # a list of one
    return (endpoint or default_endpoint()).strip(" ,")


# -- the synchronous client ---------------------------------------------------------------------


class Client:
    """One daemon. For several, ``modelwarden.connect(endpoints)`` makes a MultiClient
    (client/multiclient.py: least outstanding requests, heartbeats, once-only re-sends).
    ``Client`` given several endpoints still makes one, with a DeprecationWarning."""

    def __new__(cls, endpoint: str | list[str] | None = None, **options: Any):
        return _several_daemons(endpoint, options, asynchronous=False) or super().__new__(cls)

    def __init__(self, endpoint: str | list[str] | None = None, *, timeout: float = 30.0,
                 shm: bool | None = None, copy_outputs: bool = False,
                 server_key: str | os.PathLike | None = None,
                 client_key: str | os.PathLike | None = None,
                 heartbeat_interval: float = 1.0, heartbeat_timeout: float = 5.0) -> None:
        # heartbeat_*: used only with several endpoints (a MultiClient is made instead).
        self.endpoint = _one_endpoint(endpoint)
        self.timeout = timeout
        self._curve = client_keys(self.endpoint, server_key, client_key)
        self._session = Session(self.endpoint, shm, copy_outputs)
        self._context = zmq.Context()
        self._local = threading.local()
        # Weak: a connection dies with the thread that owned it (see _Connection.__del__).
        self._connections: weakref.WeakSet[_Connection] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._io: _IOThread | None = None
        self._closed = False

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _connection(self) -> _Connection | LocalConnection:
        connection = getattr(self._local, "connection", None)
        if connection is None:
            if self._closed:
                raise RuntimeError("the client is closed")
            if is_direct(self.endpoint):
                check_ipc_endpoint(self.endpoint)  # EACCES now, not at the first send
                connection = LocalConnection(self.endpoint)
            else:
                connection = _Connection(self._context, self.endpoint, self._curve)
            self._local.connection = connection
            with self._lock:
                self._connections.add(connection)
        return connection

    def hello(self) -> dict:
        """What the daemon offers: protocol version, models and their inputs, shared memory."""
        if self._session.offer is None:
            connection = self._connection()
            request_id, message = self._session.hello_message()
            timeout = min(self.timeout, HELLO_TIMEOUT_S)
            _send(connection, [message], timeout)
            header, _ = self._await(connection, request_id, timeout)
            self._session.take_offer(header)
        return self._session.offer

    def infer(self, model: str, inputs: Any, timeout: float | None = None,
              details: bool = False) -> Any:
        """Run ``model`` on ``inputs`` and return its outputs (a Reply if ``details``)."""
        timeout = self.timeout if timeout is None else timeout
        session: Session = self._session  # compiled: its steps are C calls (client.pxd)
        if session.offer is None:
            self.hello()
        connection = getattr(self._local, "connection", None)  # this thread's, once it has one
        if connection is None:
            connection = self._connection()
        for attempt in range(2):
            messages, pending = session.build(model, inputs, timeout, details)
            try:
                _send(connection, messages, timeout)
                header, frames = self._await(connection, pending.id, timeout + GRACE_S)
            except BaseException:
                session.discard(pending)
                raise
            reply = session.read(header, frames)
            if attempt == 0 and session.forgotten(reply, pending):
                continue
            return session.decode(pending, reply, frames)
        raise AssertionError("unreachable: the second attempt always returns")

    def _await(self, connection: _Connection, request_id: Any, timeout: float) -> tuple[Any, list]:
        """(what Session.read takes, the payload) of the reply to ``request_id``."""
        deadline = _now() + timeout
        session: Session = self._session
        while True:
            frames = connection.receive(deadline - _now())
            if frames is None:
                if type(connection) is LocalConnection and connection.closed_by_peer:
                    connection.drop()
                    raise _lost(self.endpoint)
                raise _deadline_error(self.endpoint, timeout)
            rid, header, payload = session.split(frames)
            if rid == request_id:
                return header, payload
            # Anything else is a stale reply to a request we stopped waiting for: dropped.

    def submit(self, model: str, inputs: Any, timeout: float | None = None,
               details: bool = False) -> concurrent.futures.Future:
        """Send without waiting; the future resolves to the outputs or a RemoteError."""
        timeout = self.timeout if timeout is None else timeout
        self.hello()
        with self._lock:
            if self._closed:
                raise RuntimeError("the client is closed")
            if self._io is None:
                thread = _LocalIOThread if is_direct(self.endpoint) else _IOThread
                self._io = thread(self._context, self.endpoint, self._session, self._curve)
                self._io.start()
            return self._io.submit(model, inputs, timeout, details)

    def empty(self, shape, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """An uninitialised tensor living in shared memory: fill it in place and send it with no
        copy. It stays valid while you hold it (an ordinary tensor when shared memory is off)."""
        self.hello()
        return self._session.empty(shape, dtype)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            io, self._io = self._io, None
            connections = list(self._connections)
        if io is not None:
            io.stop()
        for connection in connections:
            connection.close()
        self._session.close()
        self._context.term()


# The clock of every deadline here, called straight (compiled, a C call of the builtin; a
# function around it costs a Python call and a lookup of ``time.monotonic`` each time, three
# times a round trip).
_now = time.monotonic


def _send(connection: _Connection | LocalConnection, messages: list, timeout: float) -> None:
    """Queue ``messages``; a unix:// connection is made first (or again, after the daemon
    closed it), waiting up to ``timeout`` for a daemon that is starting."""
    if type(connection) is LocalConnection:
        connection.deliver(messages, _now() + timeout)
    else:
        connection.send(messages)


def _lost(endpoint: str) -> ConnectionLost:
    return ConnectionLost(f"the daemon at {endpoint} closed the connection before it answered "
                          "(it stopped or restarted); the request may or may not have run")


class _IOThread(threading.Thread):
    """Owns one connection for ``submit``: callers hand it requests through a deque and a pipe."""

    def __init__(self, context: zmq.Context, endpoint: str, session: Session,
                 curve: ClientKeys | None) -> None:
        super().__init__(name="modelwarden-client-io", daemon=True)
        self.context = context
        self.endpoint = endpoint
        self.curve = curve
        self.session = session
        self.inbox: collections.deque = collections.deque()
        # request id -> (pending, future, deadline, request to resend once or None, timeout)
        self.waiting: dict[int, tuple] = {}
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        self.connection: _Connection | None = None  # made by the thread itself, in run()
        self._stopping = False

    def submit(self, model: str, inputs: Any, timeout: float, details: bool) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.inbox.append((model, inputs, timeout, details, future))
        os.write(self._wake_write, b"x")
        if not self.is_alive():  # the thread ended (its finally ran): nobody will send it
            self._fail_unsent()
        return future

    def stop(self) -> None:
        self._stopping = True
        if self.is_alive():
            os.write(self._wake_write, b"x")
            self.join(5)
        if not self.is_alive():  # the wake pipe is closed here, once nothing can use it
            os.close(self._wake_read)
            os.close(self._wake_write)

    def run(self) -> None:
        self.connection = connection = _Connection(self.context, self.endpoint, self.curve)
        connection.poller.register(self._wake_read)
        try:
            while not self._stopping:
                timeout = self._next_deadline()
                ready = connection.poller.poll(timeout)
                if self._wake_read in ready:
                    self._take_inbox(connection)
                if connection.socket in ready:
                    self._take_reply(connection)
                self._expire()
        finally:
            self._finish(connection)

    def _finish(self, connection) -> None:
        """The thread is ending: what it holds fails, and its connection closes."""
        for pending, future, _, _, _ in self.waiting.values():
            self.session.discard(pending)
            future.set_exception(RuntimeError("the client was closed"))
        self._fail_unsent()
        connection.close()

    def _fail_unsent(self) -> None:
        """Submitted but never sent: they must not wait forever either."""
        while self.inbox:
            future = self.inbox.popleft()[-1]
            if future.set_running_or_notify_cancel():
                future.set_exception(RuntimeError("the client was closed"))

    def _next_deadline(self) -> int | None:
        if not self.waiting:
            return None
        soonest = min(entry[2] for entry in self.waiting.values())
        return max(0, int((soonest - _now()) * 1000) + 1)

    def _take_inbox(self, connection: _Connection) -> None:
        try:
            os.read(self._wake_read, 4096)
        except BlockingIOError:
            pass
        while self.inbox:
            model, inputs, timeout, details, future = self.inbox.popleft()
            if future.set_running_or_notify_cancel():
                self._send(connection, (model, inputs, timeout, details), future, first=True)

    def _send(self, connection: _Connection, request: tuple, future, first: bool) -> None:
        model, inputs, timeout, details = request
        try:
            messages, pending = self.session.build(model, inputs, timeout, details)
            self._deliver(connection, messages, timeout)
        except BaseException as exc:
            future.set_exception(exc)
            return
        self.waiting[pending.id] = (pending, future, _now() + timeout + GRACE_S,
                                    request if first else None, timeout + GRACE_S)

    def _deliver(self, connection: _Connection, messages: list, timeout: float) -> None:
        connection.send(messages)  # a replaced socket is in the poller already

    def _take_reply(self, connection: _Connection) -> None:
        # One message per readiness: the poll is level-triggered, the next pass takes the rest.
        self._on_reply(connection, recv_frames(connection.socket))

    def _on_reply(self, connection, frames: list) -> None:
        try:
            rid, header, payload = self.session.split(frames)
        except (RemoteError, protocol.ProtocolError):  # not our protocol: ignore it
            return
        entry = self.waiting.pop(rid, None)
        if entry is None:
            return  # a reply we stopped waiting for
        pending, future, _, request, _ = entry
        reply = self.session.read(header, payload)
        if request is not None and self.session.forgotten(reply, pending):
            self._send(connection, request, future, first=False)
            return
        try:
            future.set_result(self.session.decode(pending, reply, payload))
        except BaseException as exc:
            future.set_exception(exc)

    def _expire(self) -> None:
        now = _now()
        for request_id, (pending, future, deadline, _, waited) in list(self.waiting.items()):
            if now >= deadline:
                del self.waiting[request_id]
                self.session.discard(pending)
                future.set_exception(_deadline_error(self.endpoint, waited))


class _LocalIOThread(_IOThread):
    """``submit``'s thread on a ``unix://`` endpoint (client/local.py): the same requests and
    replies, over the loop's own connection; a connection the daemon closed fails what it
    carried at once (ConnectionLost), and the next request connects again."""

    def run(self) -> None:
        self.connection = connection = LocalConnection(self.endpoint)
        connection.watch_also(self._wake_read)
        try:
            while not self._stopping:
                ready = connection.pump(self._next_deadline())
                self._take_replies(connection)
                if self._wake_read in ready:
                    self._take_inbox(connection)
                    self._take_replies(connection)  # read while its requests were written
                self._expire()
        finally:
            self._finish(connection)

    def _deliver(self, connection: LocalConnection, messages: list, timeout: float) -> None:
        if connection.closed_by_peer:  # what it carried fails before another one is made
            self._take_replies(connection)
        lost = connection.lost
        connection.deliver(messages, _now() + timeout)
        if connection.lost != lost:  # it was closed after all: what waited on it fails
            self._lose_waiting()

    def _take_replies(self, connection: LocalConnection) -> None:
        for frames in connection.take():
            self._on_reply(connection, frames)
        if connection.closed_by_peer:
            connection.drop()
            self._lose_waiting()

    def _lose_waiting(self) -> None:
        waiting, self.waiting = self.waiting, {}
        for pending, future, _, _, _ in waiting.values():
            self.session.discard(pending)  # it may still run: its buffers stay untouched
            future.set_exception(_lost(self.endpoint))


# -- asyncio ------------------------------------------------------------------------------------


class AsyncClient:
    """``await client.infer(model, inputs)`` from one event loop; many requests in flight.
    For several daemons, ``modelwarden.connect_async(endpoints)`` makes an AsyncMultiClient
    (client/multiclient.py); ``AsyncClient`` given several still does, with a DeprecationWarning.

    Its socket is a plain ZeroMQ socket whose file descriptor the loop watches (``add_reader``):
    a reply resolves its request's future straight from the loop's callback, and a request is
    sent without a wait (the socket has no high-water mark). zmq.asyncio's reader task and
    per-call futures cost about 0.1 ms of a 1.2 ms round trip on a 2-core machine."""

    def __new__(cls, endpoint: str | list[str] | None = None, **options: Any):
        return _several_daemons(endpoint, options, asynchronous=True) or super().__new__(cls)

    def __init__(self, endpoint: str | list[str] | None = None, *, timeout: float = 30.0,
                 shm: bool | None = None, copy_outputs: bool = False,
                 server_key: str | os.PathLike | None = None,
                 client_key: str | os.PathLike | None = None,
                 heartbeat_interval: float = 1.0, heartbeat_timeout: float = 5.0) -> None:
        self.endpoint = _one_endpoint(endpoint)
        check_ipc_endpoint(self.endpoint)  # EACCES now, not a timeout later
        self.timeout = timeout
        curve = client_keys(self.endpoint, server_key, client_key)
        self._session = Session(self.endpoint, shm, copy_outputs)
        # unix:// and ipc://PATH: its own connection (client/local.py), made at the first request.
        self._local = LocalConnection(self.endpoint) if is_direct(self.endpoint) else None
        if self._local is None:
            # The process's one context, never terminated here: a client of its own context
            # that is garbage-collected unclosed inside a reference cycle (asyncio makes them)
            # could have the context's finalizer wait for ever on the socket the cycle holds.
            self._connection = Connection(zmq.Context.instance(), self.endpoint, curve)
            self._socket = self._connection.socket
            self._fd = self._socket.getsockopt(zmq.FD)
        else:
            self._fd = None  # the connection's, once connected
            self._writing = False  # the loop watches it for writing
        self._waiting: dict[Any, asyncio.Future] = {}
        self._deadlines = _Deadlines()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def hello(self) -> dict:
        if self._session.offer is None:
            request_id, message = self._session.hello_message()
            header, _ = await self._roundtrip(request_id, [message],
                                              min(self.timeout, HELLO_TIMEOUT_S))
            self._session.take_offer(header)
        return self._session.offer

    async def infer(self, model: str, inputs: Any, timeout: float | None = None,
                    details: bool = False) -> Any:
        timeout = self.timeout if timeout is None else timeout
        await self.hello()
        for attempt in range(2):
            messages, pending = self._session.build(model, inputs, timeout, details)
            try:
                header, frames = await self._roundtrip(pending.id, messages, timeout + GRACE_S)
            except BaseException:
                self._session.discard(pending)
                raise
            reply = self._session.read(header, frames)
            if attempt == 0 and self._session.forgotten(reply, pending):
                continue
            return self._session.decode(pending, reply, frames)
        raise AssertionError("unreachable: the second attempt always returns")

    def empty(self, shape, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self._session.offer is None:
            raise RuntimeError("await client.hello() before empty()")
        return self._session.empty(shape, dtype)

    def trim_buffers(self, keep_bytes: int = 0) -> int:
        """Give back the shared-memory buffers not used since the previous call, beyond
        ``keep_bytes`` of free ones (``ShmArena.trim``); the bytes given back. A long-lived
        client (the gateway) calls it now and then, so a burst's buffers do not stay for ever."""
        arena = self._session.arena
        return arena.trim(keep_bytes) if arena is not None else 0

    async def _roundtrip(self, request_id: Any, messages: list, timeout: float) -> tuple[dict, list]:
        if self._closed:
            raise RuntimeError("the client is closed")
        loop = self._watch_from(asyncio.get_running_loop())
        if self._local is not None and (self._fd is None or self._local.closed_by_peer):
            await self._connect_local(loop, loop.time() + timeout)
        future = loop.create_future()
        self._waiting[request_id] = future
        self._deadlines.add(loop, future, timeout, len(self._waiting))
        try:
            for parts in messages:
                self._send(parts)
            return await future
        except asyncio.TimeoutError:
            raise _deadline_error(self.endpoint, timeout) from None
        finally:
            self._waiting.pop(request_id, None)

    def _watch_from(self, loop: asyncio.AbstractEventLoop) -> asyncio.AbstractEventLoop:
        """Have ``loop`` call us when the socket has something; once per loop."""
        if self._loop is not loop:
            if self._fd is not None:
                self._unwatch()
                self._loop = loop
                self._watch()
            self._loop = loop
        return loop

    def _watch(self) -> None:
        if self._local is None:
            self._loop.add_reader(self._fd, self._on_events)
            return
        self._loop.add_reader(self._fd, self._on_local_events)
        if self._local.link.out:
            self._loop.add_writer(self._fd, self._on_local_writable)
            self._writing = True

    def _unwatch(self) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        loop.remove_reader(self._fd)
        if self._local is not None and self._writing:
            loop.remove_writer(self._fd)
            self._writing = False

    # -- unix:// (client/local.py) -------------------------------------------------------------

    async def _connect_local(self, loop: asyncio.AbstractEventLoop, deadline: float) -> None:
        """Connected (again, after the daemon closed it), waiting up to ``deadline`` (the
        loop's time) for a daemon that is starting; NoDaemon then."""
        local = self._local
        if local.closed_by_peer:
            self._local_lost()
        delay = 0.005
        while not local.try_connect():
            left = deadline - loop.time()
            if left <= 0:
                raise NoDaemon(f"no daemon listening at {local.path} (is it running? is this "
                               "its frontend?)")
            await asyncio.sleep(min(delay, left))
            delay = min(delay * 2, 0.1)
        if self._fd is None:
            self._fd = local.link.fd
            self._watch()

    def _on_local_events(self) -> None:
        local = self._local
        local.read()
        self._follow_local_queue()  # what waited for an ipc:// daemon's READY may wait to go
        waiting = self._waiting
        for frames in local.take():
            try:
                rid, header, payload = self._session.split(frames)
            except (RemoteError, protocol.ProtocolError):  # not our protocol: ignore it
                continue
            future = waiting.get(rid)
            if future is not None and not future.done():
                future.set_result((header, payload))
        if local.closed_by_peer:
            self._local_lost()

    def _follow_local_queue(self) -> None:
        """Watch for writing while the connection's queue holds bytes."""
        link = self._local.link
        if link is not None and link.out and not self._writing:
            self._loop.add_writer(self._fd, self._on_local_writable)
            self._writing = True

    def _on_local_writable(self) -> None:
        local = self._local
        local.flush()
        if local.link is not None and not local.link.out and self._writing:
            self._loop.remove_writer(self._fd)
            self._writing = False

    def _local_lost(self) -> None:
        """The daemon closed the connection: what waited on it will not be answered."""
        self._unwatch()
        self._fd = None
        self._local.drop()
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(_lost(self.endpoint))

    def _send(self, parts: list) -> None:
        if self._local is not None:
            self._local.link.send(parts)
            self._follow_local_queue()
            return
        # Never waits (client/connection.py); a socket libzmq gave up is replaced by a new one.
        if self._connection.send([parts]):
            self._watch_new_socket()
        # ZeroMQ's descriptor is edge-triggered, and any operation on the socket may consume
        # the edge of a reply that has already arrived: look now, or it could wait for ever.
        self._on_events()

    def _watch_new_socket(self) -> None:
        # The old descriptor is closed already, and the new one may have its number.
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._fd)
        self._socket = self._connection.socket
        self._fd = self._socket.getsockopt(zmq.FD)
        if self._loop is not None and not self._loop.is_closed():
            self._loop.add_reader(self._fd, self._on_events)

    def _on_events(self) -> None:
        """Resolve every request whose reply has arrived."""
        socket = self._socket
        if socket.closed:
            return
        # Read until EAGAIN, which also has libzmq process the commands its descriptor signalled
        # (re-arming the edge) as ZMQ_EVENTS would, without pyzmq making an enum of the answer
        # and of each test of it (four per request).
        while True:
            frames = recv_frames(socket, _DONTWAIT)
            if frames is None:
                break
            try:
                rid, header, payload = self._session.split(frames)
            except (RemoteError, protocol.ProtocolError):  # not our protocol: ignore it
                continue
            future = self._waiting.get(rid)
            if future is not None and not future.done():
                future.set_result((header, payload))

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._deadlines.close()
        if self._fd is not None:
            self._unwatch()
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(RuntimeError("the client is closed"))
        if self._local is not None:
            self._local.close()
        else:
            self._connection.close()
        self._session.close()


_DONTWAIT = int(zmq.DONTWAIT)


class _Deadlines:
    """The deadlines of an AsyncClient's requests under one timer of the loop, armed for the
    earliest: a ``call_later`` per request (a handle made, pushed on the loop's heap, then
    cancelled and swept) cost more of the client's CPU than the rest of asyncio's share of a
    request. A heap of (when, sequence, weak reference to the request's future): a request
    answered before its deadline leaves its entry behind, holding nothing of its reply, and the
    entries are compacted when they outnumber twice the pending requests by ``SLACK``. A timer
    that fires fails each pending future whose deadline has come with ``asyncio.TimeoutError``,
    as ``call_later`` did, and is armed again for what is left."""

    SLACK = 1024

    def __init__(self) -> None:
        self.heap: list = []
        self.sequence = 0
        self.loop: asyncio.AbstractEventLoop | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.armed_for = 0.0

    def add(self, loop: asyncio.AbstractEventLoop, future: asyncio.Future, timeout: float,
            pending: int) -> None:
        when = loop.time() + timeout
        self.sequence += 1
        heapq.heappush(self.heap, (when, self.sequence, weakref.ref(future)))
        if len(self.heap) > 2 * pending + self.SLACK:
            self._compact()
        if self.timer is None or loop is not self.loop or when < self.armed_for:
            self._arm(loop, when)

    def _arm(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.loop = loop
        self.timer = loop.call_at(when, self._fire)
        self.armed_for = when

    def _fire(self) -> None:
        self.timer = None
        loop = self.loop
        now = loop.time()
        heap = self.heap
        while heap:
            when, _, reference = heap[0]
            future = reference()
            if future is None or future.done() or future.get_loop() is not loop:
                heapq.heappop(heap)  # answered, or left behind by an earlier loop
                continue
            if when > now:
                break
            heapq.heappop(heap)
            future.set_exception(asyncio.TimeoutError())
        if heap:
            self._arm(loop, heap[0][0])

    def _compact(self) -> None:
        kept = []
        for entry in self.heap:
            future = entry[2]()
            if future is not None and not future.done():
                kept.append(entry)
        heapq.heapify(kept)
        self.heap = kept

    def close(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.heap = []


# -- control requests (the CLI) ------------------------------------------------------------------


__all__ = ["Client", "AsyncClient", "Reply", "control_request", "default_endpoint", "RemoteError",
           "BadRequest", "BadInput", "UnknownModel", "NoWorker", "ModelError", "OutOfMemory",
           "WorkerDied", "Poison", "Timeout", "Overloaded", "ShuttingDown", "InternalError"]
