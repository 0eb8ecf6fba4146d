"""ZMTP 3.1, the ZeroMQ wire (RFC 23/ZMTP, 37/ZMTP), spoken by our own loop on a stream socket.

The supervisor's ``ipc://`` frontends are Unix stream sockets that libzmq clients (ours, the
gateway's, any language's DEALER or REQ) connect to unchanged. The daemon does not run libzmq
behind them: its loop reads and writes each connection itself, as it does a worker link
(shared/link.py), and this module is the codec. Why: behind a libzmq ROUTER every request and
every reply crosses libzmq's I/O thread, whose wake-ups (``epoll_wait``, an eventfd, two
``epoll_ctl``) cost the supervisor about 12 us of CPU per request on a 2-core machine, a quarter
of a request's cost with batching off (docs/ARCHITECTURE.md). ``tcp://`` (CURVE), the control
socket and the admin socket stay libzmq's.

What is spoken, and nothing more:

* the greeting, 64 bytes each way: the signature ``FF 00*7 01 7F``, version 3.1, mechanism
  ``NULL`` (the only one on ``ipc://``: file permissions guard it, docs/OPERATIONS.md), as-server
  0. Ours is written as soon as the connection is accepted, together with our READY; the peer's
  must be version 3 or later (libzmq has spoken 3.0 since 4.0) with the NULL mechanism;
* the NULL mechanism's READY command each way. Ours names ``Socket-Type`` (``socket_type``);
  the peer's must name one of ``peer_types`` (a ROUTER talks to DEALER, REQ and ROUTER). Its
  other properties (``Identity``, application metadata) are read past: the supervisor routes
  replies by the connection, never by what a peer calls itself;
* messages: frames with the MORE and LONG flags (a 1- or 8-byte big-endian size), the last
  frame of a message without MORE;
* PING (37/ZMTP): answered with a PONG carrying its context, so a client's ZMQ_HEARTBEAT_IVL
  finds us alive. PONG is read past. ERROR, and any other command, ends the connection.

The bounds are a ROUTER's with ``ZMQ_MAXMSGSIZE`` (docs/PROTOCOL.md, 1.3): a frame of more than
``max_bytes`` is garbage at its header (libzmq disconnects such a peer); a message of more than
``max_parts`` frames or ``max_bytes`` bytes in all is read past without being held, and handed
on as a tuple that says so, for a typed refusal (the connection stays). A command is at most
MAX_COMMAND bytes, a frame of SMALL_BELOW bytes or more read
into a bytearray of its own that grows with what arrives (shared/link.py ``_start_big``). Bytes
that do not parse -- a bad greeting, a data frame before the handshake, a reserved flag bit, a
command with MORE -- make the link ``broken`` with ``error`` saying what they were: a stream has
no next message to resynchronise on.

One implementation: Cython compiles this file in its pure-Python mode (zmtp.pxd); uncompiled, it
runs as it is, and the fuzzer (tests/fuzz/wire.py) drives both and compares them.
"""

from __future__ import annotations

from modelwarden.shared.link import SMALL_BELOW, Link, LinkError

try:
    import cython  # compiled: Cython's own; uncompiled: its shadow module, when installed
except ImportError:
    cython = None

COMPILED = not __file__.endswith(".py")  # compiled: an extension (zmtp.pxd declares its C calls)

MORE, LONG, COMMAND = 0x01, 0x02, 0x04  # a frame's flags; the other five bits are reserved
MAX_COMMAND = 16 * 1024  # a READY with a peer's metadata; PING's is 22 bytes
GREETING_BYTES = 64
SIGNATURE_BYTES = 10
VERSION_MAJOR, VERSION_MINOR = 3, 1
MECHANISM = b"NULL".ljust(20, b"\0")
JOIN_BELOW = 4096  # a message this small is queued as one chunk (``framed``)
MAX_PING_CONTEXT = 16  # 37/ZMTP: a PING's context is at most 16 bytes, echoed in the PONG

# How far the handshake has come (each stage admits only what the next line says).
GREETING = 0  # the peer's 64-byte greeting
HANDSHAKE = 1  # its READY command
OPEN = 2  # messages, PING, PONG
_STAGE_NAMES = ("greeting", "handshake", "open")

# The C copies the compiled code reads (zmtp.pxd).
_SMALL_BELOW, _MORE, _LONG, _COMMAND, _MAX_COMMAND = SMALL_BELOW, MORE, LONG, COMMAND, MAX_COMMAND


def greeting() -> bytes:
    """Our 64-byte greeting: signature, version 3.1, NULL, as-server 0, filler."""
    return (b"\xff" + (1).to_bytes(8, "big") + b"\x7f" + bytes([VERSION_MAJOR, VERSION_MINOR])
            + MECHANISM + b"\0" + bytes(31))


def command(name: bytes, body: bytes) -> bytes:
    """One command frame: ``name`` (a short string) then ``body``."""
    data = bytes([len(name)]) + name + body
    return frame_head(COMMAND, len(data)) + data


def ready(socket_type: bytes) -> bytes:
    """The NULL mechanism's READY, naming our socket type."""
    return command(b"READY", property_bytes(b"Socket-Type", socket_type))


def property_bytes(name: bytes, value: bytes) -> bytes:
    return bytes([len(name)]) + name + len(value).to_bytes(4, "big") + value


def frame_head(flags: int, size: int) -> bytes:
    """A frame's flags and size: one byte of size below 256, else LONG and eight."""
    if size < 256:
        return bytes([flags, size])
    return bytes([flags | LONG]) + size.to_bytes(8, "big")


def framed(parts: list) -> list:
    """The chunks that carry ``parts`` as one message: each part's head, then the part; a
    message of ``bytes`` under JOIN_BELOW bytes as one chunk (it is queued that way: one entry,
    not two a part, while a peer does not read). Any other part is kept as it is: the router's
    reply ledger knows a reply written when its tracked last part (a ``zmq.Frame``) is let go."""
    chunks = []
    joinable = True
    last = len(parts) - 1
    for index, part in enumerate(parts):
        chunks.append(frame_head(MORE if index < last else 0, memoryview(part).nbytes))
        chunks.append(part)
        joinable = joinable and type(part) is bytes
    if joinable and len(chunks) > 2 and sum(memoryview(chunk).nbytes for chunk in chunks) < JOIN_BELOW:
        return [b"".join(chunks)]
    return chunks


def properties(data: bytes) -> dict | None:
    """A READY's metadata, name (lower-cased: 23/ZMTP names are case-insensitive) -> value;
    None when it does not parse."""
    found = {}
    at = 0
    while at < len(data):
        size = data[at]
        at += 1
        if at + size + 4 > len(data):
            return None
        name = bytes(data[at:at + size]).lower()
        at += size
        length = int.from_bytes(data[at:at + 4], "big")
        at += 4
        if at + length > len(data):
            return None
        found[name] = bytes(data[at:at + length])
        at += length
    return found


class ZmtpLink(Link):
    """One ZMTP connection over the connected stream socket ``sock``: ``socket_type`` is what we
    are (b"ROUTER"), ``peer_types`` what we accept the peer to be. ``greet()`` writes our
    greeting and READY; ``receive()`` gives whole messages (lists of frames: ``bytes``, a large
    one a memoryview of its own bytearray) once the handshake is done, and for a message of
    more than ``max_parts`` frames or ``max_bytes`` bytes, read past and let go, the tuple
    ``(its frames, its bytes, whether its first frame was empty)``; ``send(parts)`` writes one
    message. The rest is the link's (shared/link.py): the write queue, ``on_pending``, ``eof``,
    ``broken`` and ``error``. Compiled, an extension type (zmtp.pxd)."""

    def __init__(self, sock, socket_type: bytes, peer_types, max_bytes: int, max_parts: int,
                 buffer_bytes: int, send_buffer=None) -> None:
        super().__init__(sock, writable=False, max_bytes=max_bytes, max_parts=max_parts,
                         buffer_bytes=buffer_bytes, send_buffer=send_buffer)
        self.socket_type = socket_type
        self.peer_types = frozenset(peer_types)
        self.peer_type = None  # what the peer's READY said it is
        self.stage = GREETING
        self.frames = []  # the message being read: its frames so far
        self.message_bytes = 0  # their bytes, with the declared size of a frame being read
        self.big_more = False  # the MORE flag of the large frame being read
        # Messages sent before the peer's READY came, written once it has: a libzmq peer reads
        # everything after its own READY as handshake until it has written that READY, and
        # takes an early message for a protocol error.
        self.held = []
        # A message past max_parts or max_bytes is read past, not held (``_discard``).
        self.discarding = False
        self.discarded_frames = 0
        self.discarded_bytes = 0
        self.delimited = False  # its first frame was empty (a REQ's delimiter)
        self.skip = 0  # bytes of a discarded frame still to read past
        self.skip_more = False

    @property
    def open(self) -> bool:
        """The handshake is done: messages flow."""
        return self.stage == OPEN

    def greet(self) -> None:
        """Write our greeting and READY at once (a peer reads them in order): the handshake
        then takes the peer's half only."""
        self._write([greeting() + ready(self.socket_type)], False)

    # -- writing: the link's queue, with ZMTP's framing ---------------------------------------

    def send(self, parts: list, blocking: bool = False) -> bool:
        """Queue one message (see the link's); before the handshake is done it waits in
        ``held`` and goes out when the peer's READY comes (False: not written yet)."""
        if self.stage != OPEN and not self.broken:
            self.held.append(parts)
            return False
        return Link.send(self, parts, blocking)

    def _framed(self, parts: list) -> list:
        return framed(parts)

    def _sendmsg_fast(self, parts: list):
        return _zmtp_sendmsg_c(self.fd, parts)

    # -- reading -------------------------------------------------------------------------------

    def _big_done(self, messages: list) -> None:
        """A large frame is whole: it joins the message being read."""
        self._frame_done(self._finish_big()[0], self.big_more, messages)

    def _parse(self, messages: list) -> None:
        """Every complete frame in the buffer: commands answered, data frames gathered into
        messages (appended to ``messages``); a large frame starts being read into its own."""
        while True:
            if self.skip:
                if not self._skip(messages):
                    return
                continue
            if self.stage == GREETING:
                if not self._read_greeting():
                    return
                continue
            available = self.end - self.start
            if available < 2:
                return
            if COMPILED:  # a C pointer to the first unparsed byte
                data = self._buffer_at()
                at = 0
            else:
                data = self.buffer
                at = self.start
            flags = data[at]
            if flags & ~(_MORE | _LONG | _COMMAND):
                self._garbage(f"a frame with reserved flags {flags:#04x}")
            if flags & _LONG:
                if available < 9:
                    return
                size = _u64_be(data, at + 1)
                head = 9
            else:
                size = data[at + 1]
                head = 2
            if flags & _COMMAND:
                if flags & _MORE:
                    self._garbage("a command frame with MORE")
                if size > _MAX_COMMAND:
                    self._garbage(f"a command of {size} bytes (at most {MAX_COMMAND})")
                if available < head + size:
                    self._room_for(head + size)
                    return
                body = bytes(self.view[self.start + head:self.start + head + size])
                self.start += head + size
                self._command(body)
                continue
            if self.stage != OPEN:
                self._garbage("a message before the handshake's READY")
            if size > self.max_bytes:  # libzmq's ZMQ_MAXMSGSIZE: a frame it would not take
                self._garbage(f"a frame of {size} bytes (at most {self.max_bytes})")
            if (self.discarding or len(self.frames) >= self.max_parts
                    or size > self.max_bytes - self.message_bytes):
                self._discard(size, flags & _MORE)
                self.start += head
                continue
            if size < _SMALL_BELOW:
                if available < head + size:
                    self._room_for(head + size)
                    return
                self.message_bytes += size
                if COMPILED:
                    frame = PyBytes_FromStringAndSize(
                        cython.cast(cython.p_char, data + head), size)
                else:
                    frame = bytes(self.view[self.start + head:self.start + head + size])
                self.start += head + size
                self._frame_done(frame, flags & _MORE, messages)
                continue
            self.message_bytes += size
            self.big_more = bool(flags & _MORE)
            self._start_big([size], self.start + head)
            if self.big is not None:
                return  # the rest is read straight into the frame's own bytearray
            self._frame_done(self._finish_big()[0], self.big_more, messages)

    def _buffer_at(self):
        """Compiled: a C pointer to the first unparsed byte."""
        return cython.cast(cython.p_uchar, PyByteArray_AS_STRING(self.buffer)) + self.start

    def _room_for(self, size: int) -> None:
        """A frame of ``size`` bytes (head included) starts at ``start``: make the buffer hold
        it whole, once it is not already able to (at most SMALL_BELOW + 9, or a command's)."""
        if size > len(self.buffer) - self.start:
            self._make_room(size)

    def _discard(self, size, more) -> None:
        """A frame past the message's bounds: the message is refused, not held. What was read
        of it is let go, and the rest of it is read past (``skip``); its end gives
        ``(frames, bytes, delimited)`` in place of the message, for a typed refusal."""
        if not self.discarding:
            self.discarding = True
            self.discarded_frames = len(self.frames)
            self.discarded_bytes = self.message_bytes
            self.delimited = bool(self.frames) and len(self.frames[0]) == 0
            self.frames = []
            self.message_bytes = 0
        self.discarded_frames += 1
        self.discarded_bytes += size
        self.skip = size
        self.skip_more = bool(more)

    def _skip(self, messages: list) -> bool:
        """Read past what is left of a discarded frame in the buffer; True once it is all
        past (the message's end, if it was its last frame, appended to ``messages``)."""
        take = min(self.skip, self.end - self.start)
        self.start += take
        self.skip -= take
        if self.skip:
            return False
        if not self.skip_more:
            messages.append((self.discarded_frames, self.discarded_bytes, self.delimited))
            self.discarding = False
        return True

    def _frame_done(self, frame, more, messages: list) -> None:
        self.frames.append(frame)
        if not more:
            messages.append(self.frames)
            self.frames = []
            self.message_bytes = 0

    def _read_greeting(self) -> bool:
        """The peer's greeting, checked as far as it has come; True once all of it is read."""
        available = self.end - self.start
        head = bytes(self.view[self.start:self.start + min(available, GREETING_BYTES)])
        if head[:1] and head[0] != 0xFF:
            self._garbage("a greeting without ZMTP's signature (ZMTP 1.0 is not spoken)")
        if len(head) >= SIGNATURE_BYTES and not head[9] & 0x01:
            self._garbage("a greeting without ZMTP's signature (ZMTP 1.0 is not spoken)")
        if len(head) > SIGNATURE_BYTES and head[10] < VERSION_MAJOR:
            self._garbage(f"a greeting of ZMTP {head[10]}.x (3.0 or later is spoken)")
        if len(head) < GREETING_BYTES:
            return False
        if head[12:32] != MECHANISM:
            mechanism = head[12:32].rstrip(b"\0").decode("ascii", "replace")[:20]
            self._garbage(f"a greeting asking for the {mechanism!r} mechanism (NULL is spoken)")
        self.start += GREETING_BYTES
        self.stage = HANDSHAKE
        return True

    def _command(self, body: bytes) -> None:
        """One command frame's body: READY in the handshake, PING and PONG once open."""
        if not body or not body[0] or body[0] + 1 > len(body):
            self._garbage("a command without a name")
        name = body[1:1 + body[0]]
        data = body[1 + body[0]:]
        if self.stage == HANDSHAKE:
            if name != b"READY":
                self._garbage(f"the command {name[:16]!r} in the handshake (READY was due)")
            found = properties(data)
            if found is None:
                self._garbage("a READY property that runs past its command")
            peer_type = found.get(b"socket-type")
            if peer_type not in self.peer_types:
                self._garbage(f"a peer of socket type {(peer_type or b'none')[:16]!r}, "
                              f"which a {self.socket_type.decode()} does not talk to")
            self.peer_type = peer_type
            self.stage = OPEN
            held, self.held = self.held, []
            for parts in held:
                Link.send(self, parts, False)
            return
        if name == b"PING":
            if len(data) < 2:
                self._garbage("a PING without its TTL")
            self._send_command(command(b"PONG", data[2:2 + MAX_PING_CONTEXT]))
            return
        if name == b"PONG":
            return
        if name == b"ERROR":
            reason = data[1:1 + data[0]] if data else b""
            self._garbage(f"ERROR {reason.decode('ascii', 'replace')[:64]!r}")
        self._garbage(f"the command {name[:16]!r}")

    def _send_command(self, frame: bytes) -> None:
        """A command frame of ours, behind any message that waits to be written."""
        if self.out:
            self.out.append(memoryview(frame))
        else:
            self._write([frame], False)

    def _garbage(self, what: str) -> None:
        self.broken = True
        self._drop_queue()
        raise LinkError(f"the peer wrote {what}: not ZMTP 3 (stage {_STAGE_NAMES[self.stage]})")


def _u64_be(data, at):
    """The big-endian u64 at ``data[at]`` (a bytearray, or compiled a C pointer)."""
    value = 0
    for index in range(8):
        value = (value << 8) | data[at + index]
    return value


# -- compiled only: one sendmsg of a small message (declarations in zmtp.pxd) ----------------------

def _zmtp_sendmsg_c(fd, parts):
    """One sendmsg of every part of ``parts`` (fewer than FAST_PARTS) with its frame head, from
    the parts' own buffers: -1 once all of it was written, else the bytes written (0 if the
    socket was full). OSError for anything but a full socket."""
    count = len(parts)
    heads = cython.declare(cython.uchar[9 * 64])
    iov = cython.declare(mw_iovec[128])
    views = cython.declare(Py_buffer[64])
    message = cython.declare(mw_msghdr)
    taken = 0
    total = 0
    written = 0
    try:
        for index in range(count):
            PyObject_GetBuffer(parts[index], cython.address(views[index]), PyBUF_SIMPLE)
            taken += 1
            size = views[index].len
            head = heads + 9 * index
            flags = _MORE if index < count - 1 else 0
            if size < 256:
                head[0] = flags
                head[1] = size
                iov[2 * index].iov_len = 2
            else:
                head[0] = flags | _LONG
                for shift in range(8):
                    head[1 + shift] = (size >> (8 * (7 - shift))) & 0xFF
                iov[2 * index].iov_len = 9
            iov[2 * index].iov_base = head
            iov[2 * index + 1].iov_base = views[index].buf
            iov[2 * index + 1].iov_len = size
            total += iov[2 * index].iov_len + size
        memset(cython.address(message), 0, cython.sizeof(mw_msghdr))
        message.msg_iov = iov
        message.msg_iovlen = 2 * count
        written = _sendmsg_now(fd, cython.address(message), "sendmsg on a ZMTP connection")
    finally:
        for index in range(taken):
            PyBuffer_Release(cython.address(views[index]))
    return -1 if written == total else written
