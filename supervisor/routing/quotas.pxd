# C types for supervisor/routing/quotas.py when Cython compiles it (pure-Python mode).

cimport cython

cdef class Quotas:
    cdef public object house
    cdef public dict held
    cdef object _shares
    cdef dict _limits

    @cython.locals(held=dict, now=cython.Py_ssize_t)
    cpdef take(self, object identity, str resource, Py_ssize_t amount=*)
    @cython.locals(held=dict, left=cython.Py_ssize_t)
    cpdef give_back(self, object identity, str resource, Py_ssize_t amount=*)
