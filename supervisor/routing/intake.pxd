# C types for supervisor/routing/intake.py when Cython compiles it (pure-Python mode).

cimport cython

from modelwarden.shared.protocol cimport (Envelope, InferRequest, read_result, reply_route,
                                          request_id_of, split_router_message, unpack_header)
from modelwarden.shared.sockets cimport recv_routed, send_parts
from modelwarden.supervisor.routing.identity cimport of_property
from modelwarden.supervisor.routing.limits cimport check_message
from modelwarden.shared.link cimport Link
from modelwarden.supervisor.fleet.handle cimport WorkerHandle
from modelwarden.supervisor.routing.router cimport Router

cdef Py_ssize_t DRAIN_MAX


cdef class Intake:
    cdef public object host, clock
    cdef public Router router
    cdef public object raw, peer
    cdef public tuple connection
    cdef public dict fronts

    @cython.locals(connection=tuple, front=tuple, max_bytes=Py_ssize_t)
    cpdef drain_clients(self, Py_ssize_t index)
    cdef tuple _front(self, Py_ssize_t index)
    @cython.locals(envelope=Envelope, parsed=InferRequest)
    cpdef client_message(self, Py_ssize_t index, object sock, list frames, tuple connection,
                         object peer, Py_ssize_t max_bytes)
    @cython.locals(link=Link)
    cpdef drain_link(self, WorkerHandle handle)
    @cython.locals(header=dict)
    cpdef worker_message(self, WorkerHandle handle, list frames)
