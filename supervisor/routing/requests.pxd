# C types for supervisor/routing/requests.py when Cython compiles it (pure-Python mode: the .py
# is the one implementation; this file only gives its names C types).

from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec

cdef bint COMPILED

cpdef long long now_ns() except? -1


cdef class Request:
    cdef public object rid, socket, route, client_id, model, header_frame, payload
    cdef public object connection, buffers, identity, worker, batch_key
    cdef public long long received_ns, dispatched_ns
    cdef public double deadline, arrived, timeout
    cdef public Py_ssize_t nbytes, rows
    cdef public int deaths, batch_size
    cdef public bint done, alone, queued_under_load


cdef class ProbeRequest:
    cdef public object rid, worker
