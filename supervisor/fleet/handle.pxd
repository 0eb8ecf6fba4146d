# C types for supervisor/fleet/handle.py when Cython compiles it (pure-Python mode: the .py is
# the one implementation; this file only makes WorkerHandle an extension type with C fields).

from modelwarden.shared.link cimport Link


cdef class WorkerHandle:
    cdef public Link link
    cdef public object spec, process, on_state, state, ready_at, promoted_at, latencies_us
    cdef public object failure, retiring, rss_bytes, rss_samples, cuda_bytes, request_limit
    cdef public object probe, drain_deadline, kill_timer, exitcode, buffer_socket, pool
    cdef public dict inflight
    cdef public object info
    cdef public set buffers
    cdef public long pid, sentinel
    cdef public double started_at, last_seen, last_dispatch
    cdef public long long served, errors
    cdef public bint stop_sent, authenticated
