# C types for supervisor/eventloop.py when Cython compiles it (pure-Python mode).

cimport cython

from modelwarden.supervisor.timers cimport Timers


cdef class EventLoop:
    cdef public object poller, clock
    cdef public Timers timers
    cdef public dict handlers

    @cython.locals(handlers=dict)
    cpdef turn(self, object after_round)


cpdef guarded(object handler)
