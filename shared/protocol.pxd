# C types for shared/protocol.py when Cython compiles it (pure-Python mode: the .py is the one
# implementation; this file says which classes are extension types and which functions the
# request path calls the C way, from this module and from those that cimport it).

cimport cython
from cpython.bytes cimport (PyBytes_AS_STRING, PyBytes_FromObject, PyBytes_FromStringAndSize,
                            PyBytes_GET_SIZE)
from libc.string cimport memcmp, memcpy

cimport modelwarden.shared.mpack as mpack
from modelwarden.shared.mpack cimport (pack as pack_value, pack_keyed, pack_uint, read_at,
                                       uint_at, unpack as read_msgpack, value_end, value_span)

cdef list _FIXMAPS
cdef bytes _TIMING_KEY, _COMPUTE_KEY, _TOTAL_KEY, _BATCH_KEY
cdef tuple _COUNT_KEYS
cdef Py_ssize_t _MAX_STR, _MAX_BIN, _MAX_ENTRIES
cdef list _TENSOR_NAMES
cdef dict _DTYPES
cdef object _ABSENT


cdef class Envelope:
    cdef public object route, header, payload


cdef class InferRequest:
    cdef public object id, model, tree, tensors, timeout_ms, out
    cdef public dict derived
    cpdef object buffers(self)


cdef class InferCache:
    cdef public Py_ssize_t size, count
    cdef public dict groups
    cdef public list lengths

    @cython.locals(length=cython.Py_ssize_t, end=cython.Py_ssize_t, tail=cython.Py_ssize_t,
                   group=list, suffix=bytes, inline=cython.Py_ssize_t, parsed=InferRequest)
    cpdef InferRequest parse(self, object header, Py_ssize_t n_frames)
    cpdef learn(self, object header, InferRequest parsed, Py_ssize_t n_frames)


cdef bint _holds_at(bytes data, Py_ssize_t start, bytes expected) noexcept
@cython.locals(request=InferRequest)
cdef InferRequest _with_id(InferRequest parsed, object rid)
cpdef object unpack_header(object buf, bint strict=*)
cpdef bytes pack(object header)
cpdef tuple reply_parts(object frames)
cpdef bytes reply_header(object client_id, object tree, object tensors, object worker,
                         object version)
cpdef bytes infer_header(object rid, object model, object tree, object tensors, object timeout_ms,
                         object out=*)
@cython.locals(route=list, body=list)
cpdef Envelope split_router_message(object frames)
cpdef list reply_route(object frames)
cpdef bint _is_int(object value)
cpdef object request_id_of(dict header)
cpdef object usable_id(object rid)
cpdef object require_id(dict header)
cpdef object require_str(dict header, object key, Py_ssize_t max_bytes=*)
cpdef object require_uint(object value, object what, object limit=*)
cpdef object _desc(object dtype, object shape, object nbytes, object frame, object shm, object longest)
cpdef object tensor_nbytes(object dtype, object shape)
cpdef tuple parse_shape(object value, object what)
cpdef tuple parse_region(object value, object what)
@cython.locals(fields=dict, elements=cython.bint)
cpdef object parse_tensor_desc(object value, Py_ssize_t index, Py_ssize_t next_frame)
@cython.locals(descs=list, next_frame=cython.Py_ssize_t, index=cython.Py_ssize_t)
cpdef list parse_tensors(object value)
@cython.locals(seen=set)
cpdef check_tree(object tree, Py_ssize_t n_tensors, object what=*)
cdef _walk_tree(object node, Py_ssize_t n_tensors, set seen, int depth)
@cython.locals(inline=cython.Py_ssize_t, tensors=list)
cpdef InferRequest parse_infer(dict header, Py_ssize_t n_frames)
cpdef frame_lengths_match(object tensors, object payload)
@cython.locals(first=cython.int)
@cython.locals(entry=cython.uchar[96], end=cython.Py_ssize_t, size=cython.Py_ssize_t,
               data=cython.p_char)
cpdef bytes add_timing(object packed, object queue_us, object compute_us, object total_us, object batch)
cdef bint _is_count(object value) except -1
@cython.locals(pos=cython.Py_ssize_t)
cdef Py_ssize_t _put_timing(unsigned char *data, unsigned long long queue_us,
                            unsigned long long compute_us, unsigned long long total_us,
                            unsigned long long batch) noexcept
@cython.locals(size=cython.Py_ssize_t)
cdef Py_ssize_t _put_bytes(unsigned char *data, Py_ssize_t pos, bytes value) noexcept
cdef Py_ssize_t _TIMING_ROOM
cdef bint COMPILED
@cython.locals(counts=list)
cpdef object read_timing(bytes packed, Py_ssize_t start)
@cython.locals(end=cython.Py_ssize_t, counts=list, key=bytes)
cdef list _counts_after(bytes data, Py_ssize_t pos, tuple keys)
cdef bytes _bytes_of(object frame)
cdef tuple _RESULT_KEYS, _INFER_KEYS, _REPLY_KEYS
cdef bytes _keyed_map(tuple names, tuple keys, tuple values)
cdef dict _RESULT_MAP
@cython.locals(counts=list, header=dict)
cpdef object read_result(object packed)
cpdef bytes result_header(object rid, object compute_us, object batch)
