"""One client's request building and reply decoding, shared by all its connections.

Flattens inputs into descriptors, decides inline or shared memory per tensor, keeps the leases a
request holds, and turns replies back into tensors (over reply frames, or over the client's own
shared memory). No sockets here: Client, its I/O thread and AsyncClient own those.
"""

from __future__ import annotations

import itertools
import math
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from modelwarden.shared import protocol
from modelwarden.shared.codec import (as_tensor, dtype_name, flatten, from_bytes, raw_bytes, to_numpy,
                                      unflatten)
from modelwarden.shared.errors import InternalError, Timeout, error_from_reply
from modelwarden.shared.fdchannel import BufferChannel
from modelwarden.shared.protocol import SIGNATURE
from modelwarden.shared.shm import ALIGN, Region, ShmArena


@dataclass
class Reply:
    """What ``infer(..., details=True)`` returns: outputs plus where and how long."""

    outputs: Any
    worker: str | None
    timing: dict


@dataclass(eq=False)
class Pending:
    id: int
    model: str
    numpy_out: bool
    details: bool
    keep: list  # input tensors: their memory may be read in place until the reply
    regions: list[Region] = field(default_factory=list)  # leases this request holds
    tokens: set = field(default_factory=set)  # every buffer token it references


class Session:
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
                self.arena = ShmArena(BufferChannel(shm["channel"]))

    def hello_message(self) -> tuple[int, list]:
        request_id = next(self.ids)
        return request_id, [SIGNATURE, protocol.pack({"type": "hello", "id": request_id})]

    # -- requests ---------------------------------------------------------------------------

    def build(self, model: str, inputs: Any, timeout: float,
              details: bool = False) -> tuple[list[list], Pending]:
        """The messages to send (just the request) and its pending record."""
        leaves: list = []
        tree = flatten(inputs, leaves)
        numpy_out = bool(leaves) and all(isinstance(leaf, np.ndarray) for leaf in leaves)
        tensors = [as_tensor(leaf) for leaf in leaves]
        pending = Pending(next(self.ids), model, numpy_out, details, keep=list(tensors))
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
        return [[SIGNATURE, protocol.pack(header), *frames]], pending

    def _describe(self, tensor: torch.Tensor, frames: list, pending: Pending) -> dict:
        dtype = dtype_name(tensor.dtype)
        desc = {"dtype": dtype, "shape": list(tensor.shape)}
        nbytes = tensor.numel() * tensor.element_size()
        arena = self.arena
        if arena is not None and nbytes >= self.threshold and nbytes:
            where = tensor.is_contiguous() and tensor.device.type == "cpu" and arena.locate(
                tensor.data_ptr(), nbytes)
            if where:  # made by empty(): zero copies
                desc["shm"] = [where[0].token, where[1], nbytes]
                pending.tokens.add(where[0].token)
                return desc
            region = arena.alloc(nbytes)
            pending.regions.append(region)
            pending.tokens.add(region.segment.token)
            staging = from_bytes(region.bytes_view(0, nbytes), dtype, tuple(tensor.shape))
            staging.copy_(tensor)
            desc["shm"] = [region.segment.token, region.offset, nbytes]
            return desc
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            tensor = tensor.detach().to("cpu").contiguous()
            pending.keep.append(tensor)
        desc["frame"] = len(frames)
        frames.append(raw_bytes(tensor))
        return desc

    def _out_region(self, model: str, tensors: list, pending: Pending) -> list | None:
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
        pending.tokens.add(region.segment.token)
        return [region.segment.token, region.offset, region.capacity]

    # -- replies ----------------------------------------------------------------------------

    def forgotten(self, header: dict, pending: Pending) -> bool:
        """True if the daemon no longer honours this request's buffer tokens (it restarted, so
        the channel died): the buffers are registered again here and the caller resends, once."""
        error = header.get("error") or {}
        if header.get("ok") or error.get("detail") != protocol.BUFFER_NOT_REGISTERED:
            return False
        self.release(pending)
        if self.arena is not None:
            self.arena.renew(pending.tokens)
        return True

    def decode(self, pending: Pending, header: dict, frames: list) -> Any:
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
        token, offset, nbytes = desc["shm"]
        segment = self.arena.segment(token) if self.arena else None
        if segment is None:
            raise InternalError("the daemon returned a buffer this client does not own")
        view = segment.array[offset:offset + nbytes]
        tensor = from_bytes(view, dtype, shape)
        if self.copy_outputs:
            return tensor.clone()
        region = self.arena.region_of(token)
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
