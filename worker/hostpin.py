"""Page-lock client buffers for a CUDA worker, so shared-memory inputs reach the device by DMA.

A tensor in pageable host memory is copied to the GPU through a staging buffer the driver pins
for the copy (two copies, and ``non_blocking`` does not overlap anything). A CUDA worker
therefore registers each client buffer with the driver once, when it maps it
(``cudaHostRegister``): the buffer *is* pinned host memory, torch sees ``is_pinned()`` and the
``non_blocking`` copy on the worker's stream is a single DMA. Buffers are reused by their client
(its arena), so the registration (~1 ms for 4 MiB) is paid once per buffer, not per request, and
is undone when the supervisor says the buffer was revoked (``forget``), before the mapping can go.

A registration the driver refuses (a locked-memory limit, an old driver) is logged once and the
buffer stays pageable: slower, still correct.
"""

from __future__ import annotations

import logging

from modelwarden.shared.shm import Segment

logger = logging.getLogger(__name__)


class HostPinner:
    """``pin``/``unpin`` a mapped buffer through the CUDA runtime torch is linked against."""

    def __init__(self, cudart) -> None:
        self.cudart = cudart
        self.pinned: set[int] = set()
        self._warned = False

    @classmethod
    def for_device(cls, device) -> "HostPinner | None":
        if device.type != "cuda":
            return None
        import torch

        return cls(torch.cuda.cudart())

    def pin(self, segment: Segment) -> bool:
        error = self.cudart.cudaHostRegister(segment.address, segment.size, 0)
        if error != self.cudart.cudaError.success:
            if not self._warned:
                logger.warning("cudaHostRegister refused a %d-byte client buffer (%s): shared-memory "
                               "inputs are copied from pageable memory", segment.size, error)
                self._warned = True
            return False
        self.pinned.add(segment.address)
        return True

    def unpin(self, segment: Segment) -> None:
        if segment.address in self.pinned:
            self.pinned.discard(segment.address)
            self.cudart.cudaHostUnregister(segment.address)
