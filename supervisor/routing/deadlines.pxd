# C types for supervisor/routing/deadlines.py when Cython compiles it (pure-Python mode).

cimport cython

cdef class Deadlines:
    cdef public object timers, clock, expire, timer
    cdef public dict lanes
    cdef public list overflow
    cdef public Py_ssize_t live, held
    cdef public double armed_for

    cpdef add(self, object request, double timeout)
    @cython.locals(lane=object)
    cpdef answered(self, object request, double timeout)
