# C types for supervisor/fleet/slot.py when Cython compiles it (pure-Python mode: the .py is the
# one implementation; this file only makes Slot an extension type with C fields).

cdef class Slot:
    cdef public object current, previous  # WorkerHandles (a test's fakes too), or None
    cdef public object placement, model, state, last_exit, failure, causes, backoff_timer
    cdef public object backoff_until, retry_timer, retry_at, held, fatal_on_exit, promoted_at
    cdef public long index, generation, restarts, start_failures, stale_through
    cdef public long probe_replacements, probe_passes, promotions
