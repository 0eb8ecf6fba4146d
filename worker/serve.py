"""The worker's serving loop: one request at a time, heartbeats from the loop itself.

Heartbeats come from this loop, not from a side thread: a worker stuck in ``forward`` stops
beating, and the supervisor's ``heartbeat_timeout`` catches it. The loop also watches the
supervisor's pipe: when the supervisor is gone, the worker leaves (PR_SET_PDEATHSIG covers the
case where it is stuck in ``forward``).

Buffer descriptors come on a second channel, the worker's private SEQPACKET socket pair (see
``worker/segments.py``); it is in the poller too, so it is drained while idle.

Messages on the backend socket (a DEALER; the supervisor's ROUTER adds our identity). It is
internal, so it carries no signature frame: one frame fewer per message on the hot path.

  supervisor -> worker
    [{"type": "run", "rid": N}, client_header, payload...]   a client's infer request
    [{"type": "run", "rid": N, "probe": true}]                the sentinel probe
    [{"type": "forget", "tokens": [...]}]                     unmap revoked client buffers
    [{"type": "stop"}]                                        exit 0 (sent once drained)
  worker -> supervisor
    [{"type": "hello", "secret": <32 bytes>}]              first, right after connect: the spawn
          secret from our WorkerSpec; until it is accepted the supervisor drops everything we
          send (see supervisor/workerauth.py)
    [{"type": "state", "state": "LOADING"|"WARMING"|"READY", "info": {...}}]
          info: LOADING: pid, device, cores, threads, interop_threads
                READY: device, cores, threads, interop_threads, probe_baseline_us
    [{"type": "failed", "stage": "boot"|"load"|"warmup", "message": str}]   then exits
    [{"type": "heartbeat", "cuda_bytes": N}]                cuda_bytes on GPU workers only
    [{"type": "result", "rid": N, "ok": true, "outputs": TREE, "tensors": [...],
      "compute_us": N}, payload...]
    [{"type": "result", "rid": N, "ok": false, "error": {"code": C, "message": M}}]
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Callable

import torch
import zmq

from modelwarden.shared import protocol
from modelwarden.shared.codec import (check_bool_bytes, check_finite, dtype_name, flatten, from_bytes,
                                      raw_bytes, unflatten)
from modelwarden.shared.config import WorkerSpec
from modelwarden.shared.protocol import BAD_INPUT, BAD_REQUEST, MODEL_ERROR, OUT_OF_MEMORY, ProtocolError
from modelwarden.shared.shm import ALIGN, Segment
from modelwarden.shared.sockets import recv_parts, send_parts
from modelwarden.shared.states import EXIT_OK, EXIT_ORPHANED
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
        self.send({"type": "hello", "secret": secret})

    def state(self, state: str, **info: Any) -> None:
        self.send({"type": "state", "state": state, "info": info})

    def failed(self, stage: str, message: str) -> None:
        self.send({"type": "failed", "stage": stage, "message": message[:MAX_MESSAGE_CHARS]})


class WorkerServer:
    def __init__(self, spec: WorkerSpec, model: Callable, device: torch.device, channel: Channel,
                 parent_sentinel: int | None, probe_args: tuple, buffer_pair=None) -> None:
        self.spec = spec
        self.model = model
        self.device = device
        self.channel = channel
        self.parent_sentinel = parent_sentinel
        self.probe_args = probe_args
        self.segments = SegmentMaps(buffer_pair)
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
        if kind == "run":
            self._run(header, frames[1:])
        elif kind == "forget":
            self.segments.forget(header.get("tokens") or [])
        elif kind == "stop":
            logger.info("stopping as asked after %d requests", self.served)
            return EXIT_OK
        else:
            logger.error("dropping a message of unknown type %r", kind)
        return None

    def _heartbeat(self) -> None:
        beat: dict[str, Any] = {"type": "heartbeat"}
        if self.device.type == "cuda":
            beat["cuda_bytes"] = torch.cuda.memory_allocated(self.device)
        self.channel.send(beat)

    # -- one request ------------------------------------------------------------------------

    def _run(self, envelope: dict, frames: list) -> None:
        rid = envelope.get("rid")
        reply_frames: list = []
        try:
            # On a GPU everything -- the copies in, forward, the copies out -- is queued on this
            # worker's own stream, so nothing races with work on the default stream.
            with self._on_stream():
                reply, reply_frames = self._compute(envelope, frames)
            reply.update(type="result", rid=rid, ok=True)
        except ProtocolError as exc:
            reply = _failure(rid, exc.code, exc.message)
        except (torch.OutOfMemoryError, MemoryError) as exc:
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            reply = _failure(rid, OUT_OF_MEMORY, f"{type(exc).__name__}: {exc}")
        except Exception as exc:  # the model's own error: report it, keep serving
            logger.warning("request %s: model raised %s: %s", rid, type(exc).__name__, exc)
            reply = _failure(rid, MODEL_ERROR, f"{type(exc).__name__}: {exc}")
        self.channel.send(reply, reply_frames)
        self.served += 1

    def _decode(self, frames: list):
        request = protocol.parse_infer(protocol.unpack_header(frames[0].buffer, strict=False),
                                       len(frames) - 1)
        payload = frames[1:]
        protocol.frame_lengths_match(request.tensors, payload)
        tensors, sources = [], []
        for index, desc in enumerate(request.tensors):
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
        value = unflatten(request.tree, tensors)
        if isinstance(request.tree, dict) and "dict" in request.tree:
            return (), value, sources, out
        if isinstance(request.tree, int):
            return (value,), {}, sources, out
        return tuple(value), {}, sources, out

    def _on_stream(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def _compute(self, envelope: dict, frames: list) -> tuple[dict, list]:
        if envelope.get("probe"):
            args, kwargs, sources, out = self.probe_args, {}, [], None
        else:
            args, kwargs, sources, out = self._decode(frames)
        started = time.perf_counter_ns()
        outputs = self.model(*args, **kwargs)
        if self.stream is not None:
            self.stream.synchronize()  # compute time is the GPU's time, not the launch's
        compute_us = (time.perf_counter_ns() - started) // 1000
        reply, reply_frames = self._encode(outputs, out, sources)
        reply["compute_us"] = compute_us
        return reply, reply_frames

    def _encode(self, outputs: Any, out, sources: list[Segment]) -> tuple[dict, list]:
        leaves: list = []
        try:
            tree = flatten(outputs, leaves)
        except TypeError as exc:
            raise ProtocolError(MODEL_ERROR, f"model output cannot travel: {exc}") from None
        descs, frames, cursor = [], [], 0
        threshold = self.spec.shm_threshold
        for leaf in leaves:
            tensor = leaf if isinstance(leaf, torch.Tensor) else torch.from_numpy(leaf)
            try:
                dtype = dtype_name(tensor.dtype)
            except TypeError as exc:
                raise ProtocolError(MODEL_ERROR, str(exc)) from None
            nbytes = tensor.numel() * tensor.element_size()
            desc = {"dtype": dtype, "shape": list(tensor.shape)}
            alias = _alias(tensor, nbytes, sources)
            if alias is not None:
                desc["shm"] = [alias[0].token, alias[1], nbytes]
            elif out is not None and nbytes >= threshold and cursor + nbytes <= len(out[2]):
                view = from_bytes(out[2][cursor:cursor + nbytes], dtype, tuple(tensor.shape))
                view.copy_(tensor)
                desc["shm"] = [out[0].token, out[1] + cursor, nbytes]
                cursor += -(-nbytes // ALIGN) * ALIGN
            else:
                desc["frame"] = len(frames)
                frames.append(raw_bytes(tensor.detach().to("cpu").contiguous()))
            descs.append(desc)
        if self.stream is not None:
            self.stream.synchronize()
        return {"outputs": tree, "tensors": descs}, frames


def _alias(tensor: torch.Tensor, nbytes: int, sources: list[Segment]) -> tuple[Segment, int] | None:
    """An output lying inside an input's buffer comes back as a pointer into it, as the same
    tensor would in-process: no copy at all."""
    if not sources or nbytes == 0 or tensor.device.type != "cpu" or not tensor.is_contiguous():
        return None
    address = tensor.data_ptr()
    for segment in sources:
        start = segment.address
        if start <= address and address + nbytes <= start + segment.size:
            return segment, address - start
    return None


def _failure(rid: Any, code: str, message: str) -> dict:
    return {"type": "result", "rid": rid, "ok": False,
            "error": {"code": code, "message": message[:MAX_MESSAGE_CHARS]}}
