# C types for supervisor/routing/intake.py when Cython compiles it (pure-Python mode).

cimport cython

from modelwarden.shared.protocol cimport (Envelope, InferRequest, read_result, reply_route,
                                          request_id_of, split_router_message, unpack_header)
from modelwarden.shared.sockets cimport recv_message, recv_routed, send_parts
from modelwarden.supervisor.routing.identity cimport of_property
from modelwarden.supervisor.routing.limits cimport check_message
from modelwarden.supervisor.fleet.handle cimport WorkerHandle
from modelwarden.supervisor.routing.router cimport Router

cdef int _NOBLOCK
cdef Py_ssize_t DRAIN_MAX


cdef class Intake:
    cdef public object host, clock
    cdef public Router router
    cdef public dict workers
    cdef public object raw, peer
    cdef public tuple connection

    @cython.locals(connection=tuple)
    cpdef drain_clients(self, Py_ssize_t index)
    @cython.locals(envelope=Envelope, parsed=InferRequest)
    cpdef client_message(self, Py_ssize_t index, object sock, list frames, tuple connection,
                         object peer, Py_ssize_t max_bytes)
    cpdef drain_workers(self)
    @cython.locals(handle=WorkerHandle, header=dict)
    cpdef worker_message(self, list frames)
