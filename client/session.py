"""One client's request building and reply decoding, shared by all its connections.

Flattens inputs into descriptors, decides inline or shared memory per tensor, keeps the leases a
request holds, and turns replies back into tensors (over reply frames, or over the client's own
shared memory). No sockets here: Client, its I/O thread and AsyncClient own those.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from modelwarden.shared import protocol
from modelwarden.shared.codec import (Elements, copy_into, decode_elements, dtype_name, encode,
                                      frame_tensor, from_bytes, inline_only, to_numpy, unflatten)
from modelwarden.shared.descriptors import InferReply, ReplyCache, ReplyError, parse_reply
from modelwarden.shared.errors import ERRORS, InternalError, RemoteError, Timeout, error_from_reply
from modelwarden.shared.fdchannel import BufferChannelClient
from modelwarden.shared.protocol import (SIGNATURE, ProtocolError, TensorDesc, infer_header,
                                         reply_parts, unpack_header)
from modelwarden.shared.rawconfig import check_announced_channel
from modelwarden.shared.shm import ALIGN, Region, ShmArena

logger = logging.getLogger(__name__)

GRACE_S = 1.0  # how much longer than the request timeout the client waits for the daemon
HELLO_TIMEOUT_S = 10.0  # the first exchange has no queue to wait in: a silent daemon is down


@dataclass
class Reply:
    """What ``infer(..., details=True)`` returns: outputs plus where and how long."""

    outputs: Any
    worker: str | None
    timing: dict
    version: str | None = None  # the model version that answered (docs/PROTOCOL.md 7.1)


class Pending:
    """One request in flight. A plain class, one per request: a dataclass's ``__init__`` is
    generated Python source, interpreted even when this module is compiled."""

    __slots__ = ("id", "model", "numpy_out", "details", "keep", "regions", "tokens", "out_token")

    def __init__(self, id: int, model: str, numpy_out: bool, details: bool, keep: list) -> None:
        self.id = id
        self.model = model
        self.numpy_out = numpy_out
        self.details = details
        self.keep = keep  # input tensors: their memory may be read in place until the reply
        self.regions: list[Region] = []  # leases this request holds
        self.tokens: set = set()  # every buffer token it references
        self.out_token: str | None = None  # the buffer of its out region, if it has one


class Session:
    """State shared by every connection of one client: endpoint, what the daemon offers, the
    shared-memory arena, request ids, and output-size guesses."""

    def __init__(self, endpoint: str, shm: bool | None, copy_outputs: bool) -> None:
        self.endpoint = endpoint
        self.want_shm = shm is not False and endpoint.startswith(("ipc://", "unix://"))
        self.copy_outputs = copy_outputs
        self.offer: dict | None = None
        self.arena: ShmArena | None = None
        self.threshold = 1 << 62
        self.ids = itertools.count(1)
        self.out_guess: dict[str, int] = {}
        self.replies = ReplyCache()
        self._lock = threading.Lock()

    def accept_offer(self, offer: dict) -> None:
        with self._lock:
            if self.offer is not None:
                return
            shm = offer.get("shm") or {}
            use_shm = self.want_shm and shm.get("enabled")
            if use_shm and isinstance(shm.get("channel"), str):
                # Before the offer is taken: no descriptor ever goes to an impostor's socket.
                check_announced_channel(shm["channel"])
            self.offer = offer
            if use_shm:
                self.threshold = int(shm.get("threshold", 64 * 1024))
                self.arena = ShmArena(BufferChannelClient(shm["channel"]))

    def take_offer(self, header: Any) -> None:
        """A hello's answer: its offer taken, or the error it carries raised."""
        if not isinstance(header, dict):
            raise InternalError("malformed reply from the daemon: a hello answered as an inference")
        if not header.get("ok"):
            raise error_from_reply(header)
        self.accept_offer(header)

    def hello_message(self) -> tuple[int, list]:
        request_id = next(self.ids)
        return request_id, [SIGNATURE, protocol.pack({"type": protocol.CLIENT_HELLO, "id": request_id})]

    # -- requests ---------------------------------------------------------------------------

    def build(self, model: str, inputs: Any, timeout: float,
              details: bool = False) -> tuple[list[list], Pending]:
        """The messages to send (just the request) and its pending record."""
        pending = Pending(next(self.ids), model, False, details, [])
        try:
            encoded = encode(inputs, self._placement(pending))
            pending.keep = encoded.leaves  # read in place by the worker until the reply
            pending.numpy_out = all_numpy(encoded.leaves)
            out = self._out_region(model, encoded.descs, pending)
        except BaseException:
            self.release(pending)
            raise
        header = infer_header(pending.id, model, encoded.tree, encoded.descs, int(timeout * 1000),
                              out)
        return [[SIGNATURE, header, *encoded.frames]], pending

    def _placement(self, pending: Pending):
        arena, threshold = self.arena, self.threshold
        if arena is None:
            return inline_only

        def stage(tensor: torch.Tensor, dtype: str, nbytes: int) -> tuple | None:
            """Large inputs go in shared memory: in place if made by empty(), else copied once."""
            if nbytes < threshold or not nbytes:
                return None
            where = tensor.is_contiguous() and tensor.device.type == "cpu" and arena.locate(
                tensor.data_ptr(), nbytes)
            if where:
                pending.tokens.add(where[0].token)
                return where[0].token, where[1], nbytes
            region = self._alloc(nbytes)
            if region is None:
                return None
            pending.regions.append(region)
            pending.tokens.add(region.segment.token)
            copy_into(region.bytes_view(0, nbytes), tensor, dtype, parallel=False)
            return region.segment.token, region.offset, nbytes
        return stage

    def _alloc(self, nbytes: int) -> Region | None:
        """A region, or None when the daemon refuses another buffer now (OVERLOADED: this
        user's share of buffers or the daemon's descriptors is spent): the tensor then travels
        inline, as it would over tcp."""
        try:
            return self.arena.alloc(nbytes)
        except ProtocolError as exc:
            if exc.code != protocol.OVERLOADED:
                raise
            logger.debug("shared memory refused (%s): inline instead", exc.message)
            return None

    def _out_region(self, model: str, descs: list[dict], pending: Pending) -> list | None:
        if self.arena is None:
            return None
        guess = self.out_guess.get(model)
        if guess is None:  # no reply yet: guess the outputs are as large as the inputs
            guess = 0
            for desc in descs:  # a loop, not a generator: compiled, this is a cdef method
                nbytes = _desc_nbytes(desc)
                if nbytes >= self.threshold:
                    guess += _aligned(nbytes)
        if guess < self.threshold:
            return None
        region = self._alloc(guess)
        if region is None:
            return None
        pending.regions.append(region)
        pending.tokens.add(region.segment.token)
        pending.out_token = region.segment.token
        return [region.segment.token, region.offset, region.capacity]

    # -- replies ----------------------------------------------------------------------------

    def split(self, frames: list) -> tuple[Any, Any, list]:
        """One message from the daemon as (its id, what ``read`` takes, its payload frames). A
        success reply is parsed here, or found in ``replies`` when it is one seen before but for
        its id and timing; anything else (a hello's answer, a failure, a malformed success) comes
        as its header map. InternalError when the frames are not a modelwarden reply."""
        raw, payload = reply_parts(frames)
        found = self.replies.parse(raw, payload)
        if found is not None:
            return found[0], found[1], payload
        header = unpack_header(raw, strict=False)
        if header.get("ok") is not True or "outputs" not in header:
            return header.get("id"), header, payload
        try:
            reply = parse_reply(header, payload)
        except protocol.ProtocolError:
            return header.get("id"), header, payload  # read() makes it the request's failure
        self.replies.learn(raw, len(header), reply, len(payload))
        return header.get("id"), reply, payload

    def read(self, header: Any, frames: list) -> InferReply:
        """The typed reply; a malformed one becomes an INTERNAL failure of the request it names."""
        if type(header) is InferReply:  # parsed by split()
            return header
        try:
            return parse_reply(header, frames)
        except protocol.ProtocolError as exc:
            error = ReplyError(exc.code, f"from the daemon: {exc.message}")
            worker = header.get("worker") if isinstance(header, dict) else None
            rid = protocol.request_id_of(header) if isinstance(header, dict) else None
            return InferReply(rid, False, None, [], error, worker if isinstance(worker, str) else None, {})

    def forgotten(self, reply: InferReply, pending: Pending) -> bool:
        """True if the daemon no longer honours this request's buffer tokens (it restarted, so
        the channel died): the buffers are registered again here and the caller resends, once."""
        if reply.ok or reply.error.detail != protocol.BUFFER_NOT_REGISTERED:
            return False
        self.release(pending)
        if self.arena is not None:
            self.arena.renew(pending.tokens)
        return True

    def decode(self, pending: Pending, reply: InferReply, frames: list) -> Any:
        try:
            if not reply.ok:
                error = ERRORS.get(reply.error.code, RemoteError)(
                    reply.error.message, reply.id, reply.worker)
                if isinstance(error, Timeout):
                    self.discard(pending)  # the worker may still touch its buffers
                raise error
            tensors = [self._tensor(desc, frames) for desc in reply.tensors]
            if self.arena is not None:
                self._learn_out_size(pending, reply.tensors)
        finally:
            self.release(pending)
        if pending.numpy_out:
            tensors = [to_numpy(tensor) if isinstance(tensor, torch.Tensor) else tensor
                       for tensor in tensors]
        outputs = unflatten(reply.outputs, tensors)
        if pending.details:
            return Reply(outputs, reply.worker, reply.timing, reply.version)
        return outputs

    def _tensor(self, desc: TensorDesc, frames: list) -> Any:
        """An output: a tensor (over its frame or our shared memory), or for str/bytes its
        elements, copied out (a list nested per shape; a bare str/bytes for 0-d)."""
        if desc.shm is None:
            tensor = self._elements(desc, frames[desc.frame]) if desc.longest is not None \
                else frame_tensor(desc, frames)
            return tensor.clone() if self.copy_outputs and desc.longest is None else tensor
        token, offset, nbytes = desc.shm
        segment = self.arena.segment(token) if self.arena else None
        if segment is None or offset + nbytes > segment.size:
            raise InternalError("the daemon returned a buffer region this client does not own")
        view = segment.array[offset:offset + nbytes]
        if desc.longest is not None:
            return self._elements(desc, view)
        tensor = from_bytes(view, desc.dtype, desc.shape)
        if self.copy_outputs:
            return tensor.clone()
        region = self.arena.region_of(token)
        region.retain()
        weakref.finalize(view, region.release)  # the region is reused once the tensor is freed
        return tensor

    @staticmethod
    def _elements(desc: TensorDesc, buffer: Any) -> Any:
        try:
            return decode_elements(getattr(buffer, "buffer", buffer), desc)
        except ProtocolError as exc:  # the worker sent it: the daemon's bug, not the caller's
            raise InternalError(f"from the daemon: {exc.message}") from None

    def _learn_out_size(self, pending: Pending, descs: list[TensorDesc]) -> None:
        """Next time, reserve room for the large outputs the worker had to write: those that came
        inline or in our out region. One pointing into an input buffer needed no room."""
        total = 0
        for desc in descs:
            if desc.nbytes >= self.threshold and (desc.shm is None
                                                  or desc.shm[0] == pending.out_token):
                total += _aligned(desc.nbytes)
        self.out_guess[pending.model] = total

    def release(self, pending: Pending) -> None:
        regions, pending.regions = pending.regions, []
        for region in regions:
            region.release()

    def discard(self, pending: Pending) -> None:
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
        region = self._alloc(nbytes) if nbytes >= self.threshold else None
        if region is None:
            return torch.empty(shape, dtype=dtype)
        # the tensor holds the one reference
        view = region.bytes_view(0, nbytes)
        weakref.finalize(view, region.release)
        return from_bytes(view, name, shape)

    def close(self) -> None:
        if self.arena is not None:
            self.arena.close()


_ndarray = np.ndarray  # compiled, a module global is a cached lookup; ``np.ndarray`` is not


def all_numpy(leaves: list) -> bool:
    """Every input a numpy array (or str/bytes given as numpy), and at least one: the outputs
    come back as numpy too."""
    if not leaves:
        return False
    for leaf in leaves:
        if not (isinstance(leaf, _ndarray) or (isinstance(leaf, Elements) and leaf.numpy)):
            return False
    return True


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _desc_nbytes(desc: dict) -> int:
    if "nbytes" in desc:  # str/bytes: the payload's size
        return desc["nbytes"]
    return protocol.DTYPES[desc["dtype"]] * math.prod(desc["shape"])
