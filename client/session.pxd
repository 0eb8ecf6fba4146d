# C types for client/session.py when Cython compiles it (pure-Python mode): a request in flight
# and the session are extension types, so a round trip's calls between the session's steps are
# C calls and their fields C slots.

from modelwarden.shared.codec cimport dtype_name, encode, frame_tensor, from_bytes, unflatten
from modelwarden.shared.descriptors cimport ReplyCache
from modelwarden.shared.protocol cimport infer_header, reply_parts, unpack_header


cdef class Pending:
    cdef public object id, model, keep, regions, tokens, out_token
    cdef public bint numpy_out, details


cdef class Session:
    cdef public object endpoint, offer, arena, threshold, ids, out_guess, _lock
    cdef public ReplyCache replies
    cdef public bint want_shm, copy_outputs

    cpdef object build(self, object model, object inputs, object timeout, bint details=*)
    cdef object _placement(self, Pending pending)
    cdef object _out_region(self, object model, list descs, Pending pending)
    cpdef object split(self, list frames)
    cpdef object read(self, object header, list frames)
    cpdef bint forgotten(self, object reply, Pending pending) except -1
    cpdef object decode(self, Pending pending, object reply, list frames)
    cdef object _tensor(self, object desc, list frames)
    cdef object _learn_out_size(self, Pending pending, list descs)
    cpdef object release(self, Pending pending)


cpdef bint all_numpy(list leaves) except -1
