# C types for supervisor/routing/batching.py when Cython compiles it (pure-Python mode: the .py
# is the one implementation; this file only gives its names C types, so that the router calls
# the per-dispatch rules the C way).

cimport cython

from modelwarden.shared.protocol cimport InferRequest
from modelwarden.supervisor.routing.requests cimport Request

cdef Py_ssize_t SCAN_LIMIT

@cython.locals(known=tuple)
cpdef object signature(InferRequest parsed, object config, bint handler=*)

@cython.locals(head=Request, request=Request, members=list, max_size=cython.Py_ssize_t,
               max_rows=cython.Py_ssize_t, rows=cython.Py_ssize_t, scanned=cython.Py_ssize_t)
cpdef list pick(object queue, object config)

@cython.locals(count=cython.Py_ssize_t, size=cython.Py_ssize_t)
cpdef remove(object queue, list members)


cdef class BatchStats:
    cdef public Py_ssize_t batches, requests, largest
    cdef public object histogram

    cpdef record(self, Py_ssize_t size)
