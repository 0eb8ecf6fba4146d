# C types for supervisor/routing/deadlines.py when Cython compiles it (pure-Python mode).

cimport cython

from modelwarden.supervisor.routing.requests cimport Request

cdef class Deadlines:
    cdef public object timers, clock, expire, timer
    cdef public dict lanes
    cdef public list overflow
    cdef public Py_ssize_t live, held
    cdef public double armed_for

    cpdef add(self, Request request, double timeout)
    @cython.locals(lane=object, head=Request)
    cpdef answered(self, Request request, double timeout)
