# C types for supervisor/routing/quotas.py when Cython compiles it (pure-Python mode).

cimport cython

cdef dict _INDEX


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
