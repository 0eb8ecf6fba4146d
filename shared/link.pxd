# C types for shared/link.py when Cython compiles it (pure-Python mode: the .py is the one
# implementation; this file makes Link an extension type and declares the C calls of its
# compiled-only branches: sendmsg(2) from the parts' own buffers, recv(2) into the read buffer).

cimport cython
from cpython.buffer cimport PyBUF_SIMPLE, Py_buffer, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytearray cimport (PyByteArray_AS_STRING, PyByteArray_FromStringAndSize,
                                PyByteArray_Resize)
from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.exc cimport PyErr_CheckSignals
from libc.string cimport memcpy, memset

cdef extern from "<sys/socket.h>" nogil:
    cdef struct mw_iovec "iovec":
        void *iov_base
        size_t iov_len
    cdef struct mw_msghdr "msghdr":
        void *msg_name
        unsigned int msg_namelen
        mw_iovec *msg_iov
        size_t msg_iovlen
        void *msg_control
        size_t msg_controllen
        int msg_flags
    ssize_t mw_sendmsg "sendmsg"(int, const mw_msghdr *, int)
    ssize_t mw_recv "recv"(int, void *, size_t, int)
    int _DONTWAIT "MSG_DONTWAIT"
    int _NOSIGNAL "MSG_NOSIGNAL"

cdef extern from "<errno.h>":
    int errno_c "errno"

cdef bint COMPILED
cdef Py_ssize_t _COPY_BELOW, _SMALL_BELOW, _FAST_PARTS, _LENGTH, _ALIGN
cdef int _EAGAIN, _EINTR


cdef class Link:
    cdef public object sock, buffer, view, big, whole, out, on_pending, error, max_bytes
    cdef public int fd
    cdef public bint writable, eof, broken
    cdef public Py_ssize_t start, end, read_per_call, taken, max_parts

    cpdef bint send(self, list parts, bint blocking=*) except -1
    cdef list _framed(self, list parts)
    cdef Py_ssize_t _sendmsg_fast(self, list parts) except? -2
    @cython.locals(written=Py_ssize_t)
    cdef _send_fast(self, list parts)
    cpdef bint flush(self) except -1
    @cython.locals(index=Py_ssize_t, total=Py_ssize_t, batch_end=Py_ssize_t, sent=Py_ssize_t,
                   size=Py_ssize_t)
    cdef _write(self, list chunks, bint flushing)
    @cython.locals(size=Py_ssize_t)
    cdef _queue_rest(self, list chunks, Py_ssize_t index, Py_ssize_t sent, bint flushing)
    cdef _gone(self)
    cdef _drop_queue(self)
    @cython.locals(messages=list, more=cython.bint)
    cpdef list receive(self)
    cdef _big_done(self, list messages)
    @cython.locals(kept=Py_ssize_t)
    cdef _make_room(self, Py_ssize_t size)
    @cython.locals(room=Py_ssize_t, got=Py_ssize_t)
    cdef bint _fill(self) except -1
    @cython.locals(got=Py_ssize_t)
    cdef Py_ssize_t _recv_into(self, object target, Py_ssize_t size) except -1
    @cython.locals(got=Py_ssize_t, code=int)
    cdef Py_ssize_t _recv_c(self, object target, Py_ssize_t offset, Py_ssize_t size) except -1
    @cython.locals(available=Py_ssize_t, count=Py_ssize_t, head=Py_ssize_t, body=Py_ssize_t)
    cdef _parse(self, list messages)
    @cython.locals(data=cython.p_uchar, total=Py_ssize_t, index=Py_ssize_t, at=Py_ssize_t,
                   size=Py_ssize_t, parts=list, length=cython.ulonglong, offset=Py_ssize_t,
                   own=bytearray, base=cython.p_char)
    cdef object _split_c(self, Py_ssize_t count, Py_ssize_t head)
    cdef list _split(self, object lengths, Py_ssize_t at)
    cdef _start_big(self, object lengths, Py_ssize_t body)
    @cython.locals(left=Py_ssize_t, room=Py_ssize_t, got=Py_ssize_t, filled=Py_ssize_t)
    cdef bint _read_big(self) except -1
    @cython.locals(grown=Py_ssize_t)
    cdef tuple _big_target(self)
    cdef _big_advance(self, Py_ssize_t count)
    cdef _skip_empty_parts(self)
    cdef list _finish_big(self)
    cdef _garbage(self, str what)


cdef object _bytes_view(object chunk)
@cython.locals(value=cython.ulonglong, index=cython.int)
cdef unsigned long long _u64_at(const unsigned char *data) noexcept
@cython.locals(count=Py_ssize_t, taken=Py_ssize_t, total=Py_ssize_t, written=Py_ssize_t,
               index=Py_ssize_t, code=int)
cdef Py_ssize_t _sendmsg_c(int fd, list parts) except? -2
@cython.locals(written=Py_ssize_t, code=int)
cdef Py_ssize_t _sendmsg_now(int fd, mw_msghdr *message, str what) except -1
@cython.locals(index=cython.int)
cdef void _put_u32(unsigned char *data, unsigned long long value) noexcept
@cython.locals(index=cython.int)
cdef void _put_u64(unsigned char *data, unsigned long long value) noexcept
