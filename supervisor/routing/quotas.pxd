# C types for supervisor/routing/quotas.py when Cython compiles it (pure-Python mode).

cimport cython

cdef dict _INDEX
cdef Py_ssize_t _REQUESTS, _REQUEST_BYTES


cdef class Quotas:
    cdef public object house
    cdef public dict held
    cdef object _shares
    cdef list _limits

    @cython.locals(held=list, now=cython.Py_ssize_t, index=cython.Py_ssize_t,
                   limit=cython.Py_ssize_t)
    cpdef take(self, object identity, str resource, Py_ssize_t amount=*)
    @cython.locals(held=list, left=cython.Py_ssize_t, index=cython.Py_ssize_t)
    cpdef give_back(self, object identity, str resource, Py_ssize_t amount=*)
    @cython.locals(held=list, requests=cython.Py_ssize_t, request_bytes=cython.Py_ssize_t,
                   limit=cython.Py_ssize_t)
    cpdef take_request(self, object identity, Py_ssize_t nbytes)
    @cython.locals(held=list, requests=cython.Py_ssize_t, request_bytes=cython.Py_ssize_t)
    cpdef give_back_request(self, object identity, Py_ssize_t nbytes)
