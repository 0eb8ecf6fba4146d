# C types for supervisor/routing/limits.py when Cython compiles it (pure-Python mode).

cimport cython

cdef class RequestBytes:
    cdef public Py_ssize_t per_connection, total_cap, total
    cdef public dict by_connection

    @cython.locals(held=cython.Py_ssize_t)
    cpdef take(self, object connection, Py_ssize_t nbytes)
    @cython.locals(held=cython.Py_ssize_t)
    cpdef give_back(self, object connection, Py_ssize_t nbytes)


cdef class _Backlog:
    cdef public Py_ssize_t sent, written, untracked, idle_sweeps
    cdef public object trackers
    cdef public bint refusing

    @cython.locals(before=cython.Py_ssize_t)
    cpdef Py_ssize_t settle(self) except? -1


cdef class ReplyLedger:
    cdef public Py_ssize_t per_connection, total_cap, total, refusing
    cdef public dict backlogs
    cdef public set uncapped

    @cython.locals(backlog=_Backlog, unread=cython.Py_ssize_t, fresh=bint)
    cpdef prepare(self, object connection, list parts, Py_ssize_t nbytes)


@cython.locals(total=cython.Py_ssize_t)
cpdef Py_ssize_t payload_bytes(object frames) except -1
@cython.locals(total=cython.Py_ssize_t)
cpdef check_message(list frames, Py_ssize_t max_bytes)
