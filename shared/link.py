"""The worker link: the private channel between the supervisor and one worker process.

An ``AF_UNIX`` ``SOCK_STREAM`` socket pair, made by the supervisor when it spawns the worker; the
child's end travels in the spawn's ``Process`` arguments (multiprocessing duplicates it into the
child and nowhere else), so there is no address to connect to and nobody else can reach it. It
carries the messages of docs/PROTOCOL.md, Appendix A, both ways: a message is a list of parts
(a header, then payload), framed on the stream as

    u32 count | count x u64 length | the parts' bytes, one after another     (little-endian)

Why not ZeroMQ, as on the frontends: a ZeroMQ message crosses libzmq's I/O thread on each side,
so a request's two hops between the supervisor and a worker woke six threads (on each hop the
sender's I/O thread, the receiver's I/O thread and its loop) where this link wakes one: the
reader. A link has one peer and needs no routing, no reconnection and no identity on the wire.

Writing never blocks the supervisor: what the socket does not take now waits in the link's own
queue, whole messages in order, and ``on_pending`` tells the loop to watch the socket for
writing until ``flush`` has written it all. A worker writes ``blocking``: it has nothing else
to do, and waits in poll(2) until the supervisor reads. A peer that is gone (EPIPE, ECONNRESET)
makes the link ``broken``: what it would have written is dropped, and the worker's sentinel
tells the supervisor the rest.

Reading takes what the socket holds (one recv into a buffer, more while the reads fill it), up
to ``read_per_call`` bytes, and answers every message complete by then. The bound is the
loop's: a worker's large result streams in while it is read, and unbounded its reader (the
supervisor's one loop) would copy all of it before serving anyone else; bounded, what is left
waits in the socket, which poll(2) reports again in the next round. A message of SMALL_BELOW bytes or more is read straight
into a bytearray per part, which grows with what arrives (a declared length costs the link only
what the peer sent). Parts below COPY_BELOW come out as ``bytes`` (the supervisor reads headers
from them) or, with ``writable``, as writable memoryviews (a worker's model may write into its
inputs); a larger part is a memoryview of its own bytearray (no copy: the supervisor sends it on
as it is). Every part the link allocates is aligned as malloc aligns (a small message's parts
at ALIGN offsets of one buffer). A frame that does not parse (a count of 0 or past MAX_PARTS,
lengths past ``max_bytes``) is a broken peer: the link says so in ``error`` and reads nothing
more.

Compiled (link.pxd), a message of fewer than FAST_PARTS parts is written with one sendmsg(2)
from the parts' own buffers, and the buffer is read with recv(2) and split in C; uncompiled,
the same steps go through the socket module.
"""

from __future__ import annotations

import errno
import select
import socket
import struct
from collections import deque

try:
    import cython  # compiled: Cython's own; uncompiled: its shadow module, when installed
except ImportError:
    cython = None  # uncompiled without Cython: only the compiled branches use it

# Compiled, this module is an extension (its __file__ a .so): link.pxd declares the C calls of
# the branches below that only then run.
COMPILED = not __file__.endswith(".py")

COPY_BELOW = 65536  # a part this small is copied out of the read buffer (bytes are cheaper)
BUFFER_BYTES = 256 * 1024  # the read buffer
SMALL_BELOW = COPY_BELOW  # a message this small is split out of the read buffer
ALIGN = 64  # where a small message's part starts in the buffer it is copied to (a cache line)
GROW_FROM = 1 << 20  # a large message's part is first given this much room (or its length)
SEND_BUFFER = 4 << 20  # SO_SNDBUF asked of each end: fewer rounds for a large message
MAX_PARTS = 1 << 20  # a batch of 256 requests of 1024 tensors each has 262,400
MAX_BYTES = 1 << 40  # a message's parts in all: a sanity bound on a length no memory can hold
READ_PER_CALL = 4 << 20  # bytes one ``receive`` reads from the socket, at most (one memcpy of ~1 ms)
IOV_MAX = 1024  # iovecs per sendmsg (Linux's UIO_MAXIOV)
FAST_PARTS = 64  # compiled: a message of fewer parts is written and split in C
# The C copies the compiled code reads (link.pxd): the names above stay the module's own.
_COPY_BELOW, _SMALL_BELOW, _FAST_PARTS = COPY_BELOW, SMALL_BELOW, FAST_PARTS
_ALIGN = ALIGN
_COUNT = struct.Struct("<I")
_LENGTH = 8
_GONE = (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN)
_EAGAIN = errno.EAGAIN
_EINTR = errno.EINTR


class LinkError(ConnectionError):
    """The peer wrote something that is not a link frame: it is broken (replace it)."""


def frame_prefix(parts) -> bytes:
    """``u32 count | count x u64 length`` of a message of ``parts`` (each a bytes-like object)."""
    count = len(parts)
    return struct.pack(f"<I{count}Q", count, *[memoryview(part).nbytes for part in parts])


def aligned_offsets(lengths) -> tuple[list, int]:
    """Where each part starts in a buffer that puts every part at an ALIGN offset, and the
    buffer's size."""
    offsets, size = [], 0
    for length in lengths:
        offsets.append(size)
        size += (length + ALIGN - 1) // ALIGN * ALIGN
    return offsets, size


class Link:
    """One end of a worker link over the connected stream socket ``sock`` (a ``socket.socket``,
    made non-blocking here). ``writable``: received parts may be written into (the worker's
    end); ``max_bytes``: the largest message accepted; ``read_per_call``: the bytes one
    ``receive`` reads from the socket before it answers; ``max_parts``: the most parts a
    message may have; ``buffer_bytes``: the read buffer's size to start with (it grows to hold
    one small message's head and parts, under SMALL_BELOW + 8 x ``max_parts`` bytes);
    ``send_buffer``: the SO_SNDBUF asked, None for the kernel's default. Compiled, an extension
    type (link.pxd)."""

    def __init__(self, sock, writable: bool = False, max_bytes: int = MAX_BYTES,
                 read_per_call: int = READ_PER_CALL, max_parts: int = MAX_PARTS,
                 buffer_bytes: int = BUFFER_BYTES, send_buffer: int | None = SEND_BUFFER) -> None:
        sock.setblocking(False)
        if send_buffer is not None:
            try:  # the kernel holds up to this much of what we wrote (within net.core.wmem_max)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
            except OSError:
                pass
        self.sock = sock
        self.fd = sock.fileno()
        self.writable = writable
        self.max_bytes = max_bytes
        self.max_parts = max_parts  # a head of more parts is garbage (it costs 8 bytes a part)
        self.read_per_call = read_per_call
        self.taken = 0  # bytes the current ``receive`` has read from the socket
        self.buffer = bytearray(buffer_bytes)
        self.view = memoryview(self.buffer)
        self.start = 0  # the first byte not yet parsed
        self.end = 0  # the end of what was read
        self.big = None  # a large message being read: [lengths, its parts read, the next, its bytes]
        self.whole = None  # a large message read whole: its parts' bytearrays
        self.out = deque()  # memoryviews not yet written, whole messages in order
        # Told True when bytes start waiting in the queue, False once it is empty again: the
        # supervisor's loop watches the socket for writing meanwhile (Poller.want_write).
        self.on_pending = None
        self.eof = False  # the peer closed its end (everything before it was read)
        self.broken = False  # the peer is gone, or wrote garbage: nothing more goes either way
        self.error = None  # what the garbage was

    def fileno(self) -> int:
        return self.fd

    @property
    def pending(self) -> bool:
        """Bytes wait in the link's queue: the loop must watch the socket for writing."""
        return bool(self.out)

    # -- writing -------------------------------------------------------------------------------

    def send(self, parts: list, blocking: bool = False) -> bool:
        """Queue one message; True once the socket took all of it, False if some of it waits in
        the queue (``flush`` writes it once the socket is writable). ``blocking`` waits instead,
        until all of it is written. A broken link drops the message (True: nothing waits)."""
        if self.broken:
            return True
        if self.out:  # behind what waits already: a message is never interleaved with another
            for chunk in self._framed(parts):
                self.out.append(_bytes_view(chunk))
        elif COMPILED and len(parts) < _FAST_PARTS:
            self._send_fast(parts)
        else:
            self._write(self._framed(parts), False)
        while blocking and self.out and not self.broken:
            _wait_writable(self.fd)
            self.flush()
        return not self.out

    def _framed(self, parts: list) -> list:
        """The chunks that carry ``parts`` on the stream, in order: the frame prefix, then the
        parts (shared/zmtp.py frames them its own way)."""
        return [frame_prefix(parts), *parts]

    def _sendmsg_fast(self, parts: list):
        """Compiled: one sendmsg of ``parts`` framed (``_sendmsg_c``'s answer)."""
        return _sendmsg_c(self.fd, parts)

    def _send_fast(self, parts: list) -> None:
        """Compiled: the whole message in one sendmsg from the parts' own buffers; what the
        socket did not take is queued as ``_write`` queues it."""
        try:
            written = self._sendmsg_fast(parts)
        except OSError as exc:
            if exc.errno in _GONE:
                self._gone()
                return
            raise
        if written >= 0:  # the socket is full
            self._queue_rest(self._framed(parts), 0, written, False)

    def flush(self) -> bool:
        """Write what waits in the queue; True once it is empty."""
        if self.out and not self.broken:
            chunks = list(self.out)
            self.out.clear()
            self._write(chunks, True)
            if not self.out and self.on_pending is not None:
                self.on_pending(False)
        return not self.out

    def _write(self, chunks: list, flushing: bool) -> None:
        """Write ``chunks`` (bytes-like, in order) with as few sendmsg calls as IOV_MAX allows;
        what the socket does not take now is queued."""
        index = 0
        total = len(chunks)
        while index < total:
            batch_end = min(index + IOV_MAX, total)
            try:
                sent = self.sock.sendmsg(chunks[index:batch_end])
            except BlockingIOError:
                sent = 0
            except OSError as exc:
                if exc.errno in _GONE:
                    self._gone()
                    return
                raise
            while index < batch_end:  # past the chunks written whole
                size = memoryview(chunks[index]).nbytes
                if sent < size:
                    break
                sent -= size
                index += 1
            if index < batch_end:  # the socket is full: the rest waits for writability
                self._queue_rest(chunks, index, sent, flushing)
                return

    def _queue_rest(self, chunks: list, index: int, sent: int, flushing: bool) -> None:
        """Queue ``chunks`` from byte ``sent`` of chunk ``index`` on (``sent`` may run past it:
        chunks written whole are skipped), and tell the loop unless the queue was waiting
        already."""
        while index < len(chunks):
            size = memoryview(chunks[index]).nbytes
            if sent < size:
                break
            sent -= size
            index += 1
        if index == len(chunks):
            return
        self.out.append(_bytes_view(chunks[index])[sent:])
        for chunk in chunks[index + 1:]:
            self.out.append(_bytes_view(chunk))
        if not flushing and self.on_pending is not None:
            self.on_pending(True)

    def _gone(self) -> None:
        self.broken = True
        self._drop_queue()

    def _drop_queue(self) -> None:
        if self.out:
            self.out.clear()
            if self.on_pending is not None:
                self.on_pending(False)

    # -- reading -------------------------------------------------------------------------------

    def receive(self) -> list:
        """Every message complete once what the socket holds now is read, up to
        ``read_per_call`` bytes of it; [] if none. At the peer's close, ``eof`` is set (after
        the messages it wrote before); at a frame that does not parse, ``error`` says what it
        was and the link is ``broken`` (the messages before it are still answered)."""
        messages = []
        if self.broken or self.eof:
            return messages
        self.taken = 0
        try:
            while self.taken < self.read_per_call:
                if self.big is not None:
                    if not self._read_big():
                        return messages
                    self._big_done(messages)
                    continue
                more = self._fill()
                self._parse(messages)
                if not more:
                    return messages
        except LinkError as exc:
            self.error = str(exc)
        return messages

    def _big_done(self, messages: list) -> None:
        """The large message being read is whole: it joins ``messages`` (shared/zmtp.py reads a
        large frame this way, and adds it to its message instead)."""
        messages.append(self._finish_big())

    def _make_room(self, size: int) -> None:
        """Move what is unparsed to the start of a buffer that holds at least ``size`` bytes."""
        kept = self.end - self.start
        if size > len(self.buffer):
            buffer = bytearray(size)
            buffer[:kept] = self.buffer[self.start:self.end]
            self.buffer, self.view = buffer, memoryview(buffer)
        else:
            self.buffer[:kept] = self.buffer[self.start:self.end]
        self.start, self.end = 0, kept

    def _fill(self) -> bool:
        """Read into the buffer's free space (moving what is unparsed to its start first, once
        the buffer's end is reached); True if the read filled it (more may wait)."""
        if self.start == self.end:
            self.start = self.end = 0
        elif self.end == len(self.buffer):
            self._make_room(0)
        room = len(self.buffer) - self.end
        if COMPILED:
            got = self._recv_c(self.buffer, self.end, room)
        else:
            got = self._recv_into(self.view[self.end:], room)
        self.end += got
        self.taken += got
        return got == room

    def _recv_into(self, target, size: int) -> int:
        """Bytes read into ``target`` (at most ``size``), 0 if none were waiting; at the peer's
        close ``eof``, once it is gone ``broken``."""
        try:
            got = self.sock.recv_into(target, size)
        except BlockingIOError:
            return 0
        except OSError as exc:
            if exc.errno in _GONE:
                self._gone()
                return 0
            raise
        if got == 0:
            self.eof = True
        return got

    def _recv_c(self, target, offset, size):
        """Compiled: ``_recv_into`` with recv(2) into the bytearray ``target`` from ``offset``."""
        while True:
            got = mw_recv(self.fd, PyByteArray_AS_STRING(target) + offset, size, _DONTWAIT)
            if got > 0:
                return got
            if got == 0:
                self.eof = True
                return 0
            code = errno_c
            if code == _EINTR:
                PyErr_CheckSignals()
                continue
            if code == _EAGAIN:
                return 0
            if code in _GONE:
                self._gone()
                return 0
            raise OSError(code, "recv on a worker link")

    def _parse(self, messages: list) -> None:
        """Every complete message in the buffer, appended to ``messages``; a large one starts
        being read into its own."""
        while True:
            available = self.end - self.start
            if available < 4:
                return
            count = _COUNT.unpack_from(self.buffer, self.start)[0]
            if count == 0 or count > self.max_parts:
                self._garbage(f"a message of {count} parts")
            head = 4 + _LENGTH * count
            if available < head:
                if head > len(self.buffer) - self.start:
                    self._make_room(head)  # a head of many parts: at most max_parts * 8 bytes
                return
            if COMPILED and count < _FAST_PARTS:
                parsed = self._split_c(count, head)
                if parsed is None:
                    return  # not all there yet (room was made for it)
                if parsed is not False:
                    messages.append(parsed)
                    continue
            lengths = struct.unpack_from(f"<{count}Q", self.buffer, self.start + 4)
            total = sum(lengths)
            if total > self.max_bytes:
                self._garbage(f"a message of {total} bytes (at most {self.max_bytes})")
            body = self.start + head
            if total < _SMALL_BELOW:  # split out of the buffer, once it is all there
                if self.end - body < total:
                    if head + total > len(self.buffer) - self.start:
                        self._make_room(head + total)
                    return
                messages.append(self._split(lengths, body))
                self.start = body + total
                continue
            self._start_big(lengths, body)
            if self.big is not None:
                return
            messages.append(self._finish_big())

    def _split_c(self, count, head):
        """Compiled: the small message of ``count`` parts at the buffer's start, its parts made
        straight from the buffer as ``_split`` makes them (None: not all there yet; False: not
        small, ``_parse`` goes on with it)."""
        data = cython.cast(cython.p_uchar, PyByteArray_AS_STRING(self.buffer)) + self.start
        total = 0
        for index in range(count):
            length = _u64_at(data + 4 + 8 * index)
            if length >= _SMALL_BELOW:  # compared unsigned: a length past 2**63 is not small
                return False
            total += length
            if total >= _SMALL_BELOW:
                return False
        if self.end - self.start < head + total:
            if head + total > len(self.buffer) - self.start:
                self._make_room(head + total)
            return None
        parts = []
        at = head
        if self.writable:  # one bytearray the receiver owns, each part at an ALIGN offset
            size = 0
            for index in range(count):
                size += (_u64_at(data + 4 + 8 * index) + _ALIGN - 1) // _ALIGN * _ALIGN
            own = PyByteArray_FromStringAndSize(cython.NULL, size)
            base = PyByteArray_AS_STRING(own)
            view = memoryview(own)
            offset = 0
            for index in range(count):
                size = _u64_at(data + 4 + 8 * index)
                memcpy(base + offset, data + at, size)
                parts.append(view[offset:offset + size])
                at += size
                offset += (size + _ALIGN - 1) // _ALIGN * _ALIGN
        else:
            for index in range(count):
                size = _u64_at(data + 4 + 8 * index)
                parts.append(PyBytes_FromStringAndSize(cython.cast(cython.p_char, data + at), size))
                at += size
        self.start += at
        return parts

    def _split(self, lengths, at: int) -> list:
        """The parts of a small message lying in the buffer from ``at``: bytes, or (writable)
        views of one bytearray the receiver owns, each part at an ALIGN offset of it."""
        parts = []
        buffer = self.buffer
        if not self.writable:
            for length in lengths:
                parts.append(bytes(buffer[at:at + length]))
                at += length
            return parts
        offsets, size = aligned_offsets(lengths)
        own = memoryview(bytearray(size))
        for length, offset in zip(lengths, offsets):
            own[offset:offset + length] = buffer[at:at + length]
            parts.append(own[offset:offset + length])
            at += length
        return parts

    def _start_big(self, lengths, body: int) -> None:
        """A message of SMALL_BELOW bytes or more: each part is read into a bytearray of its own
        (as malloc aligns it), which grows with what arrives, doubling from GROW_FROM up to the
        part's length. So a length the peer declares costs the link only what the peer sent:
        the link holds at most about twice the bytes it was given. What the read buffer holds of
        it is taken first; ``big`` is None again, and ``whole`` set, once every part is in."""
        self.big = [lengths, [], None, 0]  # lengths, the parts read, the part being read, its bytes
        self.start = body
        self._skip_empty_parts()
        while self.big is not None and self.start < self.end:
            target, filled, room = self._big_target()
            take = min(room, self.end - self.start)
            target[filled:filled + take] = self.view[self.start:self.start + take]
            self.start += take
            self._big_advance(take)

    def _read_big(self) -> bool:
        """Read more of the big message straight into its parts' bytearrays, within what is
        left of this call's ``read_per_call``; True once it is whole."""
        while self.big is not None:
            left = self.read_per_call - self.taken
            if left <= 0:
                return False
            target, filled, room = self._big_target()
            room = min(room, left)
            got = self._recv_into(memoryview(target)[filled:filled + room], room)
            if got == 0:
                return False
            self.taken += got
            self._big_advance(got)
        return True

    def _big_target(self) -> tuple:
        """(the bytearray of the part being read, the bytes it holds, the room it has), made or
        grown as need be: at most twice what it holds, never past the part's length."""
        big = self.big
        length = big[0][len(big[1])]
        part, filled = big[2], big[3]
        if part is None:
            part = big[2] = bytearray(min(length, GROW_FROM))
        elif filled == len(part):
            grown = len(part) + min(len(part), length - len(part))
            if COMPILED:  # realloc: the new bytes are read into at once, never zeroed first
                PyByteArray_Resize(part, grown)
            else:
                part.extend(bytes(grown - len(part)))
        return part, filled, len(part) - filled

    def _big_advance(self, count: int) -> None:
        """``count`` more bytes of the part being read arrived."""
        big = self.big
        big[3] += count
        if big[3] == big[0][len(big[1])]:
            big[1].append(big[2])
            big[2], big[3] = None, 0
            self._skip_empty_parts()

    def _skip_empty_parts(self) -> None:
        big = self.big
        lengths, done = big[0], big[1]
        while len(done) < len(lengths) and lengths[len(done)] == 0:
            done.append(bytearray())
        if len(done) == len(lengths):
            self.whole = done
            self.big = None

    def _finish_big(self) -> list:
        """The parts of the big message just read: views of their bytearrays (small ones bytes,
        unless ``writable``)."""
        done = self.whole
        self.whole = None
        parts = []
        for part in done:
            parts.append(memoryview(part) if self.writable or len(part) >= _COPY_BELOW
                         else bytes(part))
        return parts

    def _garbage(self, what: str) -> None:
        self.broken = True
        self._drop_queue()
        raise LinkError(f"the peer wrote {what}: not a link frame")

    def close(self) -> None:
        self.broken = True
        self._drop_queue()
        self.sock.close()


def _bytes_view(chunk) -> memoryview:
    """``chunk`` as a flat memoryview of bytes (a tensor's view may have another format)."""
    view = memoryview(chunk)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _wait_writable(fd: int) -> None:
    """Until ``fd`` can take more (the worker's blocking send; poll retries after a signal)."""
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    poller.poll()


# -- compiled only: the C calls (declarations in link.pxd) ----------------------------------------

def _u64_at(data):
    """The little-endian u64 at ``data``."""
    value = 0
    for index in range(7, -1, -1):
        value = (value << 8) | cython.cast(cython.uchar, data[index])
    return value


def _sendmsg_c(fd, parts):
    """One sendmsg of the frame prefix and every part of ``parts`` (fewer than FAST_PARTS),
    from their own buffers: -1 once all of it was written, else the bytes written (0 if the
    socket was full). OSError for anything but a full socket."""
    count = len(parts)
    prefix = cython.declare(cython.uchar[4 + 8 * 64])
    iov = cython.declare(mw_iovec[65])
    views = cython.declare(Py_buffer[64])
    message = cython.declare(mw_msghdr)
    taken = 0
    total = 4 + 8 * count
    written = 0
    _put_u32(prefix, count)
    try:
        for index in range(count):
            PyObject_GetBuffer(parts[index], cython.address(views[index]), PyBUF_SIMPLE)
            taken += 1
            iov[index + 1].iov_base = views[index].buf
            iov[index + 1].iov_len = views[index].len
            _put_u64(prefix + 4 + 8 * index, views[index].len)
            total += views[index].len
        iov[0].iov_base = prefix
        iov[0].iov_len = 4 + 8 * count
        memset(cython.address(message), 0, cython.sizeof(mw_msghdr))
        message.msg_iov = iov
        message.msg_iovlen = count + 1
        written = _sendmsg_now(fd, cython.address(message), "sendmsg on a worker link")
    finally:
        for index in range(taken):
            PyBuffer_Release(cython.address(views[index]))
    return -1 if written == total else written


def _sendmsg_now(fd, message, what):
    """sendmsg(2) of ``message`` without waiting: the bytes written, 0 if the socket was full;
    OSError (``what`` says of which socket) for anything else. A signal is handled and the call
    made again. Also shared/zmtp.py's."""
    while True:
        written = mw_sendmsg(fd, message, _DONTWAIT | _NOSIGNAL)
        if written >= 0:
            return written
        code = errno_c
        if code == _EINTR:
            PyErr_CheckSignals()
            continue
        if code == _EAGAIN:
            return 0
        raise OSError(code, what)


def _put_u32(data, value):
    for index in range(4):
        data[index] = (value >> (8 * index)) & 0xFF


def _put_u64(data, value):
    for index in range(8):
        data[index] = (value >> (8 * index)) & 0xFF
