# C types for supervisor/routing/router.py when Cython compiles it (pure-Python mode: the .py
# is the one implementation; this file only says which of its names are C fields and which of
# its methods are called the C way).

cimport cython

from modelwarden.shared.mpack cimport pack_two_after, pack_uint_arrays
from modelwarden.shared.protocol cimport (Envelope, InferCache, InferRequest, add_timing,
                                          frame_lengths_match, parse_infer, request_id_of)
from modelwarden.shared.sockets cimport send_parts
from modelwarden.supervisor.fleet.handle cimport WorkerHandle
from modelwarden.supervisor.routing.batching cimport pick, remove, signature
from modelwarden.supervisor.routing.deadlines cimport Deadlines
from modelwarden.supervisor.routing.limits cimport ReplyLedger, RequestBytes, payload_bytes
from modelwarden.supervisor.routing.quotas cimport Quotas
from modelwarden.supervisor.routing.requests cimport Request, now_ns
from modelwarden.supervisor.routing.service cimport ModelService
from modelwarden.supervisor.routing.workers cimport (has_room, least_loaded, needs_the_pool,
                                                     probe_due, serves_nothing)

cdef object _READY
cdef bytes _RUN_PREFIX, _BATCH_PREFIX
cdef tuple _BATCH_KEYS


cdef class Router:
    cdef public object host
    cdef Quotas _quotas
    cdef object _clock
    cdef public dict pending, services
    cdef public InferCache parses
    cdef dict _by_pool
    cdef list _wanted
    cdef public list observers
    cdef public Deadlines deadlines
    cdef public RequestBytes request_bytes
    cdef public ReplyLedger replies
    cdef long long _next_rid

    @cython.locals(service=ModelService)
    cpdef ModelService service_of(self, object pool)
    cdef object _new_rid(self)
    @cython.locals(parsed=InferRequest)
    cpdef accept_infer(self, object socket, object connection, Envelope envelope, dict header,
                       object identity=*)
    @cython.locals(request=Request, service=ModelService, queue=object, timeout=cython.double,
                   nbytes=cython.Py_ssize_t, now=cython.double, waiting=cython.bint)
    cpdef accept_parsed(self, object socket, object connection, Envelope envelope,
                        InferRequest parsed, object identity=*)
    cpdef _refuse(self, object socket, Envelope envelope, object request_id, object pool, object exc)
    cpdef tuple _check_regions(self, object frontend, InferRequest parsed)
    @cython.locals(quotas=Quotas)
    cpdef _take_budgets(self, object connection, object identity, Py_ssize_t nbytes)
    @cython.locals(service=ModelService, wanted=list)
    cpdef dispatch_wanted(self)
    @cython.locals(service=ModelService, members=list, now=cython.double, handle=WorkerHandle,
                   request=Request)
    cpdef dispatch(self, object pool)
    cdef _probe_if_due(self, ModelService service, WorkerHandle handle, double now)
    cdef _want(self, ModelService service, object pool)
    cpdef bint _pass_buffers(self, WorkerHandle handle, Request request) except -1
    @cython.locals(parts=list)
    cpdef _send(self, WorkerHandle handle, Request request, double now)
    @cython.locals(parts=list, member=Request, rids=list, counts=list, until=list)
    cpdef _send_batch(self, WorkerHandle handle, list members, double now)
    cpdef on_result(self, object pool, WorkerHandle handle, dict envelope, list frames)
    @cython.locals(service=ModelService, probe=cython.bint, now=cython.double)
    cdef _on_answer(self, object pool, WorkerHandle handle, object rid, object ok, object code,
                    object compute_us, object batch, list frames, dict envelope)
    @cython.locals(start=cython.Py_ssize_t, count=cython.Py_ssize_t, members=list)
    cpdef on_results(self, object pool, WorkerHandle handle, dict envelope, list frames)
    @cython.locals(total_us=cython.longlong, queue_us=cython.longlong)
    cpdef _relay_result(self, WorkerHandle handle, Request request, object ok, object code,
                        object compute_us, object batch, list frames)
    cpdef finish(self, Request request, dict reply)
    @cython.locals(parts=list, quotas=Quotas)
    cpdef _answer(self, Request request, object header, list frames=*, str code=*, dict timing=*)
    cpdef fail(self, Request request, str code, str message)
    cpdef expire(self, Request request)


cdef _mark_sent(WorkerHandle handle, Request request, int batch_size, double now)
cdef long long _until(Request request) except? -1
@cython.locals(members=list)
cdef list _batch_members(dict envelope, Py_ssize_t count)
