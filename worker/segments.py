"""The worker's view of client buffers: handed over as descriptors, mapped once, kept until told.

The supervisor passes each buffer's descriptor on this worker's private SEQPACKET socket pair
(``{"type": "buffers", "tokens": [...], "sizes": [...]}`` + the fds, one token per fd) *before*
the run message that uses it, so a token this worker has not seen yet is already waiting in the
pair's queue: a miss drains the queue and looks again. Each descriptor is mapped and closed at
once (the mapping keeps the memory). Buffers are sealed memfds: they cannot shrink, so a mapping
never faults past its end and needs no size check per use. A mapping is dropped when the
supervisor says the token was revoked (``forget``); the memory goes when the last tensor over
it is freed. The mappings held at once are bounded by ``budget`` (the daemon's
``max_buffer_bytes``): a buffer past it is not mapped, and a request naming it is answered
BUFFER_NOT_REGISTERED. A worker reads only the region a request names, so a sparse buffer
commits no more than that. On a CUDA worker each mapping is also page-locked while it is held
(worker/hostpin.py), so inputs in it reach the device by DMA. A buffer that cannot be mapped is
dropped (a request naming it gets BAD_REQUEST) and logged at ERROR at most once a minute, with
the number of failures since the last line.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import time
from typing import Callable

import torch

from modelwarden.shared import fdchannel
from modelwarden.shared.codec import from_bytes
from modelwarden.shared.lograte import LineBudget
from modelwarden.shared.protocol import (BAD_REQUEST, BUFFER_NOT_REGISTERED, ProtocolError,
                                         TensorDesc)
from modelwarden.shared.shm import Segment, attach_segment

logger = logging.getLogger(__name__)
MAP_FAILURE_LOG_INTERVAL = 60.0  # seconds between two ERRORs for buffers that cannot be mapped


class SegmentMaps:
    def __init__(self, pair: socket.socket | None, pinner=None,
                 clock: Callable[[], float] = time.monotonic, budget: int | None = None) -> None:
        self.pair = pair
        self.pinner = pinner  # a HostPinner on a CUDA worker, else None
        self._maps: dict[str, Segment] = {}
        # Address space for client buffers: the supervisor registers at most max_buffer_bytes in
        # all, and this worker maps only registered buffers, so a mapping past it means the two
        # disagree -- refused here rather than letting one client's buffers exhaust the space
        # every other client's requests need.
        self.budget = budget
        self.mapped = 0
        # A client decides what it passes: one that passes buffers we cannot map gets one line
        # a minute, not one per buffer.
        self._map_failures = LineBudget(MAP_FAILURE_LOG_INTERVAL)
        self._clock = clock
        if pair is not None:
            pair.setblocking(False)

    def get(self, token: str) -> Segment:
        segment = self._maps.get(token)
        if segment is None:
            self.drain()
            segment = self._maps.get(token)
            if segment is None:
                raise ProtocolError(BAD_REQUEST, "buffer was not passed to this worker",
                                    BUFFER_NOT_REGISTERED)
        return segment

    def drain(self) -> None:
        """Take every message waiting on the pair."""
        while self.pair is not None:
            try:
                message, fds = fdchannel.receive_message(self.pair)
            except BlockingIOError:
                return
            except ProtocolError as exc:  # a message cut short: its descriptors are closed
                logger.error("buffer pair: %s", exc.message)
                continue
            except OSError:  # the supervisor closed its end: it is gone, and so will we be
                self.pair.close()
                self.pair = None
                return
            self._take(message, fds)

    def _take(self, message: dict | None, fds: list[int]) -> None:
        tokens = (message or {}).get("tokens") or []
        sizes = (message or {}).get("sizes") or []
        if (message or {}).get("type") != fdchannel.HAND_OVER or not len(tokens) == len(sizes) == len(fds):
            logger.error("buffer pair: dropping a malformed message")
            fdchannel.close_all(fds)
            return
        for token, size, fd in zip(tokens, sizes, fds):
            if token in self._maps:  # passed once already: it is mapped
                os.close(fd)
                continue
            if (not isinstance(size, int) or size <= 0
                    or (self.budget is not None and self.mapped + size > self.budget)):
                os.close(fd)
                self._report_map_failure(OSError(errno.ENOMEM, f"{size} more bytes would pass "
                                                 f"the worker's budget of {self.budget}"))
                continue
            try:
                segment = self._maps[token] = attach_segment(fd, size, token)
            except OSError as exc:
                self._report_map_failure(exc)
                continue
            self.mapped += size
            if self.pinner is not None:
                self.pinner.pin(segment)

    def _report_map_failure(self, exc: OSError) -> None:
        failures = self._map_failures.due("map", self._clock())
        if failures:
            logger.error("buffer pair: cannot map a buffer: %s (%d failure(s) since the last "
                         "report; at most one a minute)", exc, failures)

    def region(self, token: str, offset: int, nbytes: int) -> tuple[Segment, object]:
        """The buffer and a uint8 view of [offset, offset+nbytes) (the supervisor checked it)."""
        segment = self.get(token)
        return segment, segment.array[offset:offset + nbytes]

    def tensor(self, desc: TensorDesc) -> tuple[Segment, torch.Tensor]:
        token, offset, nbytes = desc.shm
        segment, view = self.region(token, offset, nbytes)
        return segment, from_bytes(view, desc.dtype, desc.shape)

    def forget(self, tokens: list) -> None:
        self.drain()  # a token's descriptor may still be queued: take it, then drop it
        for token in tokens:
            segment = self._maps.pop(token, None) if isinstance(token, str) else None
            if segment is not None:
                self.mapped -= segment.size
            if segment is not None and self.pinner is not None:
                self.pinner.unpin(segment)

    def __len__(self) -> int:
        return len(self._maps)
