"""A client request while the supervisor holds it, and the rule for what happens when a worker
holding it dies."""

from __future__ import annotations

from time import perf_counter_ns
from typing import Any, NamedTuple

from modelwarden.shared.protocol import POISON, WORKER_DIED, BAD_INPUT, ProtocolError

try:
    import cython  # compiled: Cython's own; uncompiled: its shadow module, when installed
except ImportError:
    cython = None  # uncompiled without Cython: only now_ns's compiled branch uses it

# Compiled, this module is an extension (its __file__ a .so): requests.pxd declares now_ns's C call.
COMPILED = not __file__.endswith(".py")

# A request that was in flight on this many workers that all died is poison: it is answered and
# never retried, so one bad input cannot crash-loop a whole pool.
POISON_AFTER_DEATHS = 2


def now_ns() -> int:
    """``time.perf_counter_ns()``, the clock every request's times are read on (on Linux, as
    Python reads it, CLOCK_MONOTONIC); compiled, read with clock_gettime(2) itself, not a call
    of the time module's function (three a request)."""
    if COMPILED:
        now = cython.declare(timespec)
        clock_gettime(CLOCK_MONOTONIC, cython.address(now))
        return now.tv_sec * 1_000_000_000 + now.tv_nsec
    return perf_counter_ns()


class Request:
    """One accepted request, from its arrival to its one answer. Compiled, an extension type
    whose fields are C slots (requests.pxd): the router reads and writes them on every step."""

    def __init__(self, rid, socket, route, client_id, model, header_frame, payload, received_ns,
                 deadline, connection=None, nbytes=0, buffers=(), identity="-"):
        self.rid = rid
        self.socket = socket  # the frontend socket it came in on: the reply goes out there
        self.route = route  # routing id (+ delimiter) to address the reply
        self.client_id = client_id  # the client's own id, echoed in the reply
        self.model = model
        self.header_frame = header_frame  # forwarded to the worker unchanged
        self.payload = payload  # payload frames, forwarded unchanged (zero-copy)
        self.received_ns = received_ns
        self.deadline = deadline
        self.connection = connection  # (frontend index, routing id): whose byte budgets it counts against
        self.nbytes = nbytes  # inline payload bytes held until it is answered
        self.buffers = buffers  # the buffer tokens it references: passed to a worker before it runs
        self.identity = identity  # whose shares it counts against (supervisor/routing/quotas.py)
        self.worker = None  # the WorkerHandle holding it, if dispatched
        self.dispatched_ns = 0
        self.deaths = 0
        self.done = False
        self.arrived = 0.0  # the supervisor's clock when it was accepted
        self.batch_key = None  # supervisor.batching.signature: None never shares a forward pass
        self.rows = 0  # its size along the batch dimension
        self.alone = False  # it was in a batch when its worker died: from now on it runs alone
        self.queued_under_load = False  # it found no worker with room (or a queue): it may wait
        self.batch_size = 1  # the size of the batch it was last dispatched in
        self.timeout = 0.0  # the seconds its deadline was set from (its lane in routing/deadlines.py)


class Refused(NamedTuple):
    """A request answered with an error at intake, before it became a Request: what metrics and
    the access log read of it. ``model`` is "-" unless it names a configured model (a label must
    not take any name a client sends)."""

    client_id: Any
    model: str
    received_ns: int
    rid: str = "-"
    worker: Any = None
    dispatched_ns: int = 0
    batch_size: int = 1


class ProbeRequest:
    """The sentinel's own request: it has no client, only a worker and a start time."""

    def __init__(self, rid, worker):
        self.rid = rid
        self.worker = worker


def after_worker_death(request: Request, retries: int) -> str | None:
    """None to retry the request on another worker, else the error code to answer it with."""
    request.deaths += 1
    request.worker = None
    if request.deaths >= POISON_AFTER_DEATHS:
        return POISON
    if request.deaths > retries:
        return WORKER_DIED
    return None


def check_declared(tree: Any, tensors: list, declared: list | None) -> None:
    """The request's tensors must match the model's declared inputs (count or names, dtype, and
    every static dimension); -1 in a declared shape accepts any size. Raises BAD_INPUT."""
    if not declared:
        return
    pairs = _pair_with_declared(tree, tensors, declared)
    for spec, desc in pairs:
        if desc.dtype != spec.dtype:
            raise ProtocolError(BAD_INPUT, f"input {spec.name!r}: dtype {desc.dtype}, "
                                f"model takes {spec.dtype}")
        if len(desc.shape) != len(spec.shape) or any(
                want not in (-1, got) for want, got in zip(spec.shape, desc.shape)):
            raise ProtocolError(BAD_INPUT, f"input {spec.name!r}: shape {list(desc.shape)}, "
                                f"model takes {list(spec.shape)} (-1 = any)")


def _pair_with_declared(tree: Any, tensors: list, declared: list) -> list:
    names = [spec.name for spec in declared]
    if isinstance(tree, dict) and "dict" in tree:
        given = tree["dict"]
        if set(given) != set(names) or not all(isinstance(v, int) for v in given.values()):
            raise ProtocolError(BAD_INPUT, f"inputs must be named {names}, got {sorted(given)}")
        return [(spec, tensors[given[spec.name]]) for spec in declared]
    items = [tree] if isinstance(tree, int) else (tree if isinstance(tree, list) else tree["tuple"])
    if len(items) != len(declared) or not all(isinstance(item, int) for item in items):
        raise ProtocolError(BAD_INPUT, f"model takes {len(declared)} input tensor(s): {names}")
    return [(spec, tensors[item]) for spec, item in zip(declared, items)]
