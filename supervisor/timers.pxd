# C types for supervisor/timers.py when Cython compiles it (pure-Python mode).

cimport cython


cdef class Timer:
    cdef public double when
    cdef public object callback
    cdef public tuple args
    cdef public bint cancelled


cdef class Timers:
    cdef readonly list _heap  # read by the tests of compaction
    cdef object _order
    cdef Py_ssize_t _cancelled

    cpdef cancel(self, Timer timer)
    cpdef object next_due(self)
    @cython.locals(fired=Py_ssize_t, timer=Timer)
    cpdef Py_ssize_t run_due(self, double now) except -1
