# C types for shared/zmtp.py when Cython compiles it (pure-Python mode: the .py is the one
# implementation; this file makes ZmtpLink an extension type, a subclass of the worker link's,
# and declares the C calls of its compiled-only branches).

cimport cython
from cpython.buffer cimport PyBUF_SIMPLE, Py_buffer, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytearray cimport PyByteArray_AS_STRING
from cpython.bytes cimport PyBytes_FromStringAndSize
from libc.string cimport memset

from modelwarden.shared.link cimport Link, _sendmsg_now, mw_iovec, mw_msghdr

cdef bint COMPILED
cdef Py_ssize_t _SMALL_BELOW, _MAX_COMMAND
cdef int _MORE, _LONG, _COMMAND


cdef class ZmtpLink(Link):
    cdef public object socket_type, peer_types, peer_type, frames, held
    cdef public int stage
    cdef public Py_ssize_t message_bytes
    cdef public bint big_more, discarding, delimited, skip_more
    cdef public Py_ssize_t discarded_frames
    cdef public unsigned long long discarded_bytes, skip

    cpdef bint send(self, list parts, bint blocking=*) except -1
    cdef list _framed(self, list parts)
    cdef Py_ssize_t _sendmsg_fast(self, list parts) except? -2
    cdef _big_done(self, list messages)
    @cython.locals(available=Py_ssize_t, data=cython.p_uchar, at=Py_ssize_t, flags=int,
                   size=cython.ulonglong, head=Py_ssize_t, body=bytes)
    cdef _parse(self, list messages)
    cdef unsigned char *_buffer_at(self) noexcept
    cdef _room_for(self, Py_ssize_t size)
    cdef _discard(self, unsigned long long size, bint more)
    @cython.locals(take=cython.ulonglong)
    cdef bint _skip(self, list messages) except -1
    cdef _frame_done(self, object frame, bint more, list messages)
    cdef bint _read_greeting(self) except -1
    cdef _command(self, bytes body)
    cdef _send_command(self, bytes frame)
    cdef _garbage(self, str what)


@cython.locals(value=cython.ulonglong, index=cython.int)
cdef unsigned long long _u64_be(const unsigned char *data, Py_ssize_t at) noexcept
@cython.locals(count=Py_ssize_t, taken=Py_ssize_t, total=Py_ssize_t, written=Py_ssize_t,
               index=Py_ssize_t, size=Py_ssize_t, head=cython.p_uchar, flags=int, shift=cython.int)
cdef Py_ssize_t _zmtp_sendmsg_c(int fd, list parts) except? -2
