"""Routing: accept client requests, queue them per model, hand them to the least-loaded READY
worker, answer each exactly once.

The supervisor never reads payload bytes: inline frames are checked by length and forwarded as
the same ZeroMQ frames; shared-memory descriptors are checked against the buffer registry and
forwarded as they came, after the buffers' descriptors were handed to the worker on its private
socket pair (before the run message: the worker finds them queued when it reads the run). Every
accepted request ends in ``finish``, which answers it once and forgets it: with the worker's
result, a TIMEOUT from its deadline timer, a retry verdict after a worker death, or SHUTTING_DOWN.
"""

from __future__ import annotations

import errno
import logging
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import zmq

from modelwarden.shared import fdchannel, protocol
from modelwarden.shared.mpack import pack_two_after, pack_uint_arrays
from modelwarden.shared.protocol import (BAD_REQUEST, BUFFER_NOT_REGISTERED, NO_WORKER,
                                         OUT_OF_MEMORY, OVERLOADED, SHUTTING_DOWN, SIGNATURE,
                                         TIMEOUT, UNKNOWN_MODEL, InferCache, ProtocolError, add_timing,
                                         frame_lengths_match, parse_infer, request_id_of)
from modelwarden.shared.sockets import send_parts
from modelwarden.shared.states import WorkerState
from modelwarden.supervisor.routing.batching import hold_until, pick, remove, signature
from modelwarden.supervisor.routing.deadlines import Deadlines
from modelwarden.supervisor.routing.workers import (has_room, least_loaded, needs_the_pool,
                                                    probe_due, serves_nothing)
from modelwarden.supervisor.fleet.handle import WorkerHandle
from modelwarden.supervisor.routing.limits import ReplyLedger, RequestBytes, payload_bytes
from modelwarden.supervisor.fleet import probes
from modelwarden.supervisor.routing.service import ModelService
from modelwarden.supervisor.routing.requests import (ProbeRequest, Refused, Request, after_worker_death,
                                             check_declared, now_ns)

if TYPE_CHECKING:
    from modelwarden.shared.config import Settings
    from modelwarden.supervisor.routing.buffers import BufferRegistry
    from modelwarden.supervisor.fleet.pool import ModelPool
    from modelwarden.supervisor.routing.quotas import Quotas
    from modelwarden.supervisor.timers import Timers

logger = logging.getLogger(__name__)


# {"type": "run", "until": U, "rid": N} with U and N packed separately: the same bytes as packing
# the whole map, for a fraction of the cost on the hot path.
_RUN_PREFIX = (b"\x83" + protocol.pack("type") + protocol.pack(protocol.RUN)
               + protocol.pack("until"))
_RID_KEY = protocol.pack("rid")
# {"type": "batch", "rids": [...], "frames": [...], "until": [...]}: the packed map's head and
# keys; mpack.pack_uint_arrays writes the lists.
_BATCH_PREFIX = b"\x84" + protocol.pack("type") + protocol.pack(protocol.BATCH)
_BATCH_KEYS = (protocol.pack("rids"), protocol.pack("frames"), protocol.pack("until"))
_NO_FRAMES: list = []
_READY = WorkerState.READY


@runtime_checkable
class RouterHost(Protocol):
    """What the router needs from whoever runs it (the Arbiter; tests' FakeRouterHost):

    * ``settings``: the daemon's limits; ``pools``: model name -> ModelPool (the router asks a
      pool which worker has room, tells it of each result, and reads its config);
    * ``clock()`` (monotonic seconds) and ``timers``: deadlines and batch holds;
    * ``stopping``: new requests get SHUTTING_DOWN;
    * ``registry`` and ``shm_offered(frontend)``: shared-memory regions are checked there;
    * ``quotas``: each request counts against its identity's share (supervisor/routing/quotas.py).

    A worker is reached on its own link (``WorkerHandle.link``, shared/link.py).
    """

    settings: "Settings"
    pools: dict
    timers: "Timers"
    stopping: bool
    registry: "BufferRegistry"
    quotas: "Quotas"

    def clock(self) -> float: ...

    def shm_offered(self, frontend: int) -> bool: ...


class Router:
    """Every request's life, from acceptance to its one answer: the queues, what each worker
    holds (``WorkerHandle.inflight``, written only here), the probes in flight, the deadlines.
    Compiled, an extension type (router.pxd) whose per-request methods are called the C way."""

    def __init__(self, host: RouterHost) -> None:
        self.host = host
        # Read per request, and never replaced for the host's life: held here, where a read is
        # a C field's, not an attribute lookup on the host.
        self._quotas = host.quotas
        self._clock = host.clock
        self.pending: dict[int, Request] = {}  # accepted, not yet answered (probes are not here)
        self.services: dict[str, ModelService] = {}  # model name -> its request state (service_of)
        self.parses = InferCache()  # infer headers seen before, but for their id
        self._by_pool: dict = {}  # ModelPool -> its ModelService, until the pool is forgotten
        self._wanted: list = []  # the services whose ``wanted`` was set this round
        self._next_rid = 1
        self.deadlines = Deadlines(host.timers, host.clock, self.expire)
        daemon = host.settings.daemon
        self.request_bytes = RequestBytes(daemon.max_request_bytes_per_connection,
                                          daemon.max_request_bytes)
        self.replies = ReplyLedger(daemon.max_unread_bytes_per_connection, daemon.max_unread_bytes)
        # Called once per answered request with (request, code, timing): "ok" or the error
        # code; timing as the client sees it, None for an error. Metrics and the access log.
        self.observers: list = []

    def service_of(self, pool: "ModelPool") -> ModelService:
        """The model's request state (routing/service.py), made on first use, following the
        pool's configuration."""
        service = self._by_pool.get(pool)  # by the pool object itself: no name to hash
        if service is None:
            service = self.services.get(pool.name)
            if service is None:
                service = self.services[pool.name] = ModelService(pool.name)
            self._by_pool[pool] = service
        service.follow(pool.config)
        return service

    def forget(self, pool: "ModelPool") -> None:
        """A removed model's pool is gone for good (its last worker left)."""
        self._by_pool.pop(pool, None)

    def _new_rid(self) -> int:
        rid = self._next_rid
        self._next_rid = rid + 1
        return rid

    # -- intake -----------------------------------------------------------------------------

    def accept_infer(self, socket: zmq.Socket, connection: tuple, envelope: protocol.Envelope,
                     header: dict, identity: str = "-") -> None:
        """``connection`` is (frontend index, routing id); ``identity`` whose shares the request
        counts against (supervisor/routing/identity.py)."""
        request_id = request_id_of(header)
        try:
            if self.host.stopping:
                raise ProtocolError(SHUTTING_DOWN, "the daemon is shutting down")
            parsed = parse_infer(header, len(envelope.payload))
        except ProtocolError as exc:
            self._refuse(socket, envelope, request_id, None, exc)
            return
        self.parses.learn(envelope.header, parsed, len(envelope.payload))
        self.accept_parsed(socket, connection, envelope, parsed, identity)

    def accept_parsed(self, socket: zmq.Socket, connection: tuple, envelope: protocol.Envelope,
                      parsed: protocol.InferRequest, identity: str = "-") -> None:
        """A request whose header parsed (``parse_infer``, or ``self.parses`` for a header seen
        before but for its id): everything else it must pass, then the queue."""
        host = self.host
        pool = None
        try:
            if host.stopping:
                raise ProtocolError(SHUTTING_DOWN, "the daemon is shutting down")
            payload = envelope.payload
            frame_lengths_match(parsed.tensors, payload)
            pool = host.pools.get(parsed.model)
            if pool is None:
                raise ProtocolError(UNKNOWN_MODEL, f"no model named {parsed.model!r}; "
                                    f"configured: {', '.join(host.pools)}")
            service = self.service_of(pool)
            buffers = self._check_regions(connection[0], parsed)
            if service.inputs is not None:
                check_declared(parsed.tree, parsed.tensors, service.inputs)
            if serves_nothing(pool.slots):
                raise ProtocolError(NO_WORKER, f"every worker of {pool.name!r} is FATAL or "
                                    "stopped; see `modelwarden status`, then `modelwarden restart`")
            queue = service.queue
            if len(queue) >= service.max_queue:
                raise ProtocolError(OVERLOADED, f"{pool.name!r} has {len(queue)} requests "
                                    "queued (max_queue); retry later")
            if self.replies.refusing:
                refusal = self.replies.refusal(connection)
                if refusal is not None:
                    raise ProtocolError(OVERLOADED, refusal)
            nbytes = payload_bytes(payload)
            self._take_budgets(connection, identity, nbytes)  # last: nothing refuses it after this
        except ProtocolError as exc:
            self._refuse(socket, envelope, parsed.id, pool, exc)
            return
        now = self._clock()
        timeout = parsed.timeout_ms / 1000 if parsed.timeout_ms is not None else service.timeout
        request = Request(self._new_rid(), socket, envelope.route, parsed.id, service.name,
                          envelope.header, payload, now_ns(), now + timeout,
                          connection, nbytes, buffers, identity)
        request.timeout = timeout
        request.arrived = now
        if service.batch_enabled:
            key = signature(parsed, service.batching, service.handler)
            if key is not None:
                request.batch_key, request.rows = key
            request.queued_under_load = (bool(queue)
                                         or least_loaded(pool.slots, service.max_inflight) is None)
        waiting = bool(queue)
        self.pending[request.rid] = request
        self.deadlines.add(request, timeout)
        queue.append(request)
        # Batching: at the end of this poll round, once every request that arrived with this one
        # is queued beside it (clients answered together send again together: dispatched one by
        # one, the first would find the worker that just freed and go to it alone). The round
        # ends as soon as its handlers have run, so a lone request on an idle pool still goes
        # at once. Without batching: at once, if the queue was empty; behind others it waits its
        # turn, since dispatch left them queued because no worker had room, and whatever frees
        # one dispatches (a result at the end of its round, a worker READY, a death, the tick).
        if service.batch_enabled:
            self._want(service, pool)
        elif not waiting:
            self.dispatch(pool)

    def _refuse(self, socket, envelope, request_id, pool, exc: ProtocolError) -> None:
        """Answer a request refused at intake with its typed error (the observers see it)."""
        self.send_error(socket, envelope.route, request_id, exc.code, exc.message, exc.detail)
        if self.observers:
            refused = Refused(request_id, pool.name if pool is not None else "-",
                              now_ns())
            for observe in self.observers:
                observe(refused, exc.code, None)

    def _take_budgets(self, connection: tuple, identity: str, nbytes: int) -> None:
        """The identity's share of requests and bytes, then the connection's and the daemon's
        bytes; all or nothing."""
        quotas = self._quotas
        quotas.take_request(identity, nbytes)
        try:
            self.request_bytes.take(connection, nbytes)
        except ProtocolError:
            quotas.give_back_request(identity, nbytes)
            raise

    def _check_regions(self, frontend: int, parsed: protocol.InferRequest) -> tuple:
        """The tokens the request uses, each checked: registered, the region inside it, and its
        bytes -- what a worker will fault in -- within max_shm_tensor_bytes and, in all,
        max_shm_request_bytes."""
        tokens = parsed.buffers()
        if not tokens:
            return ()
        if not self.host.shm_offered(frontend):
            raise ProtocolError(BAD_REQUEST, "shared memory is only offered on ipc:// endpoints "
                                "with daemon.shm = true")
        registry = self.host.registry
        regions = [(f"tensor {index}", desc.shm) for index, desc in enumerate(parsed.tensors)
                   if desc.shm is not None]
        if parsed.out is not None:
            regions.append(("'out'", parsed.out))
        daemon = self.host.settings.daemon
        total = 0
        for what, region in regions:
            registry.check(region, what)
            if region[2] > daemon.max_shm_tensor_bytes:
                raise ProtocolError(BAD_REQUEST, f"{what}: {region[2]} bytes in shared memory "
                                    f"exceed max_shm_tensor_bytes ({daemon.max_shm_tensor_bytes})")
            total += region[2]
        if total > daemon.max_shm_request_bytes:
            raise ProtocolError(BAD_REQUEST, f"the request names {total} bytes of shared memory; "
                                f"max_shm_request_bytes is {daemon.max_shm_request_bytes}")
        return tuple(tokens)

    # -- dispatch ---------------------------------------------------------------------------

    def dispatch_wanted(self) -> None:
        """Dispatch every pool whose workers freed up, or that batches and took requests, since
        the last call (the loop calls it once per poll round: results that arrive together free
        their workers, and requests that arrive together join the queue, before any worker
        takes the next batch, so the batch is as full as the queue allows)."""
        if not self._wanted:
            return
        wanted, self._wanted = self._wanted, []
        for service in wanted:
            if service.wanted is not None:
                pool, service.wanted = service.wanted, None
                self.dispatch(pool)

    def queued(self, pool: "ModelPool") -> int:
        return len(self.service_of(pool).queue)

    def dispatch(self, pool: "ModelPool") -> None:
        service = self.service_of(pool)
        queue = service.queue
        if not queue:
            return
        now = self._clock()
        config = service.batching
        slots = pool.slots
        while queue:
            handle = least_loaded(slots, service.max_inflight)
            if handle is None:
                return
            if service.batch_enabled:
                members = pick(queue, config)
                if service.max_delay_us and self._hold(service, pool, members, now):
                    return
                remove(queue, members)
            else:
                members = [queue.popleft()]
            members = [request for request in members
                       if not request.done and self._pass_buffers(handle, request)]
            if len(members) == 1:
                self._send(handle, members[0], now)
            elif members:
                self._send_batch(handle, members, now)
            if members and service.batch_enabled:
                service.batches.record(len(members))

    def _hold(self, service: ModelService, pool: "ModelPool", members: list, now: float) -> bool:
        """True while a partial batch waits for more members (a timer sends it later)."""
        until = hold_until(members, pool.config.batching)
        if until is None or until <= now:
            return False
        if service.hold is None:
            service.hold = self.host.timers.call_at(until, self._release, service, pool)
        return True

    def _release(self, service: ModelService, pool: "ModelPool") -> None:
        service.hold = None
        self.dispatch(pool)  # the held head's wait is over now: it goes with what is there

    def send_due_probes(self, pool: "ModelPool", handles: list[WorkerHandle]) -> None:
        """Probes go out between real requests: to a worker with room whose probe is due."""
        service = self.service_of(pool)
        if not service.probes:
            return
        now = self._clock()
        for handle in handles:
            self._probe_if_due(service, handle, now)

    def _probe_if_due(self, service: ModelService, handle: WorkerHandle, now: float) -> None:
        if probe_due(handle, now) and has_room(handle, service.max_inflight):
            self._send_probe(handle, now)

    def _pass_buffers(self, handle: WorkerHandle, request: Request) -> bool:
        """Hand the worker the descriptors of the buffers it lacks; False if the request was
        answered instead (a token revoked while it waited, or the worker's pair is full)."""
        if not request.buffers:
            return True
        missing = [token for token in request.buffers if token not in handle.buffers]
        if not missing:
            return True
        registry = self.host.registry
        buffers = [registry.get(token) for token in missing]
        if None in buffers:
            self.finish(request, protocol.error_header(
                request.client_id, BAD_REQUEST, "a buffer of this request was revoked before it "
                "could run (its channel connection closed)", BUFFER_NOT_REGISTERED))
            return False
        step = fdchannel.MAX_FDS_PER_MESSAGE
        try:
            for start in range(0, len(missing), step):
                batch = buffers[start:start + step]
                fdchannel.send_message(handle.buffer_socket, {
                    "type": fdchannel.HAND_OVER, "tokens": missing[start:start + step],
                    "sizes": [buffer.size for buffer in batch]}, [buffer.fd for buffer in batch])
                handle.buffers.update(missing[start:start + step])
        except OSError as exc:
            if fdchannel.is_gone(exc):
                return True  # the worker is dying: its sentinel will bring the request back
            logger.error("%s: cannot pass buffers for rid=%s id=%r (%s)", handle.worker_id,
                         request.rid, request.client_id, errno.errorcode.get(exc.errno, exc))
            self.fail(request, OVERLOADED, f"worker {handle.worker_id} is not taking buffers; retry")
            return False
        return True

    def _send(self, handle: WorkerHandle, request: Request, now: float) -> None:
        parts = [pack_two_after(_RUN_PREFIX, _until(request), _RID_KEY, request.rid),
                 request.header_frame]
        parts.extend(request.payload)
        handle.link.send(parts)
        _mark_sent(handle, request, 1, now)

    def _send_batch(self, handle: WorkerHandle, members: list, now: float) -> None:
        """One message, every member's header and payload frames as they came: the supervisor
        still never touches payload bytes."""
        rids, counts, until = [], [], []
        parts = [None]
        for member in members:
            rids.append(member.rid)
            counts.append(1 + len(member.payload))
            until.append(_until(member))
            parts.append(member.header_frame)
            parts.extend(member.payload)
        # {"type": "batch", "rids": [...], "frames": [...], "until": [...]}
        parts[0] = pack_uint_arrays(_BATCH_PREFIX, _BATCH_KEYS, (rids, counts, until))
        handle.link.send(parts)
        for member in members:
            _mark_sent(handle, member, len(members), now)

    def _send_probe(self, handle: WorkerHandle, now: float) -> None:
        probe = ProbeRequest(self._new_rid(), handle)
        handle.link.send([probes.run_probe(probe.rid)])
        handle.probe.sent(probe.rid, now, len(handle.inflight))
        handle.inflight[probe.rid] = probe

    # -- answers ----------------------------------------------------------------------------

    def on_result(self, pool: "ModelPool", handle: WorkerHandle, envelope: dict, frames: list) -> None:
        """``frames``: the reply header the worker wrote for the client, then its payload."""
        self._on_answer(pool, handle, envelope.get("rid"), envelope.get("ok"),
                        envelope.get("code"), envelope.get("compute_us"), envelope.get("batch", 1),
                        frames, envelope)

    def _on_answer(self, pool: "ModelPool", handle: WorkerHandle, rid, ok, code, compute_us,
                   batch, frames: list, envelope: dict | None) -> None:
        """One answer of ``handle``'s, read from its ``result`` message (``envelope``) or from
        its part of a ``results`` message (``envelope`` None). A probe's verdict reads an
        envelope: probes go alone, so one answered in a batch's message gets one made here."""
        request = handle.inflight.pop(rid, None)
        if request is None:
            logger.error("%s answered rid=%s, a request it does not hold", handle.worker_id, rid)
            return
        if not frames:
            logger.error("%s sent a result without a reply header (rid=%s)", handle.worker_id, rid)
            frames = [protocol.pack(protocol.error_header(None, protocol.INTERNAL,
                                                          "the worker's answer had no header"))]
            ok, code, envelope = False, None, {"ok": False}
        probe = isinstance(request, ProbeRequest)
        if probe:
            if envelope is None:
                envelope = {"rid": rid, "ok": ok, "code": code, "compute_us": compute_us,
                            "batch": batch}
            self._judge_probe(pool, handle, request, envelope, frames)
        else:
            self._relay_result(handle, request, ok, code, compute_us, batch, frames)
        if code == OUT_OF_MEMORY:
            # An allocator that failed once (fragmented CUDA cache, a heap at its limit) is not
            # trusted with the next request: a fresh process takes the slot, replace before retire.
            pool.replace(handle, "out of memory in forward")
        if needs_the_pool(handle):
            pool.after_result(handle)
        service = self.service_of(pool)
        if service.probes:
            now = self._clock()
            if not probe:
                handle.probe.answered_ahead(now)  # a probe behind it may start now
            if handle.state is _READY:
                self._probe_if_due(service, handle, now)
        self._want(service, pool)

    def _want(self, service: ModelService, pool: "ModelPool") -> None:
        """Dispatch ``pool`` at the end of this poll round (``dispatch_wanted``), once."""
        if service.wanted is None:
            self._wanted.append(service)
        service.wanted = pool

    def on_results(self, pool: "ModelPool", handle: WorkerHandle, envelope: dict,
                   frames: list) -> None:
        """A batch's answers in one message (``results``): member *i* owns the next ``frames[i]``
        frames (its reply header, then its payload), and is handled as ``on_result`` handles one
        result. A message that does not add up is a broken worker: it is replaced (replace before
        retire), and what it held is retried or answered as after its death."""
        members = _batch_members(envelope, len(frames))
        if members is None:
            logger.error("%s sent a malformed results message: replacing it", handle.worker_id)
            pool.replace(handle, "malformed results message")
            return
        compute_us, batch = envelope.get("compute_us"), envelope.get("batch", 1)
        start = 0
        for rid, ok, code, count in members:
            self._on_answer(pool, handle, rid, ok, code, compute_us, batch,
                            frames[start:start + count], None)
            start += count

    def _relay_result(self, handle: WorkerHandle, request: Request, ok, code, compute_us, batch,
                      frames: list) -> None:
        """The worker wrote the client's reply header; only the timing is added, as bytes
        appended to the map, not by decoding and encoding it again."""
        handle.served += 1
        if request.done:  # it timed out while the worker was busy with it
            return
        if ok:
            total_us = (now_ns() - request.received_ns) // 1000
            handle.latencies_us.append(total_us)
            queue_us = (request.dispatched_ns - request.received_ns) // 1000
            header = add_timing(frames[0], queue_us, compute_us, total_us, batch)
            timing = None
            if self.observers:
                timing = {"queue_us": queue_us, "compute_us": compute_us, "total_us": total_us,
                          "batch": batch}
            self._answer(request, header, frames[1:], "ok", timing)
        elif code == TIMEOUT:
            # The worker found its deadline passed when its turn came, a moment before the
            # deadline timer here: answered as the timer would have, the daemon's own TIMEOUT.
            self.expire(request)
        else:
            handle.errors += 1
            code = _error_code(frames[0]) if self.observers else ""
            self._answer(request, frames[0], frames[1:], code)

    @staticmethod
    def _judge_probe(pool: "ModelPool", handle: WorkerHandle, probe: ProbeRequest,
                     envelope: dict, frames: list) -> None:
        verdict = probes.verdict_of(handle.probe, probe.rid, envelope, frames[0],
                                    frames[1:], pool.judge, handle.spec.version)
        if verdict is not None:
            pool.record_probe(handle, verdict)

    def finish(self, request: Request, reply: dict) -> None:
        """Answer a request exactly once (with a header the supervisor wrote: an error)."""
        self._answer(request, protocol.pack(reply), code=(reply.get("error") or {}).get("code", "ok"))

    def _answer(self, request: Request, header, frames: list | None = None, code: str = "ok",
                timing: dict | None = None) -> None:
        """Send the one answer: ``header`` is packed bytes (or a frame), ``frames`` its payload;
        ``code`` and ``timing`` are for the observers."""
        if request.done:
            return
        request.done = True
        self.deadlines.answered(request, request.timeout)
        self.pending.pop(request.rid, None)
        if request.nbytes:
            self.request_bytes.give_back(request.connection, request.nbytes)
        quotas = self._quotas
        quotas.give_back_request(request.identity, request.nbytes)
        # An answered request may wait in its deadline lane a while: it keeps no payload there.
        request.payload = _NO_FRAMES
        request.header_frame = None
        parts = list(request.route)
        parts.append(SIGNATURE)
        parts.append(header)
        if frames:
            parts.extend(frames)
            dropped = self.replies.prepare(request.connection, parts, payload_bytes(frames))
            if dropped is not None:
                parts = [*request.route, SIGNATURE, protocol.pack(
                    protocol.error_header(request.client_id, OVERLOADED, dropped))]
                code, timing = OVERLOADED, None
        try:
            send_parts(request.socket, parts)
        except zmq.ZMQError as exc:  # a closing socket at shutdown; a ROUTER drops the rest silently
            logger.warning("could not answer request rid=%s id=%r: %s", request.rid, request.client_id, exc)
        if self.observers:
            for observe in self.observers:
                observe(request, code, timing)

    def fail(self, request: Request, code: str, message: str) -> None:
        self.finish(request, protocol.error_header(request.client_id, code, message))

    def send_error(self, socket: zmq.Socket, route: list, request_id: Any, code: str,
                   message: str, detail: str | None = None) -> None:
        try:
            send_parts(socket, [*route, SIGNATURE, protocol.pack(
                protocol.error_header(request_id, code, message, detail))])
        except zmq.ZMQError as exc:
            logger.warning("could not send a %s error: %s", code, exc)

    # -- deadlines and deaths ---------------------------------------------------------------

    def expire(self, request: Request) -> None:
        if request.done:
            return
        where = f"on {request.worker.worker_id}" if request.worker is not None else "in the queue"
        if request.worker is None:
            try:
                self.services[request.model].queue.remove(request)  # it was queued: it is there
            except ValueError:
                pass
        self.fail(request, TIMEOUT, f"no answer within the deadline (request was {where})")

    def recover(self, pool: "ModelPool", handle: WorkerHandle) -> None:
        """The worker is gone or declared dead: retry what it held, or answer it.

        A worker runs what it holds in the order it was sent, so only its first message can have
        been running when it died: the first request and its batch mates (or nothing, if a probe
        was first). Only they count the death (two make POISON) and, if they shared a batch, run
        alone from now on, so a poison input dies alone. The requests queued behind them never
        started: they go back to the front of the queue with nothing counted against them."""
        held = list(handle.inflight.values())
        handle.inflight.clear()
        running = _first_message(held)
        retry = []
        for position, request in enumerate(held):
            if isinstance(request, ProbeRequest):
                handle.probe.settle()
                continue
            if request.done:
                continue
            if position >= running:
                request.worker = None  # it never started: no death to count
                retry.append(request)
                continue
            request.alone = request.alone or request.batch_size > 1
            verdict = after_worker_death(request, pool.config.retries)
            if verdict is None:
                retry.append(request)
            else:
                logger.error("%s died holding rid=%s id=%r: answering %s", handle.worker_id,
                             request.rid, request.client_id, verdict)
                self.fail(request, verdict, self._death_message(verdict, handle))
        if retry:
            logger.warning("%s died holding %d request(s); retrying them (rid=%s)", handle.worker_id,
                           len(retry), ",".join(str(request.rid) for request in retry))
            self.service_of(pool).queue.extendleft(reversed(retry))
        self.dispatch(pool)

    @staticmethod
    def _death_message(code: str, handle: WorkerHandle) -> str:
        if code == protocol.POISON:
            return "the request was running on two workers that both died; not retrying it"
        return f"worker {handle.worker_id} died running the request (retries are off)"

    def fail_queue(self, pool: "ModelPool", code: str, message: str) -> None:
        queue = self.service_of(pool).queue
        while queue:
            request = queue.popleft()
            self.fail(request, code, message)

    def fail_everything(self, code: str, message: str) -> None:
        for request in list(self.pending.values()):
            self.fail(request, code, message)
        for queue in [service.queue for service in self.services.values()]:
            queue.clear()


def _batch_members(envelope: dict, count: int) -> list | None:
    """[(rid, ok, code, frames)] of a ``results`` envelope whose lists agree with each other and
    with the ``count`` frames that follow it; None when they do not."""
    rids, oks, codes, sizes = (envelope.get("rids"), envelope.get("oks"), envelope.get("codes"),
                               envelope.get("frames"))
    if not (isinstance(rids, list) and isinstance(oks, list) and isinstance(codes, list)
            and isinstance(sizes, list) and len(rids) == len(oks) == len(codes) == len(sizes)):
        return None
    members = []
    total = 0
    for rid, ok, code, size in zip(rids, oks, codes, sizes):
        if (type(ok) is not bool or type(size) is not int or size < 1
                or not (code is None or isinstance(code, str))):
            return None
        total += size
        members.append((rid, ok, code, size))
    return members if total == count else None


def _until(request: Request) -> int:
    """The request's deadline in whole microseconds of the router's clock, which in the daemon
    is CLOCK_MONOTONIC (``time.monotonic``), the clock every process on the host reads alike: a
    worker that finds it passed when the request's turn comes answers TIMEOUT without running it
    (its client has had TIMEOUT already, or is about to)."""
    return int(request.deadline * 1_000_000)


def _first_message(held: list) -> int:
    """How many of ``held`` (a dead worker's inflight, in the order sent) were its first message:
    0 when that was a probe, else the first request's batch size (a batch's members are sent
    together and held side by side)."""
    if not held or isinstance(held[0], ProbeRequest):
        return 0
    return held[0].batch_size


def _mark_sent(handle: WorkerHandle, request: Request, batch_size: int, now: float) -> None:
    request.worker = handle
    request.batch_size = batch_size
    request.dispatched_ns = now_ns()
    handle.inflight[request.rid] = request
    handle.last_dispatch = now


def _error_code(frame) -> str:
    """The code in a worker's error reply header (for metrics and the access log)."""
    try:
        error = protocol.unpack_header(frame, strict=False).get("error")
    except ProtocolError:
        return protocol.INTERNAL
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) else protocol.INTERNAL
