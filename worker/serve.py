"""The worker's serving loop: one request (or one batch) at a time, heartbeats from the loop
itself.

Heartbeats come from this loop, not from a side thread: a worker stuck in ``forward`` stops
beating, and the supervisor's ``heartbeat_timeout`` catches it. The loop also watches the
supervisor's pipe: when the supervisor is gone, the worker leaves (PR_SET_PDEATHSIG covers the
case where it is stuck in ``forward``).

Buffer descriptors come on a second channel, the worker's private SEQPACKET socket pair (see
``worker/segments.py``); it is in the poller too, so it is drained while idle.

Messages on the backend socket (a DEALER; the supervisor's ROUTER adds our identity). It is
internal, so it carries no signature frame: one frame fewer per message on the hot path.

  supervisor -> worker (the type names are constants in shared/protocol.py)
    [{"type": "run", "rid": N}, client_header, payload...]   a client's infer request
    [{"type": "run", "rid": N, "probe": true}]                the sentinel probe
    [{"type": "batch", "rids": [N1, N2, ...], "frames": [F1, F2, ...]},
     client_header1, payload1..., client_header2, payload2...]
          requests for one forward pass: member i has Fi frames (its header and payload)
    [{"type": "forget", "tokens": [...]}]                     unmap revoked client buffers
    [{"type": "stop"}]                                        exit 0 (sent once drained)
    [{"type": "promote", "slot": I, "generation": G, "cores": [...], "threads": T}]
          to a standby only (worker/standby.py): take that slot, re-pin, then say READY
  worker -> supervisor
    [{"type": "hello", "secret": <32 bytes>}]              first, right after connect: the spawn
          secret from our WorkerSpec; until it is accepted the supervisor drops everything we
          send (see supervisor/workerauth.py)
    [{"type": "state", "state": "LOADING"|"WARMING"|"STANDBY"|"READY", "info": {...}}]
          info: LOADING: pid, device, cores, threads, interop_threads
                STANDBY: cores, threads, probe_baseline_us (a standby, warmed up)
                READY: device, cores, threads, interop_threads, probe_baseline_us
    [{"type": "failed", "stage": "boot"|"load"|"warmup", "message": str}]   then exits
    [{"type": "heartbeat", "cuda_bytes": N}]                cuda_bytes on GPU workers only
    [{"type": "result", "rid": N, "ok": true, "compute_us": N, "batch": SIZE}, reply, payload...]
          a probe's answer on a GPU worker adds "cuda_bytes": the CUDA memory held right after it
    [{"type": "result", "rid": N, "ok": false, "code": CODE}, reply]
          one per request (a batch is answered member by member). ``reply`` is the client's
          reply header, written here (protocol.py "Reply", with "worker" and "version", without
          "timing"):
          the supervisor relays it as it is, appending only "timing" to the packed map.
          ``compute_us`` is the whole forward pass's time, ``batch`` its number of requests.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Callable, NamedTuple

import torch
import zmq

from modelwarden.shared import protocol
from modelwarden.shared.codec import (OutRegion, check_bool_bytes, check_finite, encode_leaves,
                                      flatten, from_bytes, reply_placement, unflatten)
from modelwarden.shared.config import WorkerSpec
from modelwarden.shared.protocol import BAD_INPUT, BAD_REQUEST, MODEL_ERROR, OUT_OF_MEMORY, ProtocolError
from modelwarden.shared.shm import ALIGN, Segment
from modelwarden.shared.sockets import recv_parts, send_parts
from modelwarden.shared.states import EXIT_OK, EXIT_ORPHANED
from modelwarden.worker.hostpin import HostPinner
from modelwarden.worker.segments import SegmentMaps

logger = logging.getLogger(__name__)
MAX_MESSAGE_CHARS = 2000


class Channel:
    """The worker's end of the backend socket."""

    def __init__(self, socket: zmq.Socket) -> None:
        self.socket = socket

    def send(self, header: dict, frames: list | None = None) -> None:
        parts = [protocol.pack(header)]
        if frames:
            parts.extend(frames)
        send_parts(self.socket, parts)

    def hello(self, secret: bytes) -> None:
        self.send({"type": protocol.HELLO, "secret": secret})

    def state(self, state: str, **info: Any) -> None:
        self.send({"type": protocol.STATE, "state": state, "info": info})

    def failed(self, stage: str, message: str) -> None:
        self.send({"type": protocol.FAILED, "stage": stage, "message": message[:MAX_MESSAGE_CHARS]})


class WorkerServer:
    def __init__(self, spec: WorkerSpec, model: Callable, device: torch.device, channel: Channel,
                 parent_sentinel: int | None, probe_args: tuple, buffer_pair=None) -> None:
        self.spec = spec
        self.model = model
        self.device = device
        self.channel = channel
        self.parent_sentinel = parent_sentinel
        self.probe_args = probe_args
        self.segments = SegmentMaps(buffer_pair, HostPinner.for_device(device),
                                    budget=spec.max_mapped_bytes)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.served = 0

    # -- the loop ---------------------------------------------------------------------------

    def serve(self) -> int:
        # The whole loop runs in inference mode: no autograd bookkeeping for anything built here,
        # and no context manager to enter per request.
        with torch.inference_mode():
            return self._loop()

    def _loop(self) -> int:
        poller = zmq.Poller()
        poller.register(self.channel.socket, zmq.POLLIN)
        if self.parent_sentinel is not None:
            poller.register(self.parent_sentinel, zmq.POLLIN)
        pair = self.segments.pair.fileno() if self.segments.pair is not None else None
        if pair is not None:
            poller.register(pair, zmq.POLLIN)
        interval = self.spec.heartbeat_interval
        next_beat = time.monotonic()
        while True:
            timeout_ms = max(0.0, next_beat - time.monotonic()) * 1000
            events = dict(poller.poll(timeout_ms))
            if self.parent_sentinel is not None and self.parent_sentinel in events:
                logger.error("supervisor is gone; leaving")
                return EXIT_ORPHANED
            if pair is not None and pair in events:
                self.segments.drain()
                if self.segments.pair is None:  # closed: it would poll readable forever
                    poller.unregister(pair)
                    pair = None
            if self.channel.socket in events:
                code = self._handle(recv_parts(self.channel.socket))
                if code is not None:
                    return code
            if time.monotonic() >= next_beat:
                self._heartbeat()
                next_beat = time.monotonic() + interval


    def _handle(self, frames: list) -> int | None:
        try:
            header = protocol.unpack_header(frames[0].buffer, strict=False)
        except ProtocolError as exc:
            logger.error("dropping a malformed message from the supervisor: %s", exc.message)
            return None
        kind = header.get("type")
        if kind == protocol.RUN:
            self._run_alone(header.get("rid"), bool(header.get("probe")), frames[1:])
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
        self.channel.send(beat)

    # -- one request ------------------------------------------------------------------------

    def _run_alone(self, rid: Any, probe: bool, frames: list) -> None:
        call = self._probe_call(rid) if probe else self._prepare(rid, frames)
        if call is not None:
            self._run_call(call)

    def _run_call(self, call: "Call") -> None:
        """Forward one request and answer it, whatever happens."""
        try:
            with self._on_stream():
                outputs, compute_us = self._forward(call.args, call.kwargs)
                leaves: list = []
                tree = _flatten_outputs(outputs, leaves)
                self._answer(call, tree, leaves, compute_us, 1)
        except Exception as exc:
            self._answer_failure(call.rid, call.client_id, exc)

    def _prepare(self, rid: Any, frames: list) -> "Call | None":
        """The request decoded and checked, or None once it was answered with its error."""
        client_id = None
        try:
            header = protocol.unpack_header(frames[0].buffer, strict=False)
            client_id = header.get("id")
            with self._on_stream():
                return self._decode(rid, client_id, header, frames[1:])
        except Exception as exc:
            self._answer_failure(rid, client_id, exc)
            return None

    def _probe_call(self, rid: Any) -> "Call":
        return Call(rid, None, self.probe_args, {}, [], None, None, [], 0)

    def _forward(self, args: tuple, kwargs: dict) -> tuple[Any, int]:
        started = time.perf_counter_ns()
        outputs = self.model(*args, **kwargs)
        if self.stream is not None:
            self.stream.synchronize()  # compute time is the GPU's time, not the launch's
        return outputs, (time.perf_counter_ns() - started) // 1000

    # -- a batch ----------------------------------------------------------------------------

    def _run_batch(self, envelope: dict, frames: list) -> None:
        """Several requests, one forward pass. Failures stay per request: a member whose input
        fails its checks is answered alone; if the batched forward raises, or its outputs cannot
        be split by member, every member runs again alone, so one bad input fails only itself."""
        members = _split_members(envelope, frames)
        if members is None:
            logger.error("dropping a malformed batch message from the supervisor")
            return
        calls = [call for call in (self._prepare(rid, part) for rid, part in members) if call]
        if len(calls) <= 1:
            for call in calls:
                self._run_call(call)
            return
        try:
            with self._on_stream():
                joined = _concatenate(calls, self.dim)
                args, kwargs = _call_arguments(calls[0].tree, joined)
                outputs, compute_us = self._forward(args, kwargs)
                leaves: list = []
                tree = _flatten_outputs(outputs, leaves)
                shares = _split_outputs(leaves, calls, joined, self.dim)
        except Exception as exc:
            logger.warning("a batch of %d failed as a whole (%s: %s); running each alone",
                           len(calls), type(exc).__name__, exc)
            if self.device.type == "cuda" and isinstance(exc, torch.OutOfMemoryError):
                torch.cuda.empty_cache()
            for call in calls:
                self._run_call(call)
            return
        for call, share in zip(calls, shares):
            try:
                with self._on_stream():
                    self._answer(call, tree, share, compute_us, len(calls))
            except Exception as exc:
                self._answer_failure(call.rid, call.client_id, exc)

    @property
    def dim(self) -> int:
        return self.spec.model.batching.dim

    # -- decoding and answering -------------------------------------------------------------

    def _decode(self, rid: Any, client_id: Any, header: dict, payload: list) -> "Call":
        request = protocol.parse_infer(header, len(payload))
        protocol.frame_lengths_match(request.tensors, payload)
        tensors, sources = [], []
        for desc in request.tensors:
            if desc.shm is None:
                tensors.append(from_bytes(payload[desc.frame].buffer, desc.dtype, desc.shape))
                continue
            segment, tensor = self.segments.tensor(desc)
            sources.append(segment)
            tensors.append(tensor)
        problem = check_bool_bytes(tensors)
        if problem:
            raise ProtocolError(BAD_REQUEST, problem)
        if self.spec.model.reject_nonfinite:
            problem = check_finite(tensors)
            if problem:
                raise ProtocolError(BAD_INPUT, problem)
        if self.device.type != "cpu":
            tensors = [tensor.to(self.device, non_blocking=True) for tensor in tensors]
        out = None
        if request.out is not None:
            token, offset, nbytes = request.out
            segment, view = self.segments.region(token, offset, nbytes)
            out = (segment, offset, view)
        args, kwargs = _call_arguments(request.tree, tensors)
        rows = tensors[0].shape[self.dim] if tensors and tensors[0].dim() > self.dim else 0
        return Call(rid, client_id, args, kwargs, sources, out, request.tree, tensors, rows)

    def _on_stream(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def _answer(self, call: "Call", tree: Any, leaves: list, compute_us: int, batch: int) -> None:
        """The client's reply header, written here: the supervisor relays it as it is (adding
        only its own timing)."""
        descs, frames = self._encode(leaves, call.out, call.sources)
        reply = {"id": call.client_id, "ok": True, "outputs": tree, "tensors": descs,
                 "worker": self.spec.worker_id, "version": self.spec.version}
        envelope = {"type": protocol.RESULT, "rid": call.rid, "ok": True,
                    "compute_us": compute_us, "batch": batch}
        if call.client_id is None and self.device.type == "cuda":  # the probe: memory after it
            envelope["cuda_bytes"] = torch.cuda.memory_allocated(self.device)
        send_parts(self.channel.socket, [protocol.pack(envelope), protocol.pack(reply), *frames])
        self.served += 1

    def _answer_failure(self, rid: Any, client_id: Any, exc: BaseException) -> None:
        code, message = self._failure_of(rid, exc)
        reply = protocol.error_header(client_id, code, message[:MAX_MESSAGE_CHARS])
        reply["worker"] = self.spec.worker_id
        reply["version"] = self.spec.version
        envelope = {"type": protocol.RESULT, "rid": rid, "ok": False, "code": code}
        send_parts(self.channel.socket, [protocol.pack(envelope), protocol.pack(reply)])
        self.served += 1

    def _failure_of(self, rid: Any, exc: BaseException) -> tuple[str, str]:
        if isinstance(exc, ProtocolError):
            return exc.code, exc.message
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
                                                                  self.spec.shm_threshold))
        except TypeError as exc:  # a dtype that cannot travel
            raise ProtocolError(MODEL_ERROR, str(exc)) from None
        if self.stream is not None:
            self.stream.synchronize()
        return descs, frames


class Call(NamedTuple):
    """One request, decoded, ready for the model."""

    rid: Any
    client_id: Any
    args: tuple
    kwargs: dict
    sources: list  # the segments its inputs lie in (an output aliasing one goes back as a pointer)
    out: Any  # (segment, offset, view) of its output region, or None
    tree: Any  # its input TREE
    tensors: list  # its input tensors in descriptor order
    rows: int  # its size along the batch dimension


def _call_arguments(tree: Any, tensors: list) -> tuple[tuple, dict]:
    value = unflatten(tree, tensors)
    if isinstance(tree, dict) and "dict" in tree:
        return (), value
    if isinstance(tree, int):
        return (value,), {}
    return tuple(value), {}


def _flatten_outputs(outputs: Any, leaves: list) -> Any:
    try:
        return flatten(outputs, leaves)
    except TypeError as exc:
        raise ProtocolError(MODEL_ERROR, f"model output cannot travel: {exc}") from None


def _split_members(envelope: dict, frames: list) -> list[tuple[Any, list]] | None:
    """[(rid, [header, payload...]), ...] from a batch message, or None if it does not add up."""
    rids, counts = envelope.get("rids"), envelope.get("frames")
    if (not isinstance(rids, list) or not isinstance(counts, list) or len(rids) != len(counts)
            or not all(isinstance(n, int) and n >= 1 for n in counts) or sum(counts) != len(frames)):
        return None
    members, start = [], 0
    for rid, count in zip(rids, counts):
        members.append((rid, frames[start:start + count]))
        start += count
    return members


def _concatenate(calls: list[Call], dim: int) -> list[torch.Tensor]:
    """Every member's inputs joined along ``dim``, in descriptor order: one copy per input (the
    supervisor merged only requests with the same tree, dtypes and non-batch dimensions;
    checked again here)."""
    first = calls[0]
    if any(call.tree != first.tree or len(call.tensors) != len(first.tensors) for call in calls):
        raise ValueError("batch members disagree on their inputs")
    return [torch.cat([call.tensors[index] for call in calls], dim)
            for index in range(len(first.tensors))]


def _split_outputs(leaves: list, calls: list[Call], joined: list, dim: int) -> list[list]:
    """Per member, its share of every output: views along ``dim``, no copy. An output that *is*
    a joined input (an identity-like model) gives each member its own input tensor back, so
    an input that came in shared memory goes back as a pointer into it, as it would alone."""
    rows = [call.rows for call in calls]
    total = sum(rows)
    pieces = []
    for index, leaf in enumerate(leaves):
        tensor = leaf if isinstance(leaf, torch.Tensor) else torch.from_numpy(leaf)
        same = next((k for k, whole in enumerate(joined) if tensor is whole), None)
        if same is not None:
            pieces.append([call.tensors[same] for call in calls])
            continue
        if tensor.dim() <= dim or tensor.shape[dim] != total:
            raise ValueError(f"output {index} has shape {list(tensor.shape)}: not {total} rows "
                             f"along dim {dim}, so it cannot be split by member")
        pieces.append(torch.split(tensor, rows, dim))
    return [[piece[member] for piece in pieces] for member in range(len(rows))]
