# C types for supervisor/routing/workers.py when Cython compiles it (pure-Python mode).

cimport cython

from modelwarden.supervisor.fleet.handle cimport WorkerHandle
from modelwarden.supervisor.fleet.slot cimport Slot

cdef object _READY, _FATAL

@cython.locals(best_suspect=cython.bint, best_load=cython.Py_ssize_t, best_used=cython.double, suspect=cython.bint,
               load=cython.Py_ssize_t, used=cython.double, handle=WorkerHandle, best=WorkerHandle,
               which=cython.int, slot=Slot)
cpdef object least_loaded(object slots, Py_ssize_t limit)
@cython.locals(load=cython.Py_ssize_t)
cpdef bint has_room(WorkerHandle handle, Py_ssize_t limit) except -1
@cython.locals(slot=Slot)
cpdef bint serves_nothing(object slots) except -1
cpdef bint needs_the_pool(WorkerHandle handle) except -1
cpdef bint probe_due(WorkerHandle handle, double now) except -1
