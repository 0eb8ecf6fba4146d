# C types for supervisor/routing/workers.py when Cython compiles it (pure-Python mode).

cimport cython

cdef object _READY, _FATAL

@cython.locals(best_suspect=cython.bint, best_load=cython.Py_ssize_t, best_used=cython.double, suspect=cython.bint,
               load=cython.Py_ssize_t, used=cython.double)
cpdef object least_loaded(object slots, Py_ssize_t limit)
cpdef bint has_room(object handle, Py_ssize_t limit) except -1
cpdef bint serves_nothing(object slots) except -1
cpdef bint needs_the_pool(object handle) except -1
cpdef bint probe_due(object handle, double now) except -1
