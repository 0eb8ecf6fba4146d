# C types for supervisor/routing/service.py when Cython compiles it (pure-Python mode).

from modelwarden.supervisor.routing.batching cimport BatchStats


cdef class ModelService:
    cdef public object name, queue, hold, wanted, config, inputs, batching
    cdef public BatchStats batches
    cdef public Py_ssize_t max_queue, max_inflight, max_delay_us
    cdef public double timeout
    cdef public bint batch_enabled, handler, probes

    cpdef follow(self, object config)
