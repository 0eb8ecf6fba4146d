"""The worker's view of client shared memory: mapped once, checked on every use.

A mapping is kept while the client uses the segment (mapping 64 MiB and faulting its page tables
on every request would cost more than the copy we avoid). Before each use the file's current size
is checked, so a segment truncated *before* a request gets BAD_REQUEST; one truncated *during*
a request raises SIGBUS and kills this worker, which the supervisor handles like any crash.
"""

from __future__ import annotations

import collections

import torch

from modelwarden.shared.codec import from_bytes
from modelwarden.shared.protocol import BAD_REQUEST, ProtocolError, TensorDesc
from modelwarden.shared.shm import Segment, attach_segment

MAX_MAPPINGS = 256


class SegmentMaps:
    def __init__(self, limit: int = MAX_MAPPINGS) -> None:
        self._maps: collections.OrderedDict[str, Segment] = collections.OrderedDict()
        self._limit = limit

    def get(self, name: str) -> Segment:
        segment = self._maps.get(name)
        if segment is not None:
            self._maps.move_to_end(name)
            return segment
        try:
            segment = attach_segment(name)
        except OSError:
            raise ProtocolError(BAD_REQUEST, "shared-memory segment cannot be opened") from None
        self._maps[name] = segment
        while len(self._maps) > self._limit:
            self._maps.popitem(last=False)[1].close()
        return segment

    def region(self, name: str, offset: int, nbytes: int, what: str) -> tuple[Segment, object]:
        """The segment and a uint8 view of [offset, offset+nbytes), after a size check."""
        segment = self.get(name)
        if offset + nbytes > segment.size or offset + nbytes > segment.current_size():
            raise ProtocolError(BAD_REQUEST, f"{what}: region lies past the end of its segment")
        return segment, segment.array[offset:offset + nbytes]

    def tensor(self, desc: TensorDesc, what: str) -> tuple[Segment, torch.Tensor]:
        name, offset, nbytes = desc.shm
        segment, view = self.region(name, offset, nbytes, what)
        return segment, from_bytes(view, desc.dtype, desc.shape)

    def forget(self, names: list[str]) -> None:
        for name in names:
            segment = self._maps.pop(name, None)
            if segment is not None:
                segment.close()

    def __len__(self) -> int:
        return len(self._maps)
