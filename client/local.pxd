# C types for client/local.py when Cython compiles it (pure-Python mode): a local connection is
# an extension type, and its calls into its link (shared/link.pxd) are C calls.

from modelwarden.shared.link cimport Link


cdef class LocalConnection:
    cdef public object endpoint, path, inbox, _poll
    cdef object __weakref__  # Client keeps its connections in a WeakSet
    cdef public Link link
    cdef public long long lost
    cdef public bint writing, zmtp

    cpdef bint try_connect(self) except -1
    cpdef connect(self, double deadline)
    cpdef deliver(self, list messages, double deadline)
    cpdef drop(self)
    cpdef bint send(self, list messages) except -1
    cpdef flush(self)
    cpdef list take(self)
    cpdef read(self)
    cpdef object receive(self, double timeout_s)
    cpdef watch_also(self, int fd)
    cpdef set pump(self, object timeout_ms)
    cdef _arrived(self, list messages)
    cdef _follow_queue(self)
    cdef _want_write(self, bint wanted)
    cpdef close(self)
