# cython: annotation_typing=True
"""ZeroMQ messages in and out: the helpers the daemon, its workers and the client share.

Compiled (Cython, shared/sockets.pxd), ``recv_message`` and ``send_parts`` call libzmq
directly on pyzmq's own socket handles: a part below ``COPY_BELOW`` bytes arrives as ``bytes``
with no ``zmq.Frame`` made for it, a larger one stays in libzmq's memory as a ``Part`` (zero
copies, and forwarding it shares that memory again), and an empty socket answers None instead of
raising ``zmq.Again``. That is the supervisor's per-message cost: a pyzmq Frame is about 1.5 us
to make, an ``Again`` about 7 us to raise and catch, on this machine. Uncompiled, the same
functions do the same through pyzmq (large parts are ``zmq.Frame``): both kinds of large part
have ``len()``, ``bytes()``, the buffer protocol and ``.buffer``, and either can be sent again.

pyzmq's ``send_multipart``/``recv_multipart`` cost about 20 us for a 4-frame message (they
combine IntFlag enums in Python for every frame and query RCVMORE through getsockopt);
``recv_parts`` does the same work in about 7 us, for the callers that want ``zmq.Frame``s.
"""

from __future__ import annotations

import errno as _errno
import os
from time import monotonic

import zmq

try:
    import cython  # compiled: Cython's own; uncompiled: its shadow module, when installed
except ImportError:
    cython = None  # uncompiled without Cython: only the compiled-only functions use it

# Compiled, this module is an extension (its __file__ a .so). The names only the compiled
# functions use -- ``cython``, the ``zmq_msg_*`` functions, Part's C fields -- are declared in
# sockets.pxd; uncompiled, those functions are never called. Annotations here are C types for
# Cython (the directive above), so the Python-facing functions have none: see their docstrings.
COMPILED = not __file__.endswith(".py")
_SNDMORE = int(zmq.SNDMORE)
_NOBLOCK = int(zmq.NOBLOCK)
_POLLIN = int(zmq.POLLIN)
_POLLOUT = int(zmq.POLLOUT)
_POLLIN_FD = 1  # poll(2)'s POLLIN on Linux
_POLLOUT_FD = 4  # and its POLLOUT
COPY_BELOW = 65536  # a part this small is copied into bytes: cheaper than keeping libzmq's
_COPY_BELOW = COPY_BELOW
_EAGAIN = _errno.EAGAIN
_EINTR = _errno.EINTR
_FRAME = zmq.Frame
_SOCKET = zmq.Socket


def send_parts(socket, parts):
    """Send a multipart message without copying large parts (small ones are copied, which is
    cheaper for them). Parts: bytes, ``Part``, ``zmq.Frame`` or any buffer. ``socket`` may also
    be a frontend the daemon's loop serves itself (supervisor/routing/localfront.py), which
    routes by the first part as a ROUTER does."""
    if not isinstance(socket, _SOCKET):
        socket.send_parts(parts)
        return
    if COMPILED:
        _send_c(socket, parts, 0)
        return
    last = len(parts) - 1
    send = socket.send
    for index, part in enumerate(parts):
        send(part, _SNDMORE if index < last else 0, copy=False)


def send_queued(socket, parts):
    """Queue a multipart message on a socket without a send high-water mark; False, with nothing
    queued, when the socket has no peer to queue for. A connected DEALER keeps its pipe across
    reconnects, so that happens only once libzmq has given the connection up for good (after a
    handshake the peer refused: see client/connection.py). Once the first part is accepted the
    rest of the message always is (ZeroMQ queues a message whole)."""
    if COMPILED:
        return _send_c(socket, parts, _NOBLOCK)
    last = len(parts) - 1
    send = socket.send
    try:
        send(parts[0], (_SNDMORE if last else 0) | _NOBLOCK, copy=False)
    except zmq.Again:
        return False
    for index in range(1, last + 1):
        send(parts[index], _SNDMORE if index < last else 0, copy=False)
    return True


def recv_message(socket, flags=0):
    """One multipart message, its parts below COPY_BELOW bytes as bytes and larger ones zero-copy;
    None when ``flags`` has NOBLOCK and nothing is waiting."""
    if COMPILED:
        return _recv_c(socket, flags, None, 0)
    return _recv_py(socket, flags, None)


def recv_routed(socket, prop):
    """The next waiting message (NOBLOCK) and the message property ``prop`` libzmq attached
    (``"Peer-Address"``, ``"User-Id"``; str or its ASCII bytes, which a loop can encode once),
    as a str, "" when it has none; None when nothing is waiting."""
    if type(prop) is not bytes:
        prop = prop.encode()
    if COMPILED:
        return _recv_c(socket, _NOBLOCK, prop, 0)
    return _recv_py(socket, _NOBLOCK, prop)


def recv_frames(socket, flags=0):
    """One multipart message for a process that may write into what it receives (a client's
    reply tensors): every part a writable buffer that stays where
    libzmq put it, with ``.buffer``, ``.bytes`` and ``len()`` -- compiled a ``Part``,
    uncompiled a ``zmq.Frame``. None when ``flags`` has NOBLOCK and nothing is waiting."""
    if COMPILED:
        return _recv_c(socket, flags, None, 1)
    try:
        return recv_parts(socket, flags)
    except zmq.Again:
        return None


def recv_parts(socket, flags=0):
    """Receive one multipart message as zmq.Frame objects (zero-copy)."""
    frame = socket.recv(flags, copy=False)
    parts = [frame]
    while frame.more:
        frame = socket.recv(copy=False)
        parts.append(frame)
    return parts


def _recv_py(socket, flags, prop):
    try:
        frame = socket.recv(flags, copy=False)
    except zmq.Again:
        return None
    value = None
    if prop is not None:
        try:
            value = frame.get(prop) or ""
        except zmq.ZMQError:  # the transport attaches no such property
            value = ""
    parts = []
    while True:
        parts.append(frame.bytes if len(frame) < COPY_BELOW else frame)
        if not frame.more:
            break
        frame = socket.recv(copy=False)
    return parts if prop is None else (parts, value)


# -- compiled only: libzmq called directly (declarations in sockets.pxd) -----------------------

class Part:
    """A received part left where libzmq put it (compiled only): one of COPY_BELOW bytes or
    more, read-only, or any part ``recv_frames`` received, writable (no other message shares
    its memory: libzmq delivered it to this process alone)."""

    def __dealloc__(self):
        zmq_msg_close(cython.address(self.msg))

    def __len__(self):
        return self.size

    def __getbuffer__(self, buffer: cython.pointer(Py_buffer), flags: cython.int):
        PyBuffer_FillInfo(buffer, self, zmq_msg_data(cython.address(self.msg)), self.size,
                          0 if self.writable else 1, flags)

    @property
    def buffer(self):
        return memoryview(self)

    @property
    def bytes(self):
        return bytes(memoryview(self))


def _handle(socket):
    # pyzmq's own send and recv check ``_closed`` (set by close() and Context.destroy()); its
    # ``closed`` property asks libzmq again (a getsockopt) on every call. A pyzmq Socket's two
    # attributes are read through their C getters (sockets.pxd: mw_read), anything else's (a
    # socket-like object of another backend) by name.
    if mw_socket_type != cython.NULL and mw_is_socket(socket, mw_socket_type):
        if mw_read(socket, mw_closed):
            raise zmq.ZMQError(_errno.ENOTSOCK)
        return mw_read(socket, mw_underlying)
    if socket._closed:
        raise zmq.ZMQError(_errno.ENOTSOCK)
    return socket.underlying


def _recv_c(socket, flags, prop, writable):
    """Every part of the next message; None if NOBLOCK found none. A blocking receive takes a
    waiting message at once, and only when there is none waits in pyzmq's poll (the GIL
    released, signals seen): a loop that polled already pays no second poll, which pyzmq makes
    in Python (a Poller per call, about 11,000 instructions).
    ``writable``: every part a writable Part, else small ones as bytes and large ones read-only."""
    blocking = cython.declare(cython.bint, not flags & _NOBLOCK)
    flags |= _NOBLOCK
    msg = cython.declare(mw_msg_t)
    handle = cython.declare(cython.p_void,
                            cython.cast(cython.p_void, cython.cast(cython.size_t, _handle(socket))))
    more = cython.declare(cython.int, 1)
    size = cython.declare(cython.size_t)
    code = cython.declare(cython.int)
    found = cython.declare(mw_cstr)
    part = cython.declare(Part)
    parts = []
    value = None
    while more:
        zmq_msg_init(cython.address(msg))
        rc = zmq_msg_recv(cython.address(msg), handle, flags)
        if rc < 0:
            zmq_msg_close(cython.address(msg))
            code = zmq_errno()
            if code == _EAGAIN and not parts:
                if not blocking:
                    return None
                while not socket.poll():
                    pass
                continue
            if code == _EINTR and not parts:
                PyErr_CheckSignals()  # a handler may raise; else try again
                continue
            raise zmq.ZMQError(code)  # a part missing from the middle of a message: never seen
        if prop is not None and not parts:
            found = zmq_msg_gets(cython.address(msg), prop)
            value = (PyUnicode_DecodeUTF8(found, strlen(found), b"replace")
                     if found != cython.NULL else "")
        more = zmq_msg_more(cython.address(msg))
        size = zmq_msg_size(cython.address(msg))
        if size < _COPY_BELOW and not writable:
            parts.append(PyBytes_FromStringAndSize(
                cython.cast(cython.p_char, zmq_msg_data(cython.address(msg))), size))
            zmq_msg_close(cython.address(msg))
        else:
            part = Part.__new__(Part)
            zmq_msg_init(cython.address(part.msg))
            zmq_msg_move(cython.address(part.msg), cython.address(msg))  # the message itself
            part.size = size
            part.writable = writable
            parts.append(part)
        flags = 0
    return parts if prop is None else (parts, value)


def _send_c(socket, parts, first_flags):
    """Each part as a libzmq message: bytes and other buffers below COPY_BELOW copied, a Part
    shared, anything else (a zmq.Frame, a large buffer) through pyzmq, which keeps it alive
    until libzmq is done with it. libzmq is only ever asked not to wait: a part it cannot queue now
    goes through pyzmq's blocking send, which waits without the GIL and runs signal handlers.
    False if ``first_flags`` has NOBLOCK and the first part was not taken."""
    msg = cython.declare(mw_msg_t)
    handle = cython.declare(cython.p_void,
                            cython.cast(cython.p_void, cython.cast(cython.size_t, _handle(socket))))
    last = cython.declare(cython.Py_ssize_t, len(parts) - 1)
    index = cython.declare(cython.Py_ssize_t, 0)
    flag = cython.declare(cython.int)
    size = cython.declare(cython.Py_ssize_t)
    sent = cython.declare(cython.int)
    copied = cython.declare(cython.int)
    view = cython.declare(Py_buffer)
    for part in parts:
        flag = (_SNDMORE if index < last else 0) | (first_flags if index == 0 else 0)
        sent = 0
        if type(part) is bytes and PyBytes_GET_SIZE(part) < _COPY_BELOW:
            size = PyBytes_GET_SIZE(part)
            if zmq_msg_init_size(cython.address(msg), size) < 0:
                raise MemoryError()
            memcpy(zmq_msg_data(cython.address(msg)), PyBytes_AS_STRING(part), size)
            sent = _sent_now(cython.address(msg), handle, flag)
        elif type(part) is Part:
            zmq_msg_init(cython.address(msg))
            zmq_msg_copy(cython.address(msg), cython.address(cython.cast(Part, part).msg))
            sent = _sent_now(cython.address(msg), handle, flag)
        elif isinstance(part, _FRAME):
            # Through pyzmq, small or not: a copy would leave a tracked frame (the reply ledger's,
            # supervisor/routing/limits.py) done at once, whether the peer read it or not.
            sent = 0
        elif PyObject_CheckBuffer(part):
            # A small buffer (a tensor's memoryview) is copied, as bytes are; a large one goes
            # through pyzmq below, which keeps it alive until libzmq has sent it.
            PyObject_GetBuffer(part, cython.address(view), PyBUF_SIMPLE)
            try:
                if view.len < _COPY_BELOW:
                    if zmq_msg_init_size(cython.address(msg), view.len) < 0:
                        raise MemoryError()
                    memcpy(zmq_msg_data(cython.address(msg)), view.buf, view.len)
                    copied = 1
                else:
                    copied = 0
            finally:
                PyBuffer_Release(cython.address(view))
            if copied:
                sent = _sent_now(cython.address(msg), handle, flag)
        if not sent:
            try:
                socket.send(part, flag, copy=False)  # a Part is a buffer: still no copy
            except zmq.Again:
                if index == 0 and first_flags & _NOBLOCK:
                    return False
                raise
        index += 1
    return True


def _sent_now(msg, handle, flags):
    """1 once libzmq queued the message without waiting; 0, the message closed, if it could not
    queue it now. A signal that interrupts is handled (its handler may raise) and the send tried
    again."""
    rc = cython.declare(cython.int)
    code = cython.declare(cython.int)
    while True:
        rc = zmq_msg_send(msg, handle, flags | _NOBLOCK)
        if rc >= 0:
            return 1
        code = zmq_errno()
        if code == _EINTR:
            try:
                PyErr_CheckSignals()
            except BaseException:
                zmq_msg_close(msg)
                raise
            continue
        zmq_msg_close(msg)
        if code == _EAGAIN:
            return 0
        raise zmq.ZMQError(code)


class Poller:
    """``zmq.Poller`` for what the loops need: items (zmq sockets, descriptors, objects with
    ``fileno()``) registered for reading, and ``poll(timeout_ms)`` answering the list of those
    ready (None waits for ever). A signal that interrupts the wait runs its handler (which may
    raise) and answers an empty list. Uncompiled, pyzmq's zmq_poll does the wait.

    Compiled, the items stay in C arrays between calls (rebuilt only when one comes or goes) and
    the wait is one poll(2) with the GIL released, on each zmq socket's ZMQ_FD (read once, where
    zmq_poll reads it again at every call) and each descriptor. zmq_poll also asks every socket
    for ZMQ_EVENTS on every pass, before and after its wait; here a socket registered ``quiet``
    (one only ever read or written by its own handler, when reported ready) is asked only when
    its descriptor signals, when it was reported ready the time before (its handler may have
    left messages), when a wait runs out, and once every QUIET_CHECK_EVERY polls (so a signal
    lost to anything else that made libzmq process its commands costs a few rounds, never a
    hang). Every other zmq socket is asked on every poll, as zmq_poll does, since the loop
    writes to it between polls (a send may process the commands its descriptor signalled). In
    the supervisor that halves the poll's instructions per request."""

    def __init__(self):
        self.items = []  # registered, in order
        self.quiet = []  # the registered zmq sockets that are quiet
        self.writing = set()  # the registered descriptors also watched for writing
        self.muted = set()  # the registered descriptors not watched for reading (for now)
        self.stale = True  # the C arrays no longer match ``items``
        self.capacity = 0
        self.rounds = 0

    def register(self, item, quiet=False):
        if item not in self.items:
            self.items.append(item)
            self.stale = True
        if quiet and isinstance(item, zmq.Socket) and item not in self.quiet:
            self.quiet.append(item)
            self.stale = True

    def unregister(self, item):
        self.items.remove(item)  # ValueError if it was not registered
        if item in self.quiet:
            self.quiet.remove(item)
        self.writing.discard(item)
        self.muted.discard(item)
        self.stale = True

    def want_write(self, item, wanted):
        """Whether a registered descriptor is reported ready when it can be written too (a
        worker link with bytes waiting: shared/link.py), not only when it can be read."""
        if wanted and item not in self.writing:
            self.writing.add(item)
            self.stale = True
        elif not wanted and item in self.writing:
            self.writing.remove(item)
            self.stale = True

    def want_read(self, item, wanted):
        """Whether a registered descriptor is watched for reading (the default). A client's
        local connection whose replies back up is not read until they are written: its handler
        would not read it, and a level-triggered poll would report it ready at once, for ever.
        A hang-up or an error is reported all the same."""
        if not wanted and item not in self.muted:
            self.muted.add(item)
            self.stale = True
        elif wanted and item in self.muted:
            self.muted.remove(item)
            self.stale = True

    def poll(self, timeout=None):
        timeout = -1 if timeout is None else int(timeout)
        if COMPILED:
            return self._poll_c(timeout)
        keys = [item if isinstance(item, (zmq.Socket, int)) else item.fileno() for item in self.items]
        ready = {key for key, _ in zmq.zmq_poll(
            [(key, (0 if item in self.muted else _POLLIN) | (_POLLOUT if item in self.writing else 0))
             for key, item in zip(keys, self.items)], timeout)}
        return [item for item, key in zip(self.items, keys) if key in ready]

    def _poll_c(self, timeout):
        if self.stale:
            self._fill()
        count = len(self.items)
        items = cython.declare(cython.pointer(mw_item_t), self.c_items)
        fds = cython.declare(cython.pointer(mw_pollfd), self.c_fds)
        self.rounds += 1
        every = self.rounds % QUIET_CHECK_EVERY == 0
        wait = timeout
        deadline = monotonic() + timeout / 1000 if timeout > 0 else 0.0
        while True:
            found = 0
            # The sockets that may hold a message their descriptor did not signal.
            for index in range(count):
                items[index].ready = 0
                if items[index].socket != cython.NULL and (
                        not items[index].quiet or items[index].check or every):
                    items[index].check = 0
                    readable = self._readable(items[index].socket)
                    if readable < 0:
                        return []  # a signal: its handler ran
                    if readable:
                        items[index].ready = 1
                        found += 1
            every = False
            if found:
                wait = 0  # something to do now: only look at the descriptors
            found_before = found  # then a wait of 0 that finds nothing did not run out
            with cython.nogil:
                rc = mw_poll(fds, count, wait)
            if rc < 0:
                code = errno
                if code == _EINTR:
                    PyErr_CheckSignals()
                    return []
                raise OSError(code, os.strerror(code))
            expired = rc == 0 and wait >= 0 and not found_before
            for index in range(count):
                if items[index].ready:
                    continue
                if items[index].socket == cython.NULL:
                    if fds[index].revents:
                        items[index].ready = 1
                        found += 1
                elif fds[index].revents or (expired and items[index].quiet):
                    readable = self._readable(items[index].socket)  # commands processed: fd reset
                    if readable < 0:
                        return []  # a signal: its handler ran
                    if readable:
                        items[index].ready = 1
                        found += 1
            if found or expired:
                break
            # A descriptor signalled with nothing to read (libzmq had other commands): wait
            # again for what is left of the timeout.
            if timeout > 0:
                wait = max(0, int((deadline - monotonic()) * 1000))
        ready = []
        if found:
            for index in range(count):
                if items[index].ready:
                    ready.append(self.items[index])
                    items[index].check = items[index].quiet  # its handler may leave messages
        return ready

    def _readable(self, socket):
        """1 if the zmq socket has a message to read (ZMQ_EVENTS, which also processes the
        commands its descriptor signalled, and so resets it), else 0; -1 if a signal interrupted
        it (libzmq polls its mailbox for that): the signal's handler has run (it may raise), and
        the poll answers an empty list, as zmq_poll does."""
        readable = mw_readable(socket)
        if readable < 0:
            code = zmq_errno()
            if code == _EINTR:
                PyErr_CheckSignals()
                return -1
            raise zmq.ZMQError(code)
        return readable

    def _fill(self):
        """The C arrays from ``items``: a zmq socket by its handle and its ZMQ_FD, anything else
        by its fd. Every quiet socket is asked at the next poll."""
        count = len(self.items)
        if count > self.capacity:
            grown = cython.cast(cython.pointer(mw_item_t),
                                PyMem_Realloc(self.c_items, count * cython.sizeof(mw_item_t)))
            if grown == cython.NULL:
                raise MemoryError()
            self.c_items = grown
            fds = cython.cast(cython.pointer(mw_pollfd),
                              PyMem_Realloc(self.c_fds, count * cython.sizeof(mw_pollfd)))
            if fds == cython.NULL:
                raise MemoryError()
            self.c_fds = fds
            self.capacity = count
        for index in range(count):
            item = self.items[index]
            self.c_items[index].ready = 0
            if isinstance(item, zmq.Socket):
                handle = cython.cast(cython.p_void, cython.cast(cython.size_t, _handle(item)))
                self.c_items[index].socket = handle
                self.c_items[index].quiet = item in self.quiet
                self.c_items[index].check = 1
                fd = mw_socket_fd(handle)
                if fd < 0:
                    raise zmq.ZMQError(zmq_errno())
            else:
                self.c_items[index].socket = cython.NULL
                self.c_items[index].quiet = 0
                self.c_items[index].check = 0
                fd = item if isinstance(item, int) else item.fileno()
            self.c_fds[index].fd = fd
            self.c_fds[index].events = ((0 if item in self.muted else _POLLIN_FD)
                                        | (_POLLOUT_FD if item in self.writing else 0))
            self.c_fds[index].revents = 0
        self.stale = False

    def __dealloc__(self):
        PyMem_Free(self.c_items)
        PyMem_Free(self.c_fds)


QUIET_CHECK_EVERY = 16  # polls between two questions to every quiet socket, come what may


def _bind_libzmq():
    """Find the libzmq pyzmq's extension module uses (sockets.pxd: mw_bind_libzmq)."""
    from zmq.backend.cython import _zmq

    if mw_bind_libzmq(_zmq.__file__.encode()) < 0:
        raise ImportError(f"modelwarden.shared.sockets: libzmq not found through {_zmq.__file__}")
    mw_bind_socket_type(_zmq.Socket)  # -1 (a pyzmq without those getters): read them by name


if COMPILED:
    _bind_libzmq()
