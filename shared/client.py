"""The modelwarden client.

    from shared.client import Client
    with Client() as client:                     # MODELWARDEN_ENDPOINT, or the local daemon
        y = client.infer("mlp", torch.randn(8, 64))
        futures = [client.submit("mlp", x) for x in batch]   # many in flight

Inputs are a tensor, a list/tuple of tensors, or a dict of named tensors (numpy arrays work too);
outputs come back in the model's own structure. If every input is a numpy array, outputs are
numpy arrays too (bfloat16 outputs stay torch tensors: numpy has no bfloat16).

Shared memory. On an ``ipc://`` endpoint, tensors of ``shm_threshold`` bytes or more (the
daemon's setting, 64 KiB by default) travel in shared memory: the client copies an ordinary
tensor once into a reused buffer, and a tensor made by ``client.empty()`` is sent with no copy
at all. Outputs of that size come back as tensors *over shared memory* (no copy): they stay
valid for as long as you hold them, and their buffer is reused only after they are freed. Pass
``copy_outputs=True`` for ordinary tensors instead. Over ``tcp://`` everything travels inline:
same API, same results.

Do not modify an input tensor while its request is in flight (after ``submit`` returns and
before its future is done): the worker may be reading it in place.

Threads. A Client may be shared by any number of threads: ``infer`` talks over a socket owned by
the calling thread, and ``submit`` hands requests to one background I/O thread. An AsyncClient
belongs to the event loop it is used from.

Errors. A failed request raises a subclass of RemoteError whose ``code`` is the protocol's error
code (``BadInput``, ``ModelError``, ``Timeout``...). A daemon that does not answer within the
timeout (plus a grace second) raises Timeout too, saying so.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import math
import os
import secrets
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import zmq
import zmq.asyncio

from shared import protocol
from shared.codec import (TORCH_DTYPES, as_tensor, dtype_name, flatten, from_bytes, raw_bytes,
                          to_numpy, unflatten)
from shared.config import ENV_ENDPOINT, ConfigError, default_runtime_dir, load_settings
from shared.protocol import SIGNATURE
from shared.shm import ALIGN, Region, ShmArena
from shared.sockets import recv_parts, send_parts

GRACE_S = 1.0  # how much longer than the request timeout the client waits for the daemon


# -- errors -------------------------------------------------------------------------------------


class RemoteError(Exception):
    """A request failed; ``code`` is one of shared.protocol.ERROR_CODES."""

    code = "REMOTE_ERROR"

    def __init__(self, message: str, request_id: Any = None, worker: str | None = None) -> None:
        super().__init__(f"{self.code}: {message}")
        self.message = message
        self.request_id = request_id
        self.worker = worker


def _error_class(code: str) -> type[RemoteError]:
    name = "".join(part.title() for part in code.split("_"))
    return type(name, (RemoteError,), {"code": code, "__doc__": protocol.ERROR_CODES[code]})


BadRequest = _error_class(protocol.BAD_REQUEST)
BadInput = _error_class(protocol.BAD_INPUT)
UnknownModel = _error_class(protocol.UNKNOWN_MODEL)
NoWorker = _error_class(protocol.NO_WORKER)
ModelError = _error_class(protocol.MODEL_ERROR)
OutOfMemory = _error_class(protocol.OUT_OF_MEMORY)
WorkerDied = _error_class(protocol.WORKER_DIED)
Poison = _error_class(protocol.POISON)
Timeout = _error_class(protocol.TIMEOUT)
Overloaded = _error_class(protocol.OVERLOADED)
ShuttingDown = _error_class(protocol.SHUTTING_DOWN)
InternalError = _error_class(protocol.INTERNAL)

ERRORS: dict[str, type[RemoteError]] = {
    cls.code: cls for cls in (BadRequest, BadInput, UnknownModel, NoWorker, ModelError, OutOfMemory,
                              WorkerDied, Poison, Timeout, Overloaded, ShuttingDown, InternalError)}


def error_from_reply(header: dict) -> RemoteError:
    error = header.get("error") or {}
    cls = ERRORS.get(error.get("code"), RemoteError)
    return cls(str(error.get("message", "")), header.get("id"), header.get("worker"))


# -- finding the daemon -------------------------------------------------------------------------


def default_endpoint() -> str:
    """MODELWARDEN_ENDPOINT; else the first frontend of MODELWARDEN_CONFIG; else the local
    daemon's default socket."""
    if os.environ.get(ENV_ENDPOINT):
        return os.environ[ENV_ENDPOINT]
    if os.environ.get("MODELWARDEN_CONFIG"):
        try:
            frontends = load_settings().frontends
        except ConfigError:
            frontends = []
        ipc = [endpoint for endpoint in frontends if endpoint.startswith("ipc://")]
        if ipc or frontends:
            return (ipc or frontends)[0]
    return f"ipc://{default_runtime_dir()}/frontend.sock"


@dataclass
class Reply:
    """What ``infer(..., details=True)`` returns: outputs plus where and how long."""

    outputs: Any
    worker: str | None
    timing: dict


# -- what a request needs while it is in flight --------------------------------------------------


@dataclass(eq=False)
class _Pending:
    id: int
    model: str
    numpy_out: bool
    details: bool
    keep: list  # input tensors: their memory may be read in place until the reply
    regions: list[Region] = field(default_factory=list)  # leases this request holds
    segments: list = field(default_factory=list)  # every segment it references
    deadline: float = 0.0


class _Session:
    """State shared by every connection of one client: endpoint, what the daemon offers, the
    shared-memory arena, request ids, and output-size guesses."""

    def __init__(self, endpoint: str, shm: bool | None, copy_outputs: bool) -> None:
        self.endpoint = endpoint
        self.want_shm = shm is not False and endpoint.startswith("ipc://")
        self.copy_outputs = copy_outputs
        self.offer: dict | None = None
        self.arena: ShmArena | None = None
        self.threshold = 1 << 62
        self.ids = itertools.count(1)
        self.session_key = secrets.token_hex(16)  # proves to the daemon that our threads are us
        self.out_guess: dict[str, int] = {}
        self._lock = threading.Lock()

    def accept_offer(self, offer: dict) -> None:
        with self._lock:
            if self.offer is not None:
                return
            self.offer = offer
            shm = offer.get("shm") or {}
            if self.want_shm and shm.get("enabled"):
                self.threshold = int(shm.get("threshold", 64 * 1024))
                self.arena = ShmArena(group=shm.get("group"))

    def hello_message(self) -> tuple[int, list]:
        request_id = next(self.ids)
        return request_id, [SIGNATURE, protocol.pack({"type": "hello", "id": request_id})]

    # -- requests ---------------------------------------------------------------------------

    def build(self, model: str, inputs: Any, timeout: float, registered: set[str],
              details: bool = False) -> tuple[list[list], _Pending]:
        """The messages to send (registrations first, then the request) and its pending record."""
        leaves: list = []
        tree = flatten(inputs, leaves)
        numpy_out = bool(leaves) and all(isinstance(leaf, np.ndarray) for leaf in leaves)
        tensors = [as_tensor(leaf) for leaf in leaves]
        pending = _Pending(next(self.ids), model, numpy_out, details, keep=list(tensors))
        descs, frames = [], []
        try:
            for tensor in tensors:
                descs.append(self._describe(tensor, frames, pending))
            out = self._out_region(model, tensors, pending)
        except BaseException:
            self.release(pending)
            raise
        header = {"type": "infer", "id": pending.id, "model": model, "inputs": tree,
                  "tensors": descs, "timeout_ms": int(timeout * 1000)}
        if out is not None:
            header["out"] = out
        messages = self._registrations(pending, registered)
        messages.append([SIGNATURE, protocol.pack(header), *frames])
        return messages, pending

    def _describe(self, tensor: torch.Tensor, frames: list, pending: _Pending) -> dict:
        dtype = dtype_name(tensor.dtype)
        desc = {"dtype": dtype, "shape": list(tensor.shape)}
        nbytes = tensor.numel() * tensor.element_size()
        arena = self.arena
        if arena is not None and nbytes >= self.threshold and nbytes:
            where = tensor.is_contiguous() and tensor.device.type == "cpu" and arena.locate(
                tensor.data_ptr(), nbytes)
            if where:  # made by empty(): zero copies
                desc["shm"] = [where[0].name, where[1], nbytes]
                pending.segments.append(where[0])
                return desc
            region = arena.alloc(nbytes)
            pending.regions.append(region)
            pending.segments.append(region.segment)
            staging = from_bytes(region.bytes_view(0, nbytes), dtype, tuple(tensor.shape))
            staging.copy_(tensor)
            desc["shm"] = [region.segment.name, region.offset, nbytes]
            return desc
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            tensor = tensor.detach().to("cpu").contiguous()
            pending.keep.append(tensor)
        desc["frame"] = len(frames)
        frames.append(raw_bytes(tensor))
        return desc

    def _out_region(self, model: str, tensors: list, pending: _Pending) -> list | None:
        if self.arena is None:
            return None
        guess = self.out_guess.get(model)
        if guess is None:
            guess = sum(_aligned(t.numel() * t.element_size()) for t in tensors
                        if t.numel() * t.element_size() >= self.threshold)
        if guess < self.threshold:
            return None
        region = self.arena.alloc(guess)
        pending.regions.append(region)
        pending.segments.append(region.segment)
        return [region.segment.name, region.offset, region.capacity]

    def _registrations(self, pending: _Pending, registered: set[str]) -> list[list]:
        """A register message for the segments this connection has not declared yet; sent just
        before the request on the same socket, so the daemon sees it first (no round trip)."""
        new = {segment.name: segment.size for segment in pending.segments
               if segment.name not in registered}
        if not new:
            return []
        registered.update(new)
        header = {"type": "register", "id": f"register-{next(self.ids)}", "session": self.session_key,
                  "segments": [[name, size] for name, size in new.items()]}
        return [[SIGNATURE, protocol.pack(header)]]

    # -- replies ----------------------------------------------------------------------------

    def forgotten(self, header: dict, pending: _Pending, registered: set[str]) -> bool:
        """True if the daemon no longer knows this connection's segments (it restarted, or the
        socket reconnected): the caller registers them again and resends, once."""
        error = header.get("error") or {}
        if header.get("ok") or error.get("detail") != protocol.SEGMENT_NOT_REGISTERED:
            return False
        self.release(pending)
        registered.clear()
        return True

    def decode(self, pending: _Pending, header: dict, frames: list) -> Any:
        try:
            if not header.get("ok"):
                error = error_from_reply(header)
                if isinstance(error, Timeout):
                    self.discard(pending)  # the worker may still touch its buffers
                raise error
            tensors = [self._tensor(desc, frames) for desc in header.get("tensors") or []]
            self._learn_out_size(pending.model, header.get("tensors") or [])
        finally:
            self.release(pending)
        if pending.numpy_out:
            tensors = [to_numpy(tensor) for tensor in tensors]
        outputs = unflatten(header.get("outputs"), tensors)
        if pending.details:
            return Reply(outputs, header.get("worker"), header.get("timing") or {})
        return outputs

    def _tensor(self, desc: dict, frames: list) -> torch.Tensor:
        dtype, shape = desc["dtype"], tuple(desc["shape"])
        if "frame" in desc:
            tensor = from_bytes(frames[desc["frame"]].buffer, dtype, shape)
            return tensor.clone() if self.copy_outputs else tensor
        name, offset, nbytes = desc["shm"]
        segment = self.arena.segment(name) if self.arena else None
        if segment is None:
            raise InternalError("the daemon returned a segment this client does not own")
        view = segment.array[offset:offset + nbytes]
        tensor = from_bytes(view, dtype, shape)
        if self.copy_outputs:
            return tensor.clone()
        region = self.arena.region_of(name)
        region.retain()
        weakref.finalize(view, region.release)  # the region is reused once the tensor is freed
        return tensor

    def _learn_out_size(self, model: str, descs: list) -> None:
        total = 0
        for desc in descs:
            nbytes = protocol.DTYPES[desc["dtype"]] * math.prod(desc["shape"])
            if nbytes >= self.threshold:
                total += _aligned(nbytes)
        self.out_guess[model] = total

    def release(self, pending: _Pending) -> None:
        regions, pending.regions = pending.regions, []
        for region in regions:
            region.release()

    def discard(self, pending: _Pending) -> None:
        """Never reuse this request's buffers: a worker may still write into them."""
        regions, pending.regions = pending.regions, []
        if self.arena is not None:
            for region in regions:
                self.arena.discard(region)

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        if self.arena is None:
            return torch.empty(shape, dtype=dtype)
        name = dtype_name(dtype)
        shape = tuple(shape)
        nbytes = protocol.tensor_nbytes(name, shape)
        if nbytes < self.threshold:
            return torch.empty(shape, dtype=dtype)
        region = self.arena.alloc(nbytes)  # the tensor holds the one reference
        view = region.bytes_view(0, nbytes)
        weakref.finalize(view, region.release)
        return from_bytes(view, name, shape)

    def close(self) -> None:
        if self.arena is not None:
            self.arena.close()


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


# -- one socket ---------------------------------------------------------------------------------


class _Connection:
    """One DEALER socket: one connection as the daemon sees it (segments register per connection)."""

    def __init__(self, context: zmq.Context, endpoint: str) -> None:
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDHWM, 0)
        self.socket.setsockopt(zmq.RCVHWM, 0)
        self.socket.connect(endpoint)
        self.registered: set[str] = set()
        self.poller = zmq.Poller()
        self.poller.register(self.socket, zmq.POLLIN)

    def send(self, messages: list[list]) -> None:
        for parts in messages:
            send_parts(self.socket, parts)

    def receive(self, timeout_s: float) -> tuple[dict, list] | None:
        """One reply, or None when nothing came within the timeout."""
        if not self.poller.poll(max(0, int(timeout_s * 1000))):
            return None
        return _parse_reply(recv_parts(self.socket))

    def close(self) -> None:
        self.socket.close(0)


def _parse_reply(frames: list) -> tuple[dict, list]:
    start = 1 if frames and len(frames[0]) == 0 else 0
    if len(frames) < start + 2 or frames[start].bytes != SIGNATURE:
        raise InternalError("malformed reply from the daemon")
    return protocol.unpack_header(frames[start + 1].buffer), frames[start + 2:]


def _deadline_error(endpoint: str, timeout: float) -> Timeout:
    return Timeout(f"no reply from the daemon at {endpoint} within {timeout:.1f}s "
                   "(is it running? is it overloaded?)")


# -- the synchronous client ---------------------------------------------------------------------


class Client:
    def __init__(self, endpoint: str | None = None, *, timeout: float = 30.0,
                 shm: bool | None = None, copy_outputs: bool = False) -> None:
        self.endpoint = endpoint or default_endpoint()
        self.timeout = timeout
        self._session = _Session(self.endpoint, shm, copy_outputs)
        self._context = zmq.Context()
        self._local = threading.local()
        self._connections: list[_Connection] = []
        self._lock = threading.Lock()
        self._io: _IOThread | None = None
        self._closed = False

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _connection(self) -> _Connection:
        connection = getattr(self._local, "connection", None)
        if connection is None:
            if self._closed:
                raise RuntimeError("the client is closed")
            connection = _Connection(self._context, self.endpoint)
            self._local.connection = connection
            with self._lock:
                self._connections.append(connection)
        return connection

    def hello(self) -> dict:
        """What the daemon offers: protocol version, models and their inputs, shared memory."""
        if self._session.offer is None:
            connection = self._connection()
            request_id, message = self._session.hello_message()
            connection.send([message])
            header, _ = self._await(connection, request_id, self.timeout)
            if not header.get("ok"):
                raise error_from_reply(header)
            self._session.accept_offer(header)
        return self._session.offer

    def infer(self, model: str, inputs: Any, timeout: float | None = None,
              details: bool = False) -> Any:
        """Run ``model`` on ``inputs`` and return its outputs (a Reply if ``details``)."""
        timeout = self.timeout if timeout is None else timeout
        self.hello()
        connection = self._connection()
        for attempt in range(2):
            messages, pending = self._session.build(model, inputs, timeout, connection.registered,
                                                    details)
            try:
                connection.send(messages)
                header, frames = self._await(connection, pending.id, timeout + GRACE_S)
            except BaseException:
                self._session.discard(pending)
                raise
            if attempt == 0 and self._session.forgotten(header, pending, connection.registered):
                continue
            return self._session.decode(pending, header, frames)
        raise AssertionError("unreachable: the second attempt always returns")

    def _await(self, connection: _Connection, request_id: Any, timeout: float) -> tuple[dict, list]:
        deadline = _now() + timeout
        while True:
            reply = connection.receive(deadline - _now())
            if reply is None:
                raise _deadline_error(self.endpoint, timeout)
            header, frames = reply
            if header.get("id") == request_id:
                return header, frames
            # Anything else is a registration's answer (a failed one makes the request itself
            # fail and say why) or a stale reply to a request we stopped waiting for: dropped.

    def submit(self, model: str, inputs: Any, timeout: float | None = None,
               details: bool = False) -> concurrent.futures.Future:
        """Send without waiting; the future resolves to the outputs or a RemoteError."""
        timeout = self.timeout if timeout is None else timeout
        self.hello()
        with self._lock:
            if self._closed:
                raise RuntimeError("the client is closed")
            if self._io is None:
                self._io = _IOThread(self._context, self.endpoint, self._session)
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
            connections, self._connections = self._connections, []
        if io is not None:
            io.stop()
        for connection in connections:
            connection.close()
        self._session.close()
        self._context.term()


def _now() -> float:
    return time.monotonic()


class _IOThread(threading.Thread):
    """Owns one connection for ``submit``: callers hand it requests through a deque and a pipe."""

    def __init__(self, context: zmq.Context, endpoint: str, session: _Session) -> None:
        super().__init__(name="modelwarden-client-io", daemon=True)
        self.context = context
        self.endpoint = endpoint
        self.session = session
        self.inbox: collections.deque = collections.deque()
        self.waiting: dict[int, tuple[_Pending, concurrent.futures.Future, float, tuple]] = {}
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        self._stopping = False

    def submit(self, model: str, inputs: Any, timeout: float, details: bool) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.inbox.append((model, inputs, timeout, details, future))
        os.write(self._wake_write, b"x")
        return future

    def stop(self) -> None:
        self._stopping = True
        os.write(self._wake_write, b"x")
        self.join(5)

    def run(self) -> None:
        connection = _Connection(self.context, self.endpoint)
        poller = zmq.Poller()
        poller.register(connection.socket, zmq.POLLIN)
        poller.register(self._wake_read, zmq.POLLIN)
        try:
            while not self._stopping:
                timeout = self._next_deadline()
                events = dict(poller.poll(timeout))
                if self._wake_read in events:
                    self._take_inbox(connection)
                if connection.socket in events:
                    self._take_reply(connection)
                self._expire()
        finally:
            for pending, future, _, _ in self.waiting.values():
                self.session.discard(pending)
                future.set_exception(RuntimeError("the client was closed"))
            connection.close()
            os.close(self._wake_read)
            os.close(self._wake_write)

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
            messages, pending = self.session.build(model, inputs, timeout, connection.registered,
                                                   details)
            connection.send(messages)
        except BaseException as exc:
            future.set_exception(exc)
            return
        self.waiting[pending.id] = (pending, future, _now() + timeout + GRACE_S,
                                    request if first else None)

    def _take_reply(self, connection: _Connection) -> None:
        # One message per readiness: the poll is level-triggered, the next pass takes the rest.
        header, payload = _parse_reply(recv_parts(connection.socket))
        entry = self.waiting.pop(header.get("id"), None)
        if entry is None:
            return  # a registration's answer, or a reply we stopped waiting for
        pending, future, _, request = entry
        if request is not None and self.session.forgotten(header, pending, connection.registered):
            self._send(connection, request, future, first=False)
            return
        try:
            future.set_result(self.session.decode(pending, header, payload))
        except BaseException as exc:
            future.set_exception(exc)

    def _expire(self) -> None:
        now = _now()
        for request_id, (pending, future, deadline, _) in list(self.waiting.items()):
            if now >= deadline:
                del self.waiting[request_id]
                self.session.discard(pending)
                future.set_exception(_deadline_error(self.endpoint, deadline - now))


# -- asyncio ------------------------------------------------------------------------------------


class AsyncClient:
    """``await client.infer(model, inputs)`` from one event loop; many requests in flight."""

    def __init__(self, endpoint: str | None = None, *, timeout: float = 30.0,
                 shm: bool | None = None, copy_outputs: bool = False) -> None:
        self.endpoint = endpoint or default_endpoint()
        self.timeout = timeout
        self._session = _Session(self.endpoint, shm, copy_outputs)
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDHWM, 0)
        self._socket.setsockopt(zmq.RCVHWM, 0)
        self._socket.connect(self.endpoint)
        self._registered: set[str] = set()
        self._waiting: dict[Any, asyncio.Future] = {}
        self._reader: asyncio.Task | None = None

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def hello(self) -> dict:
        if self._session.offer is None:
            request_id, message = self._session.hello_message()
            header, _ = await self._roundtrip(request_id, [message], self.timeout)
            if not header.get("ok"):
                raise error_from_reply(header)
            self._session.accept_offer(header)
        return self._session.offer

    async def infer(self, model: str, inputs: Any, timeout: float | None = None,
                    details: bool = False) -> Any:
        timeout = self.timeout if timeout is None else timeout
        await self.hello()
        for attempt in range(2):
            messages, pending = self._session.build(model, inputs, timeout, self._registered, details)
            try:
                header, frames = await self._roundtrip(pending.id, messages, timeout + GRACE_S)
            except BaseException:
                self._session.discard(pending)
                raise
            if attempt == 0 and self._session.forgotten(header, pending, self._registered):
                continue
            return self._session.decode(pending, header, frames)
        raise AssertionError("unreachable: the second attempt always returns")

    def empty(self, shape, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self._session.offer is None:
            raise RuntimeError("await client.hello() before empty()")
        return self._session.empty(shape, dtype)

    async def _roundtrip(self, request_id: Any, messages: list, timeout: float) -> tuple[dict, list]:
        if self._reader is None:
            self._reader = asyncio.ensure_future(self._read_replies())
        future = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = future
        try:
            for parts in messages:
                await self._socket.send_multipart(parts, copy=False)
            return await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            raise _deadline_error(self.endpoint, timeout) from None
        finally:
            self._waiting.pop(request_id, None)

    async def _read_replies(self) -> None:
        while True:
            frames = await self._socket.recv_multipart(copy=False)
            try:
                header, payload = _parse_reply(frames)
            except RemoteError:
                continue
            future = self._waiting.get(header.get("id"))
            if future is not None and not future.done():
                future.set_result((header, payload))

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except (asyncio.CancelledError, Exception):
                pass
        self._socket.close(0)
        self._session.close()
        self._context.term()


# -- control requests (the CLI) ------------------------------------------------------------------


def control_request(endpoint: str, header: dict, timeout: float = 5.0) -> dict:
    """One request on the control socket; raises Timeout if the daemon does not answer."""
    context = zmq.Context()
    connection = _Connection(context, endpoint)
    try:
        header = {**header, "id": 1}
        connection.send([[SIGNATURE, protocol.pack(header)]])
        reply = connection.receive(timeout)
        if reply is None:
            raise _deadline_error(endpoint, timeout)
        answer, _ = reply
        if not answer.get("ok"):
            raise error_from_reply(answer)
        return answer
    finally:
        connection.close()
        context.term()


__all__ = ["Client", "AsyncClient", "Reply", "RemoteError", "control_request", "default_endpoint",
           *[cls.__name__ for cls in ERRORS.values()], "TORCH_DTYPES"]
