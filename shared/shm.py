"""POSIX shared-memory segments: naming, creation, attachment, ownership and clean-up.

We do not use ``multiprocessing.shared_memory``: on Python 3.11 its resource tracker unlinks a
segment when *any* process that merely attached to it exits (CPython gh-82300), which would let a
worker destroy a client's buffer. Here only the creator unlinks, or the daemon's sweeper once the
creator is gone. A segment's name carries its creator's pid and start time
(``mw.<pid>.<start>.<128 random bits>``) so the sweeper can tell a live owner from a dead one
without any registry that could itself leak.

This module needs no torch: the daemon imports it to sweep.
"""

from __future__ import annotations

import collections
import errno
import grp
import mmap
import os
import secrets
import stat
import threading
from dataclasses import dataclass, field

import numpy as np

from modelwarden.shared.protocol import SEGMENT_NAME_RE, SEGMENT_PREFIX

SHM_DIR = "/dev/shm"
ALIGN = 64  # cache-line alignment for every region we hand out
MIN_SEGMENT = 64 * 1024


def process_start_ticks(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat: when the process started, in clock ticks since boot."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            data = handle.read()
    except OSError:
        return None
    # comm (field 2) may hold spaces and parentheses: fields resume after the last ')'.
    fields = data[data.rfind(b")") + 2:].split()
    return int(fields[19]) if len(fields) > 19 else None


_SELF: dict[str, tuple[int, int]] = {}


def _self_identity() -> tuple[int, int]:
    pid = os.getpid()
    cached = _SELF.get("id")
    if cached is None or cached[0] != pid:
        cached = (pid, process_start_ticks(pid) or 0)
        _SELF["id"] = cached
    return cached


def new_segment_name() -> str:
    pid, start = _self_identity()
    return f"{SEGMENT_PREFIX}{pid}.{start}.{secrets.token_hex(16)}"


def owner_alive(name: str) -> bool:
    match = SEGMENT_NAME_RE.match(name)
    if match is None:
        return False
    return process_start_ticks(int(match.group(1))) == int(match.group(2))


def list_segments() -> list[str]:
    """Names of every modelwarden segment in /dev/shm, live or not."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return []
    return sorted(name for name in names if SEGMENT_NAME_RE.match(name))


def unlink(name: str) -> bool:
    try:
        os.unlink(os.path.join(SHM_DIR, name))
        return True
    except FileNotFoundError:
        return False


def sweep_orphans() -> list[str]:
    """Unlink segments whose creator is gone; returns their names. EPERM (another user's
    segment, daemon not root) is left alone: only its owner or root can remove it."""
    removed = []
    for name in list_segments():
        if owner_alive(name):
            continue
        try:
            if unlink(name):
                removed.append(name)
        except PermissionError:
            pass
    return removed


def segment_size(name: str) -> int | None:
    """Size of a segment if it is a regular file we could map; None otherwise. Never maps."""
    try:
        info = os.stat(os.path.join(SHM_DIR, name), follow_symlinks=False)
    except OSError:
        return None
    return info.st_size if stat.S_ISREG(info.st_mode) else None


@dataclass(eq=False)
class Segment:
    """One mapped segment. ``array`` is a uint8 view of the whole mapping."""

    name: str
    size: int
    fd: int
    mm: mmap.mmap
    array: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.array = np.frombuffer(self.mm, dtype=np.uint8, count=self.size)

    @property
    def address(self) -> int:
        return self.array.ctypes.data

    def current_size(self) -> int:
        """The file's size now: a client may have truncated it since we mapped it."""
        return os.fstat(self.fd).st_size

    def close(self) -> None:
        """Drop our references; the mapping goes when the last tensor over it is freed."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def create_segment(size: int, group: str | None = None) -> Segment:
    """A new, pre-faulted segment of at least ``size`` bytes, mode 0600 (0660 with a group)."""
    size = max(MIN_SEGMENT, -(-size // mmap.PAGESIZE) * mmap.PAGESIZE)
    name = new_segment_name()
    path = os.path.join(SHM_DIR, name)
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(path, flags, 0o600)
    try:
        if group is not None:
            os.fchown(fd, -1, grp.getgrnam(group).gr_gid)
            os.fchmod(fd, 0o660)
        os.ftruncate(fd, size)
        # Page faults on a fresh mapping cost more than the copy we save; pay them once here.
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    return Segment(name, size, fd, mm)


def attach_segment(name: str) -> Segment:
    """Map a client's segment read-write. Raises OSError if it is missing or not a file."""
    if not SEGMENT_NAME_RE.match(name):
        raise FileNotFoundError(errno.ENOENT, "not a modelwarden segment")
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size == 0:
            raise FileNotFoundError(errno.ENOENT, "not a mappable segment")
        mm = mmap.mmap(fd, info.st_size, flags=mmap.MAP_SHARED)
    except BaseException:
        os.close(fd)
        raise
    return Segment(name, info.st_size, fd, mm)


class Region:
    """A leased piece of a client segment. Tensors over it hold a reference count; when the
    last one is freed the region goes back to its arena for reuse."""

    __slots__ = ("segment", "offset", "capacity", "_refs", "_arena")

    def __init__(self, segment: Segment, offset: int, capacity: int, arena: "ShmArena") -> None:
        self.segment = segment
        self.offset = offset
        self.capacity = capacity
        self._refs = 0
        self._arena = arena

    def retain(self) -> "Region":
        with self._arena._lock:
            self._refs += 1
        return self

    def release(self) -> None:
        # May run inside the garbage collector, in any thread: only an atomic append here; the
        # count drops under the arena's lock on its next alloc.
        self._arena._returned.append(self)

    def bytes_view(self, offset: int, nbytes: int) -> np.ndarray:
        start = self.offset + offset
        return self.segment.array[start:start + nbytes]


class ShmArena:
    """A client's pool of segments, one region each, reused by power-of-two size class.

    Allocation is rare after warm-up: a steady workload cycles the same few segments, whose
    pages are already faulted in. Releases may come from any thread (and from the garbage
    collector), so they go through a deque and are folded in under the lock on the next alloc.
    """

    def __init__(self, group: str | None = None) -> None:
        self.group = group
        self._lock = threading.Lock()
        self._free: dict[int, list[Region]] = collections.defaultdict(list)
        self._returned: collections.deque[Region] = collections.deque()
        self._segments: dict[str, Segment] = {}
        self._regions: dict[str, Region] = {}
        self._by_address: list[tuple[int, int, Segment]] = []

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
            else:
                segment = create_segment(size, self.group)
                self._segments[segment.name] = segment
                # Replaced, not mutated: locate() reads it without the lock.
                self._by_address = sorted(
                    [*self._by_address, (segment.address, segment.address + segment.size, segment)],
                    key=lambda item: item[0])
                region = Region(segment, 0, segment.size, self)
                self._regions[segment.name] = region
            region._refs = 1
            return region

    def _fold_returns(self) -> None:
        while self._returned:
            region = self._returned.popleft()
            region._refs -= 1
            if region._refs == 0 and region.segment.name in self._segments:
                self._free[region.capacity].append(region)

    def locate(self, address: int, nbytes: int) -> tuple[Segment, int] | None:
        """The segment and offset holding [address, address+nbytes), if it is ours."""
        for start, end, segment in self._by_address:
            if start <= address and address + nbytes <= end:
                return segment, address - start
        return None

    def segment(self, name: str) -> Segment | None:
        return self._segments.get(name)

    def region_of(self, name: str) -> Region | None:
        return self._regions.get(name)

    def discard(self, region: Region) -> None:
        """Take a region out of circulation for good (a worker may still write into it): its
        segment is unlinked; the memory lives on until every mapping of it is gone."""
        with self._lock:
            name = region.segment.name
            if self._segments.pop(name, None) is None:
                return
            self._regions.pop(name, None)
            self._by_address = [item for item in self._by_address if item[2] is not region.segment]
            unlink(name)
            region.segment.close()

    def names(self) -> list[str]:
        return list(self._segments)

    def close(self) -> None:
        """Unlink every segment; live tensors keep their mappings until they are freed."""
        with self._lock:
            for segment in self._segments.values():
                unlink(segment.name)
                segment.close()
            self._segments.clear()
            self._regions.clear()
            self._by_address = []
            self._free.clear()
