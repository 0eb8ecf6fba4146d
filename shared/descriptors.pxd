# C types for shared/descriptors.py when Cython compiles it (pure-Python mode: the .py is the one
# implementation; this file gives the reply cache's lookup C calls into protocol and mpack).

cimport cython

from modelwarden.shared.mpack cimport pack, read_at, value_end, value_span
from modelwarden.shared.protocol cimport frame_lengths_match, read_timing, usable_id

cdef bytes _ID_KEY, _TIMING

cpdef dict inline_desc(object dtype, object shape, object frame)
cpdef dict shm_desc(object dtype, object shape, object region)
cdef Py_ssize_t _ID_AT


cdef class ReplyCache:
    cdef public Py_ssize_t size
    cdef public list entries

    @cython.locals(entries=list, end=cython.Py_ssize_t, first=cython.int, entry_first=cython.int,
                   middle=bytes, count=cython.Py_ssize_t)
    cpdef tuple parse(self, bytes header, list frames)
    @cython.locals(end=cython.Py_ssize_t, key_at=cython.Py_ssize_t, middle=bytes, entries=list)
    cpdef learn(self, bytes header, Py_ssize_t keys, object reply, Py_ssize_t count)
