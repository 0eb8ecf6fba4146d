# C types for worker/serve.py when Cython compiles it (pure-Python mode): the serving loop is an
# extension type, so the calls between its steps (a dozen per request) are C calls and its
# fields C slots, not attribute lookups.

from modelwarden.shared.codec cimport encode_leaves, from_bytes
from modelwarden.shared.link cimport Link
from modelwarden.shared.protocol cimport InferCache, reply_header, result_header, unpack_header
from modelwarden.worker.pipeline cimport Pipeline


cdef class SupervisorLink:
    cdef public Link link
    cdef public int fd

    cpdef send(self, dict header, list frames=*)
    cpdef send_parts(self, list parts)
    cpdef list receive(self)


cdef class WorkerServer:
    cdef public Pipeline pipeline
    cdef public SupervisorLink link
    cdef public object spec, device, parent_sentinel, probe_value, segments
    cdef public object stream, pack, worker_id, version, shm_threshold
    cdef public InferCache parses
    cdef public Py_ssize_t served
    cdef public bint reject_nonfinite, on_cpu

    cdef object _loop(self)
    cdef object _handle(self, list frames)
    cdef object _heartbeat(self)
    cdef object _run_alone(self, object rid, bint probe, object until, list frames)
    cdef object _answer_expired(self, object call)
    cdef object _run_call(self, object call)
    cdef object _answer_result(self, object call, object result, object compute_us)
    cdef object _result_parts(self, object call, object result)
    cdef object _send_results(self, list members, object compute_us, object batch)
    cdef object _prepare(self, object rid, list frames)
    cdef object _probe_call(self, object rid)
    cdef object _forward(self, list members)
    cdef object _run_batch(self, dict envelope, list frames)
    cdef object _decode(self, object rid, object request, list payload)
    cdef object _elements(self, object desc, list payload)
    cdef object _on_stream(self)
    cdef object _answer(self, object call, object tree, list leaves, object compute_us)
    cdef object _reply_parts(self, object call, object tree, list leaves)
    cdef object _answer_failure(self, object rid, object client_id, object exc)
    cdef object _failure_parts(self, object rid, object client_id, object exc)
    cdef object _failure_of(self, object rid, object exc)
    cdef object _encode(self, list leaves, object out, list sources)
