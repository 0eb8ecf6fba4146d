# C types for shared/codec.py when Cython compiles it (pure-Python mode). The steps a round trip
# takes per tensor are cpdef: a call between them, and from the client's session and the
# worker's serve loop (which cimport them), is a C call rather than a Python one; Python callers
# call them as before. Everything else stays as Python says.

from cpython.bytes cimport PyBytes_FromStringAndSize

from modelwarden.shared.descriptors cimport inline_desc, shm_desc

cdef bint COMPILED

cdef bytes _copied(object address, Py_ssize_t nbytes)

cpdef object dtype_name(object dtype)
cpdef object as_tensor(object value)
cpdef object flatten(object value, object leaves, int depth=*)
cpdef object unflatten(object tree, object leaves)
cpdef object from_bytes(object buffer, object dtype, object shape)
cpdef object encode(object value, object place)
cpdef tuple encode_leaves(list leaves, object place)
cpdef object inline_frame(object tensor, Py_ssize_t nbytes, object dtype=*)
cpdef object frame_tensor(object desc, object frames)
