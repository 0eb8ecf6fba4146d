"""Shared-memory buffers: anonymous, sealed, passed as file descriptors, never named.

A buffer is a memfd (``memfd_create``): it lives in no directory, so nobody can list, open, squat
or unlink it; a process reaches it only by being handed its descriptor. It is sealed against
shrinking and growing once sized, so a mapping of it can never fault past the end (no SIGBUS from
a client truncating it under a worker) and its size is checked once, at registration. Its memory
lives until the last process holding a descriptor or a mapping of it lets go: a client that dies
takes nothing with it that its kernel does not free.

The client registers each buffer on the daemon's buffer channel (``shared/fdchannel.py``) right
after creating it, and names it in requests by the token it got back.

This module needs no torch: the worker imports it before torch.
"""

from __future__ import annotations

import collections
import ctypes
import fcntl
import mmap
import os
import stat
import threading
import weakref
from dataclasses import dataclass, field

import numpy as np

from modelwarden.shared.fdchannel import BufferChannelClient, ChannelClosed

ALIGN = 64  # cache-line alignment for every region we hand out
MIN_SEGMENT = 64 * 1024
MEMFD_NAME = "modelwarden"  # shows as "memfd:modelwarden" in /proc/<pid>/fd: for leak checks
REQUIRED_SEALS = fcntl.F_SEAL_SHRINK

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


def map_shared(fd: int, size: int, populate: bool = False) -> ctypes.Array:
    """``size`` bytes of ``fd`` mapped MAP_SHARED, as a ctypes array that unmaps them when the last
    reference to it (numpy views and tensors over it included) is gone. Unlike ``mmap.mmap``
    this keeps no duplicate of the descriptor: a mapping costs no descriptor, and a closed
    descriptor really is closed."""
    flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
    address = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, 0)
    if address in (None, _MAP_FAILED):
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error))
    memory = (ctypes.c_uint8 * size).from_address(address)
    weakref.finalize(memory, _libc.munmap, address, size)
    return memory


@dataclass(eq=False)
class Segment:
    """One mapped buffer. ``array`` is a uint8 view of the whole mapping; ``token`` is what the
    daemon calls it (None until registered, and on the worker's side of a closed descriptor)."""

    size: int
    fd: int
    memory: ctypes.Array
    token: str | None = None
    array: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.array = np.frombuffer(self.memory, dtype=np.uint8, count=self.size)

    @property
    def address(self) -> int:
        return self.array.ctypes.data

    def close(self) -> None:
        """Drop our descriptor; the mapping goes when the last tensor over it is freed."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def create_segment(size: int) -> Segment:
    """A new, sealed, pre-faulted buffer of at least ``size`` bytes."""
    size = max(MIN_SEGMENT, -(-size // mmap.PAGESIZE) * mmap.PAGESIZE)
    fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        # Page faults on a fresh mapping cost more than the copy we save; pay them once here.
        memory = map_shared(fd, size, populate=True)
    except BaseException:
        os.close(fd)
        raise
    return Segment(size, fd, memory)


def sealed_size(fd: int) -> int | None:
    """The size of ``fd`` if it is a buffer we accept -- a regular file of size > 0 sealed
    against shrinking (so only a memfd) -- else None. Never maps it."""
    try:
        info = os.fstat(fd)
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:  # EINVAL: a file that does not support seals
        return None
    if not stat.S_ISREG(info.st_mode) or info.st_size <= 0 or not seals & REQUIRED_SEALS:
        return None
    return info.st_size


def attach_segment(fd: int, size: int, token: str) -> Segment:
    """Map a buffer handed to us and close the descriptor: the mapping keeps the memory alive,
    and a worker holding mappings rather than descriptors cannot run out of descriptors."""
    try:
        memory = map_shared(fd, size)
    finally:
        os.close(fd)
    return Segment(size, -1, memory, token)


class Region:
    """A leased piece of a client segment. Tensors over it hold a reference count; when the
    last one is freed the region goes back to its arena for reuse."""

    __slots__ = ("segment", "offset", "capacity", "_refs", "_arena", "leased")

    def __init__(self, segment: Segment, offset: int, capacity: int, arena: "ShmArena") -> None:
        self.segment = segment
        self.offset = offset
        self.capacity = capacity
        self._refs = 0
        self._arena = arena
        self.leased = True  # since the last trim: a buffer in use is never trimmed

    def retain(self) -> "Region":
        with self._arena._lock:
            self._refs += 1
        return self

    def release(self) -> None:
        # May run inside the garbage collector, in any thread: only an atomic append here; the
        # count drops under the arena's lock on its next alloc. A closed arena keeps nothing.
        if not self._arena.closed:
            self._arena._returned.append(self)

    def bytes_view(self, offset: int, nbytes: int) -> np.ndarray:
        start = self.offset + offset
        return self.segment.array[start:start + nbytes]


class ShmArena:
    """A client's pool of buffers, one region each, reused by power-of-two size class.

    Allocation is rare after warm-up: a steady workload cycles the same few buffers, whose
    pages are already faulted in. Releases may come from any thread (and from the garbage
    collector), so they go through a deque and are folded in under the lock on the next alloc.
    Each new buffer is registered on ``channel`` at once; ``renew`` registers them all again.
    """

    def __init__(self, channel: BufferChannelClient | None = None) -> None:
        self.channel = channel
        self._lock = threading.Lock()
        self._free: dict[int, list[Region]] = collections.defaultdict(list)
        self._returned: collections.deque[Region] = collections.deque()
        self._segments: dict[int, Segment] = {}  # by id(): tokens change when renewed
        self._by_token: dict[str, Segment] = {}
        self._regions: dict[int, Region] = {}
        self._by_address: list[tuple[int, int, Segment]] = []
        self.closed = False

    @staticmethod
    def size_class(nbytes: int) -> int:
        return max(MIN_SEGMENT, 1 << max(0, (nbytes - 1).bit_length()))

    def alloc(self, nbytes: int) -> Region:
        """A region of at least ``nbytes``, with one reference held by the caller."""
        size = self.size_class(nbytes)
        with self._lock:
            self._fold_returns()
            free = self._free[size]
            if free:
                region = free.pop()
                region._refs = 1
                region.leased = True
                return region
        # A new buffer is made outside the lock: pre-faulting a large one takes milliseconds, and
        # 64 threads each wanting one would otherwise queue behind each other (W3 of issue 9).
        segment = create_segment(size)
        with self._lock:
            try:
                if self.closed:
                    raise RuntimeError("the client is closed")
                region = self._new_region(segment)
            except BaseException:
                segment.close()
                raise
            region._refs = 1
            return region

    def _new_region(self, segment: Segment) -> Region:
        self._register([segment])
        self._segments[id(segment)] = segment
        # Replaced, not mutated: locate() reads it without the lock.
        self._by_address = sorted(
            [*self._by_address, (segment.address, segment.address + segment.size, segment)],
            key=lambda item: item[0])
        region = Region(segment, 0, segment.size, self)
        self._regions[id(segment)] = region
        return region

    def _register(self, segments: list[Segment]) -> None:
        if self.channel is None:
            return
        fds = [segment.fd for segment in segments]
        with self.channel.lock:
            if not self.channel.connected and self._segments:
                self._renew_locked()  # the channel broke: every older buffer needs a new token
            try:
                tokens = self.channel.register(fds)
            except ChannelClosed:  # the daemon restarted since our last registration
                self._renew_locked()
                tokens = self.channel.register(fds)
        for segment, token in zip(segments, tokens):
            segment.token = token
            self._by_token[token] = segment

    def renew(self, stale: set[str]) -> None:
        """The daemon no longer knows some of our tokens (it restarted, so the channel died):
        reconnect and register every live buffer again -- unless another thread already did."""
        with self._lock:
            if self.channel is None or not stale & self._by_token.keys():
                return
            with self.channel.lock:
                self._renew_locked()

    def _renew_locked(self) -> None:
        self.channel.connect()
        live = list(self._segments.values())
        tokens = self.channel.register([segment.fd for segment in live]) if live else []
        self._by_token = {}
        for segment, token in zip(live, tokens):
            segment.token = token
            self._by_token[token] = segment

    def _fold_returns(self) -> None:
        while self._returned:
            region = self._returned.popleft()
            region._refs -= 1
            if region._refs == 0 and id(region.segment) in self._segments:
                self._free[region.capacity].append(region)

    def locate(self, address: int, nbytes: int) -> tuple[Segment, int] | None:
        """The buffer and offset holding [address, address+nbytes), if it is ours."""
        for start, end, segment in self._by_address:
            if start <= address and address + nbytes <= end:
                return segment, address - start
        return None

    def segment(self, token: str) -> Segment | None:
        return self._by_token.get(token)

    def region_of(self, token: str) -> Region | None:
        segment = self._by_token.get(token)
        return self._regions.get(id(segment)) if segment is not None else None

    def discard(self, region: Region) -> None:
        """Take a region out of circulation for good (a worker may still write into it): its
        token is revoked and our descriptor closed; the memory lives on until every mapping of
        it is gone."""
        with self._lock:
            segment = region.segment
            if self._segments.pop(id(segment), None) is None:
                return
            self._regions.pop(id(segment), None)
            self._by_address = [item for item in self._by_address if item[2] is not segment]
            if segment.token is not None:
                self._by_token.pop(segment.token, None)
                if self.channel is not None:
                    self.channel.unregister([segment.token])
            segment.close()

    def trim(self, keep_bytes: int) -> int:
        """Drop free buffers that were not leased since the previous trim, beyond ``keep_bytes``
        of free buffers kept (the smallest first): their tokens are revoked and their
        descriptors closed, so their memory goes back to the host once the daemon's workers let
        go too. A long-lived client calls this now and then (the gateway every few seconds):
        after a burst of large requests it returns to its working set instead of keeping the
        burst's peak for ever. A buffer in use, or reused since the last call, is never
        dropped. Returns the bytes dropped."""
        with self._lock:
            self._fold_returns()
            kept, cold = 0, []
            for size in sorted(self._free):
                for region in self._free[size]:
                    if region.leased or kept + size <= keep_bytes:
                        kept += size
                        region.leased = False
                    else:
                        cold.append(region)
            for region in cold:
                self._free[region.capacity].remove(region)
                self._drop(region.segment)
            if cold and self.channel is not None:
                self.channel.unregister([r.segment.token for r in cold if r.segment.token])
            for region in cold:
                region.segment.close()
        return sum(region.capacity for region in cold)

    def _drop(self, segment: Segment) -> None:
        """Forget a buffer (under the lock); the caller revokes its token and closes it."""
        self._segments.pop(id(segment), None)
        self._regions.pop(id(segment), None)
        self._by_address = [item for item in self._by_address if item[2] is not segment]
        if segment.token is not None:
            self._by_token.pop(segment.token, None)

    def tokens(self) -> list[str]:
        return list(self._by_token)

    def close(self) -> None:
        """Close the channel (the daemon revokes every token) and our descriptors; live tensors
        keep their mappings until they are freed."""
        with self._lock:
            self.closed = True
            if self.channel is not None:
                self.channel.close()
            for segment in self._segments.values():
                segment.close()
            self._segments.clear()
            self._by_token.clear()
            self._regions.clear()
            self._by_address = []
            self._free.clear()
            self._returned.clear()  # its regions would keep their mappings alive
