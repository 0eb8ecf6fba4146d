# C types for worker/pipeline.py when Cython compiles it (pure-Python mode): the pipeline is an
# extension type, so the serving loop's calls into it and its own steps are C calls.

from modelwarden.shared.codec cimport flatten, unflatten


cpdef object _rows(list leaves, int dim)


cdef class Pipeline:
    cdef public object handler, model, batching, padded, keep_length, mask
    cdef public int dim
    cdef public bint bucketed

    cpdef object from_request(self, object tree, list leaves)
    cdef object _member(self, object tree, list leaves)
    cdef object _fit_length(self, list leaves, list names)
    cpdef object run(self, list members)
    cpdef object forward(self, object tree, list tensors)
    cdef object _post(self, object tree, list share)
    cdef bint _builds_mask(self, object member) except -1
