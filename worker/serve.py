"""The worker's serving loop: one request (or one batch) at a time, heartbeats from the loop
itself.

Heartbeats come from this loop, not from a side thread: a worker stuck in ``forward`` stops
beating, and the supervisor's ``heartbeat_timeout`` catches it. The loop also watches the
supervisor's pipe: when the supervisor is gone, the worker leaves (PR_SET_PDEATHSIG covers the
case where it is stuck in ``forward``).

Buffer descriptors come on a second channel, the worker's private SEQPACKET socket pair (see
``worker/segments.py``); it is in the poller too, so it is drained while idle.

The messages on the worker's link (shared/link.py: our end of a socket pair the supervisor made
at spawn) are specified in docs/PROTOCOL.md, Appendix A, and named by the constants of
shared/protocol.py. The link is private, so its messages carry no signature frame. A result
carries the client's reply header, written here; the supervisor relays it as it is, appending
only "timing" to the packed map.
"""

from __future__ import annotations

import logging
import time
from typing import Any, NamedTuple

import torch

from modelwarden.shared import protocol
from modelwarden.handler import BadInput
from modelwarden.shared.codec import (OutRegion, check_bool_bytes, check_finite, decode_elements,
                                      encode_leaves, from_bytes, reply_placement)
from modelwarden.shared.config import WorkerSpec
from modelwarden.shared.protocol import (BAD_INPUT, BAD_REQUEST, MODEL_ERROR, OUT_OF_MEMORY, TIMEOUT,
                                         ProtocolError, reply_header, result_header,
                                         unpack_header)
from modelwarden.shared.shm import ALIGN, Segment
from modelwarden.shared.link import Link
from modelwarden.shared.sockets import Poller
from modelwarden.shared.states import EXIT_OK, EXIT_ORPHANED
from modelwarden.worker.hostpin import HostPinner
from modelwarden.worker.pipeline import Member, Outputs, Pipeline
from modelwarden.worker.segments import SegmentMaps

logger = logging.getLogger(__name__)
EXPIRED = "the deadline passed while the request waited on the worker; it was not run"
MAX_MESSAGE_CHARS = 2000


class SupervisorLink:
    """The worker's end of its link to the supervisor (shared/link.py). It writes blocking: a
    worker has nothing else to do until the supervisor takes what it says."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self.fd = link.fd

    def send(self, header: dict, frames: list | None = None) -> None:
        parts = [protocol.pack(header)]
        if frames:
            parts.extend(frames)
        self.link.send(parts, True)

    def send_parts(self, parts: list) -> None:
        self.link.send(parts, True)

    def receive(self) -> list:
        """The messages the supervisor wrote, complete by now ([] if none)."""
        return self.link.receive()

    @property
    def gone(self) -> bool:
        """The supervisor closed its end (or the link broke): nothing more will come."""
        return self.link.eof or self.link.broken

    def close(self) -> None:
        self.link.close()

    def hello(self, secret: bytes) -> None:
        self.send({"type": protocol.HELLO, "secret": secret})

    def state(self, state: str, **info: Any) -> None:
        self.send({"type": protocol.STATE, "state": state, "info": info})

    def failed(self, stage: str, message: str) -> None:
        self.send({"type": protocol.FAILED, "stage": stage, "message": message[:MAX_MESSAGE_CHARS]})


class WorkerServer:
    def __init__(self, spec: WorkerSpec, pipeline: Pipeline, device: torch.device,
                 link: SupervisorLink, parent_sentinel: int | None, probe_value: Any,
                 buffer_pair=None) -> None:
        self.spec = spec
        self.pipeline = pipeline
        self.device = device
        self.link = link
        self.parent_sentinel = parent_sentinel
        self.probe_value = probe_value  # the probe's request: tensors, or a handler's inputs
        self.segments = SegmentMaps(buffer_pair, HostPinner.for_device(device),
                                    budget=spec.max_mapped_bytes)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.served = 0
        self.parses = protocol.InferCache()  # client headers seen before but for their id
        self.pack = protocol.packer()  # this loop's own: made once
        # What every request reads of the spec and the device, read once (pydantic and torch
        # attributes cost a lookup each).
        self.reject_nonfinite = spec.model.reject_nonfinite
        self.on_cpu = device.type == "cpu"
        self.worker_id = spec.worker_id
        self.version = spec.version
        self.shm_threshold = spec.shm_threshold

    # -- the loop ---------------------------------------------------------------------------

    def serve(self) -> int:
        # The whole loop runs in inference mode: no autograd bookkeeping for anything built here,
        # and no context manager to enter per request.
        with torch.inference_mode():
            return self._loop()

    def _loop(self) -> int:
        link = self.link
        poller = Poller()
        poller.register(link.fd)
        if self.parent_sentinel is not None:
            poller.register(self.parent_sentinel)
        pair = self.segments.pair.fileno() if self.segments.pair is not None else None
        if pair is not None:
            poller.register(pair)
        interval = self.spec.heartbeat_interval
        next_beat = time.monotonic()
        while True:
            timeout_ms = max(0.0, next_beat - time.monotonic()) * 1000
            ready = poller.poll(timeout_ms)
            if self.parent_sentinel is not None and self.parent_sentinel in ready:
                logger.error("supervisor is gone; leaving")
                return EXIT_ORPHANED
            if pair is not None and pair in ready:
                self.segments.drain()
                if self.segments.pair is None:  # closed: it would poll readable forever
                    poller.unregister(pair)
                    pair = None
            if link.fd in ready:
                for frames in link.receive():  # in order, each one whole
                    code = self._handle(frames)
                    if code is not None:
                        return code
                    if time.monotonic() >= next_beat:  # a beat between two long forwards too
                        self._heartbeat()
                        next_beat = time.monotonic() + interval
                if link.gone:
                    logger.error("the supervisor closed our link; leaving")
                    return EXIT_ORPHANED
            if time.monotonic() >= next_beat:
                self._heartbeat()
                next_beat = time.monotonic() + interval


    def _handle(self, frames: list) -> int | None:
        try:
            header = unpack_header(frames[0], False)
        except ProtocolError as exc:
            logger.error("dropping a malformed message from the supervisor: %s", exc.message)
            return None
        kind = header.get("type")
        if kind == protocol.RUN:
            self._run_alone(header.get("rid"), bool(header.get("probe")), header.get("until"),
                            frames[1:])
        elif kind == protocol.BATCH:
            self._run_batch(header, frames[1:])
        elif kind == protocol.FORGET:
            self.segments.forget(header.get("tokens") or [])
        elif kind == protocol.STOP:
            logger.info("stopping as asked after %d requests", self.served)
            return EXIT_OK
        else:
            logger.error("dropping a message of unknown type %r", kind)
        return None

    def _heartbeat(self) -> None:
        beat: dict[str, Any] = {"type": protocol.HEARTBEAT}
        if self.device.type == "cuda":
            beat["cuda_bytes"] = torch.cuda.memory_allocated(self.device)
        self.link.send(beat)

    # -- one request ------------------------------------------------------------------------

    def _run_alone(self, rid: Any, probe: bool, until: Any, frames: list) -> None:
        call = self._probe_call(rid) if probe else self._prepare(rid, frames)
        if call is None:
            return
        if _expired(until, _now_us()):
            self._answer_expired(call)
        else:
            self._run_call(call)

    def _answer_expired(self, call: "Call") -> None:
        """A request whose deadline passed while it waited behind another on this worker is
        answered TIMEOUT unrun: its client has its TIMEOUT from the supervisor already (or within
        microseconds), and a forward nobody waits for would only delay the next request."""
        self._answer_failure(call.rid, call.client_id, ProtocolError(TIMEOUT, EXPIRED))

    def _run_call(self, call: "Call") -> None:
        """Forward one request and answer it, whatever happens."""
        try:
            with self._on_stream():
                results, compute_us = self._forward([call.member])
                self._answer_result(call, results[0], compute_us)
        except Exception as exc:
            self._answer_failure(call.rid, call.client_id, exc)

    def _answer_result(self, call: "Call", result: "Outputs | Exception", compute_us: int) -> None:
        """One request run alone: its ``result`` message (a batch's go in one ``results``)."""
        if isinstance(result, Exception):  # its own postprocess raised
            self._answer_failure(call.rid, call.client_id, result)
        else:
            self._answer(call, result.tree, result.leaves, compute_us)

    def _result_parts(self, call: "Call", result: "Outputs | Exception") -> tuple:
        """A batch member's answer: (rid, ok, code, [reply header, payload...])."""
        if isinstance(result, Exception):  # its own postprocess raised
            return self._failure_parts(call.rid, call.client_id, result)
        return call.rid, True, None, self._reply_parts(call, result.tree, result.leaves)

    def _send_results(self, members: list, compute_us: int, batch: int) -> None:
        """Every member's answer in one ``results`` message (docs/PROTOCOL.md, Appendix A)."""
        envelope = {"type": protocol.RESULTS, "rids": [member[0] for member in members],
                    "oks": [member[1] for member in members],
                    "codes": [member[2] for member in members],
                    "frames": [len(member[3]) for member in members],
                    "compute_us": compute_us, "batch": batch}
        parts = [self.pack(envelope)]
        for member in members:
            parts.extend(member[3])
        self.link.send_parts(parts)
        self.served += len(members)

    def _prepare(self, rid: Any, frames: list) -> "Call | None":
        """The request decoded and checked, or None once it was answered with its error."""
        client_id = None
        try:
            payload = frames[1:]
            raw = bytes(frames[0])
            request = self.parses.parse(raw, len(payload))  # a header seen before but for its id
            if request is None:
                header = unpack_header(raw, False)
                client_id = header.get("id")
                request = protocol.parse_infer(header, len(payload))
                self.parses.learn(raw, request, len(payload))
            client_id = request.id
            with self._on_stream():
                return self._decode(rid, request, payload)
        except Exception as exc:
            self._answer_failure(rid, client_id, exc)
            return None

    def _probe_call(self, rid: Any) -> "Call | None":
        """The probe through the whole path (a handler's preprocess and postprocess too)."""
        try:
            with self._on_stream():
                return new_call(rid, None, self.pipeline.member(self.probe_value), [], None)
        except Exception as exc:
            self._answer_failure(rid, None, exc)
            return None

    def _forward(self, members: list[Member]) -> tuple[list, int]:
        results, compute_us = self.pipeline.run(members)
        if self.stream is not None:
            started = time.perf_counter_ns()
            self.stream.synchronize()  # compute time is the GPU's time, not the launch's
            compute_us += (time.perf_counter_ns() - started) // 1000
        return results, compute_us

    # -- a batch ----------------------------------------------------------------------------

    def _run_batch(self, envelope: dict, frames: list) -> None:
        """Several requests, one forward pass. Failures stay per request: a member whose input
        fails its checks is answered alone; if the batched forward raises, or its outputs cannot
        be split by member, every member runs again alone, so one bad input fails only itself."""
        members = _split_members(envelope, frames)
        if members is None:
            logger.error("dropping a malformed batch message from the supervisor")
            return
        now = _now_us()
        calls = []
        for rid, until, part in members:
            call = self._prepare(rid, part)
            if call is None:
                continue
            if _expired(until, now):
                self._answer_expired(call)
            else:
                calls.append(call)
        if len(calls) <= 1:
            for call in calls:
                self._run_call(call)
            return
        try:
            with self._on_stream():
                results, compute_us = self._forward([call.member for call in calls])
        except Exception as exc:
            logger.warning("a batch of %d failed as a whole (%s: %s); running each alone",
                           len(calls), type(exc).__name__, exc)
            if self.device.type == "cuda" and isinstance(exc, torch.OutOfMemoryError):
                torch.cuda.empty_cache()
            for call in calls:
                self._run_call(call)
            return
        # One message for the whole batch: the supervisor receives, reads and relays it once.
        members = []
        for call, result in zip(calls, results):
            try:
                with self._on_stream():
                    members.append(self._result_parts(call, result))
            except Exception as exc:
                members.append(self._failure_parts(call.rid, call.client_id, exc))
        self._send_results(members, compute_us, len(calls))

    # -- decoding and answering -------------------------------------------------------------

    def _decode(self, rid: Any, request: protocol.InferRequest, payload: list) -> "Call":
        client_id = request.id
        protocol.frame_lengths_match(request.tensors, payload)
        tensors, sources = [], []
        for desc in request.tensors:
            if desc.longest is not None:  # str/bytes: a list for the model, never a tensor
                tensors.append(self._elements(desc, payload))
                continue
            if desc.shm is None:
                tensors.append(from_bytes(payload[desc.frame], desc.dtype, desc.shape))
                continue
            segment, tensor = self.segments.tensor(desc)
            sources.append(segment)
            tensors.append(tensor)
        problem = check_bool_bytes(tensors)
        if problem:
            raise ProtocolError(BAD_REQUEST, problem)
        if self.reject_nonfinite:
            problem = check_finite(tensors)
            if problem:
                raise ProtocolError(BAD_INPUT, problem)
        if not self.on_cpu:
            tensors = [tensor.to(self.device, non_blocking=True)
                       if isinstance(tensor, torch.Tensor) else tensor for tensor in tensors]
        out = None
        if request.out is not None:
            token, offset, nbytes = request.out
            segment, view = self.segments.region(token, offset, nbytes)
            out = (segment, offset, view)
        return new_call(rid, client_id, self.pipeline.from_request(request.tree, tensors), sources,
                        out)

    def _elements(self, desc: protocol.TensorDesc, payload: list) -> Any:
        """A str/bytes input, decoded and checked (shared.codec.decode_elements): its payload
        frame, or its shared-memory region, copied out element by element."""
        if desc.shm is None:
            return decode_elements(payload[desc.frame], desc)
        _, view = self.segments.region(*desc.shm)
        return decode_elements(view, desc)

    def _on_stream(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else NO_STREAM

    def _answer(self, call: "Call", tree: Any, leaves: list, compute_us: int) -> None:
        """The client's reply header, written here: the supervisor relays it as it is (adding
        only its own timing)."""
        reply = self._reply_parts(call, tree, leaves)
        if call.client_id is None and self.device.type == "cuda":  # the probe: memory after it
            parts = [self.pack({"type": protocol.RESULT, "rid": call.rid, "ok": True,
                                "compute_us": compute_us, "batch": 1,
                                "cuda_bytes": torch.cuda.memory_allocated(self.device)})]
        else:
            parts = [result_header(call.rid, compute_us, 1)]
        parts.extend(reply)
        self.link.send_parts(parts)
        self.served += 1

    def _reply_parts(self, call: "Call", tree: Any, leaves: list) -> list:
        """[the client's reply header, payload frames...] of a success."""
        descs, frames = self._encode(leaves, call.out, call.sources)
        return [reply_header(call.client_id, tree, descs, self.worker_id, self.version), *frames]

    def _answer_failure(self, rid: Any, client_id: Any, exc: BaseException) -> None:
        rid, _, code, parts = self._failure_parts(rid, client_id, exc)
        envelope = {"type": protocol.RESULT, "rid": rid, "ok": False, "code": code}
        self.link.send_parts([self.pack(envelope), *parts])
        self.served += 1

    def _failure_parts(self, rid: Any, client_id: Any, exc: BaseException) -> tuple:
        """(rid, False, code, [the client's error reply])."""
        code, message = self._failure_of(rid, exc)
        reply = protocol.error_header(client_id, code, message[:MAX_MESSAGE_CHARS])
        reply["worker"] = self.worker_id
        reply["version"] = self.version
        return rid, False, code, [self.pack(reply)]

    def _failure_of(self, rid: Any, exc: BaseException) -> tuple[str, str]:
        if isinstance(exc, ProtocolError):
            return exc.code, exc.message
        if isinstance(exc, BadInput):  # a handler's word on this request's input
            return BAD_INPUT, str(exc)
        if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            return OUT_OF_MEMORY, f"{type(exc).__name__}: {exc}"
        # the model's own error: report it, keep serving
        logger.warning("request %s: model raised %s: %s", rid, type(exc).__name__, exc)
        return MODEL_ERROR, f"{type(exc).__name__}: {exc}"

    def _encode(self, leaves: list, out, sources: list[Segment]) -> tuple[list, list]:
        """Each output where shared/codec.py's rule puts it: a pointer into an input's buffer, a
        copy in the request's ``out`` region, or an inline frame."""
        region = OutRegion(out[0].token, out[1], out[2], ALIGN) if out is not None else None
        try:
            descs, frames = encode_leaves(leaves, reply_placement(sources, region,
                                                                  self.shm_threshold))
        except TypeError as exc:  # a dtype that cannot travel
            raise ProtocolError(MODEL_ERROR, str(exc)) from None
        if self.stream is not None:
            self.stream.synchronize()
        return descs, frames


class _NoStream:
    """The CPU's ``_on_stream``: a context that does nothing, made once and compiled with this
    module (contextlib.nullcontext is made per use, and its methods are interpreted)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return False


NO_STREAM = _NoStream()


class Call(NamedTuple):
    """One request, decoded and preprocessed, ready for the model."""

    rid: Any
    client_id: Any
    member: Member  # its tensors, as the pipeline joins them
    sources: list  # the segments its inputs lie in (an output aliasing one goes back as a pointer)
    out: Any  # (segment, offset, view) of its output region, or None


def new_call(rid: Any, client_id: Any, member: Member, sources: list, out: Any) -> Call:
    """``Call(...)`` without the NamedTuple's interpreted ``__new__`` (worker/pipeline.py)."""
    return tuple.__new__(Call, (rid, client_id, member, sources, out))


def _split_members(envelope: dict, frames: list) -> list[tuple[Any, Any, list]] | None:
    """[(rid, until, [header, payload...]), ...] from a batch message, or None if it does not add
    up (``until``: each member's deadline, None where the message has none)."""
    rids, counts, untils = envelope.get("rids"), envelope.get("frames"), envelope.get("until")
    if (not isinstance(rids, list) or not isinstance(counts, list) or len(rids) != len(counts)
            or not all(isinstance(n, int) and n >= 1 for n in counts) or sum(counts) != len(frames)):
        return None
    if not (isinstance(untils, list) and len(untils) == len(rids)):
        untils = [None] * len(rids)
    members, start = [], 0
    for rid, until, count in zip(rids, untils, counts):
        members.append((rid, until, frames[start:start + count]))
        start += count
    return members


def _now_us() -> int:
    """CLOCK_MONOTONIC in microseconds: the clock the supervisor wrote a request's ``until`` in."""
    return time.monotonic_ns() // 1000


def _expired(until: Any, now_us: int) -> bool:
    """Whether a request's deadline (``until``, from the supervisor) is past; a message without
    one, or with one that is not an int, never is."""
    return type(until) is int and now_us > until
