"""A client request while the supervisor holds it, and the rule for what happens when a worker
holding it dies."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from modelwarden.shared.protocol import POISON, WORKER_DIED, BAD_INPUT, ProtocolError

# A request that was in flight on this many workers that all died is poison: it is answered and
# never retried, so one bad input cannot crash-loop a whole pool.
POISON_AFTER_DEATHS = 2


@dataclass(eq=False, slots=True)
class Request:
    rid: int
    socket: Any  # the frontend socket it came in on: the reply goes out there
    route: list  # routing id (+ delimiter) to address the reply
    client_id: Any  # the client's own id, echoed in the reply
    model: str
    header_frame: Any  # forwarded to the worker unchanged
    payload: list  # payload frames, forwarded unchanged (zero-copy)
    received_ns: int
    deadline: float
    timer: Any = None
    worker: Any = None  # the WorkerHandle holding it, if dispatched
    dispatched_ns: int = 0
    deaths: int = 0
    done: bool = False
    connection: Any = None  # (frontend index, routing id): whose byte budgets it counts against
    nbytes: int = 0  # inline payload bytes held until it is answered
    buffers: tuple = ()  # the buffer tokens it references: passed to a worker before it runs
    arrived: float = 0.0  # the supervisor's clock when it was accepted
    batch_key: Any = None  # supervisor.batching.signature: None never shares a forward pass
    rows: int = 0  # its size along the batch dimension
    alone: bool = False  # it was in a batch when its worker died: from now on it runs alone
    queued_under_load: bool = False  # it found no worker with room (or a queue): it may wait
    batch_size: int = 1  # the size of the batch it was last dispatched in
    identity: str = "-"  # whose shares it counts against (supervisor/routing/quotas.py)


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


@dataclass(eq=False, slots=True)
class ProbeRequest:
    """The sentinel's own request: it has no client, only a worker and a start time."""

    rid: int
    worker: Any


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
