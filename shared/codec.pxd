# C types for shared/codec.py when Cython compiles it (pure-Python mode): only the copy of a
# small inline frame out of a tensor's memory is a C call; everything else stays as Python says.

from cpython.bytes cimport PyBytes_FromStringAndSize

cdef bint COMPILED

cdef bytes _copied(object address, Py_ssize_t nbytes)
