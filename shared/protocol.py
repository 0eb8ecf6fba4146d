"""modelwarden wire protocol, version 1.

This docstring is the specification; ``docs/PROTOCOL.md`` repeats it with worked examples.
The module imports nothing else of ours, so any client may vendor it.

Transport
=========
ZeroMQ. The daemon binds a ROUTER socket on each *frontend* endpoint (``ipc://`` or ``tcp://``)
and another on the *control* endpoint. A client connects a DEALER (many requests in flight) or a
REQ socket (one at a time). Every message is a multipart message::

    [ "" ]          optional empty delimiter frame; REQ sockets add it. A reply mirrors it.
    "MWP1"          signature: protocol name and version (4 bytes, ASCII)
    header          one msgpack map (see below), at most MAX_HEADER_BYTES
    payload 0..n-1  raw tensor bytes, one frame per *inline* tensor, in descriptor order

The ROUTER adds (and strips) the peer's routing id in front; a client never sees it.

Header of a request
===================
Every request header has ``type`` (str) and ``id`` (int or str of at most 128 bytes, chosen by
the client, echoed in the reply; a client drops replies whose id it no longer waits for).

``infer``: run a model::

    {"type": "infer", "id": 7, "model": "mlp",
     "inputs": TREE, "tensors": [DESC, ...],
     "timeout_ms": 5000,                 # optional; the model's default otherwise
     "out": [TOKEN, 0, 1048576]}         # optional shared-memory region for outputs

``hello``: ask what the daemon offers (protocol version, models, shared memory: whether it is
enabled, the size threshold, and ``channel``, the path of the buffer channel).

On the control endpoint: ``status``. On the admin endpoint also ``restart`` (``{"target":
"mlp"}`` or a worker id), ``reload``, ``scale`` (``{"model": "mlp", "workers": 3}``) and ``stop``
(the daemon, or with a ``target`` a model's or a worker's workers).

Tensors
=======
TREE says how tensors nest: an int ``i`` is ``tensors[i]``; an array is a list; ``{"tuple":
[...]}`` is a tuple; ``{"dict": {"name": TREE}}`` is a dict of named tensors. At most
MAX_TREE_DEPTH levels and MAX_TENSORS tensors. Every tensor is used exactly once.

DESC describes one tensor; exactly one of ``frame`` and ``shm`` is present::

    {"dtype": "float32", "shape": [2, 64], "frame": 0}
    {"dtype": "float32", "shape": [4096, 4096], "shm": [TOKEN, OFFSET, NBYTES]}

``dtype`` is a key of DTYPES. ``shape`` lists non-negative ints (``[]`` is a 0-d scalar). Bytes
are C-contiguous, little-endian; bool is one byte 0/1; bfloat16 is the upper half of a float32.
An inline tensor's frame holds exactly ``prod(shape) * itemsize`` bytes; the inline descriptors
number their frames 0, 1, 2... in order. A shared-memory tensor lies at ``OFFSET`` in the
buffer that ``TOKEN`` names, and ``NBYTES`` equals ``prod(shape) * itemsize``.

Shared memory
=============
Only on ``ipc://`` frontends. A buffer is a sealed memfd the client registered on the buffer
channel (``shared/fdchannel.py`` specifies it); the channel answered a TOKEN (32 lowercase hex
digits) for it. A token is a capability: any connection presenting it may use the buffer, while
the channel connection that registered it stays open. Regions are checked against the buffer's
size before any worker sees them. The worker maps the buffer, reads inputs in place and writes
outputs once: into the request's ``out`` region when they fit, otherwise inline. An output that
*is* (a view of) an input comes back as a descriptor into that input's region, as it would be
in-process.

Reply
=====
Success::

    {"id": 7, "ok": true, "outputs": TREE, "tensors": [DESC, ...], "worker": "mlp#1",
     "version": "3f9a1c0b7e2d", "timing": {"queue_us": 12, "compute_us": 230, "total_us": 410}}

Failure (no payload frames)::

    {"id": 7, "ok": false, "error": {"code": "BAD_INPUT", "message": "..."}}

An error may carry ``"detail"``: ``"buffer_not_registered"`` means a descriptor named a token the
daemon does not know, or no longer honours (its channel connection closed, for instance because
the daemon restarted): register the buffers again on a new channel connection and resend.

``id`` is null when the request's header could not be read. Every accepted request gets
exactly one reply. Error codes are ERROR_CODES below.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgpack

SIGNATURE = b"MWP1"
PROTOCOL_VERSION = 1

# -- error codes: the whole set a client may see -------------------------------------------------
BAD_REQUEST = "BAD_REQUEST"
BAD_INPUT = "BAD_INPUT"
UNKNOWN_MODEL = "UNKNOWN_MODEL"
NO_WORKER = "NO_WORKER"
MODEL_ERROR = "MODEL_ERROR"
OUT_OF_MEMORY = "OUT_OF_MEMORY"
WORKER_DIED = "WORKER_DIED"
POISON = "POISON"
TIMEOUT = "TIMEOUT"
OVERLOADED = "OVERLOADED"
SHUTTING_DOWN = "SHUTTING_DOWN"
INTERNAL = "INTERNAL"

ERROR_CODES: dict[str, str] = {
    BAD_REQUEST: "the message is malformed: framing, header schema, descriptors, buffers",
    BAD_INPUT: "well formed, but the tensors disagree with the model's declared inputs, "
    "or hold NaN/Inf where the model rejects them",
    UNKNOWN_MODEL: "no model of that name is configured",
    NO_WORKER: "every worker slot of the model is FATAL or stopped; nothing serves it until a "
               "restart (or its fatal_retry)",
    MODEL_ERROR: "the model raised an exception; the worker stays up",
    OUT_OF_MEMORY: "the model ran out of (GPU) memory on this input; that worker is replaced "
                   "(its other requests are answered first)",
    WORKER_DIED: "the worker died while holding the request and retries are off or spent",
    POISON: "the request was in flight on two workers that both died; it is not retried again",
    TIMEOUT: "the request's deadline passed before an answer",
    OVERLOADED: "a queue or byte limit is full (the message names it); retry later",
    SHUTTING_DOWN: "the daemon is stopping and takes no new work",
    INTERNAL: "a bug in modelwarden; the daemon's log has the details",
}

# -- dtypes: name -> itemsize in bytes ----------------------------------------------------------
DTYPES: dict[str, int] = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "complex64": 8,
    "complex128": 16,
}

# -- limits: every bound a hostile peer could push on -------------------------------------------
MAX_HEADER_BYTES = 256 * 1024
MAX_ID_BYTES = 128
MAX_NAME_BYTES = 256
MAX_TENSORS = 1024
MAX_DIMS = 32
MAX_TREE_DEPTH = 16
MAX_BUFFERS_PER_MESSAGE = 256
MAX_TENSOR_BYTES = 1 << 48  # no machine has this much memory; keeps all arithmetic small
MAX_INT = (1 << 63) - 1

TOKEN_RE = re.compile(r"[0-9a-f]{32}")

class _MapKeyError(ValueError):
    """A map key that is not a str, or a key that appears twice in one map."""


def _strict_map(pairs: list) -> dict:
    # msgpack accepts bin keys (b"type" beside "type") and keeps the last of duplicate keys; a
    # peer could then show one value to a validator and another to a consumer. Refuse both.
    header = dict(pairs)
    if len(header) != len(pairs):
        raise _MapKeyError("a map repeats a key")
    for key in header:
        if type(key) is not str:
            raise _MapKeyError("map keys must be strings")
    return header


_UNPACK_LIMITS = dict(
    max_str_len=MAX_HEADER_BYTES,
    max_bin_len=MAX_ID_BYTES,
    max_array_len=4 * MAX_TENSORS,
    max_map_len=4 * MAX_TENSORS,
    max_ext_len=0,
    raw=False,
    strict_map_key=True,
    use_list=True,
)
_STRICT_UNPACK_LIMITS = dict(_UNPACK_LIMITS, object_pairs_hook=_strict_map)


# -- error details: machine-readable refinements of a code, for clients to act on -------------
BUFFER_NOT_REGISTERED = "buffer_not_registered"  # register the buffers again, then resend


class ProtocolError(Exception):
    """A message we cannot accept; ``code`` is one of ERROR_CODES, ``detail`` an optional
    refinement a client can act on (BUFFER_NOT_REGISTERED)."""

    def __init__(self, code: str, message: str, detail: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.detail = detail


def bad(message: str) -> ProtocolError:
    return ProtocolError(BAD_REQUEST, message)


# -- backend message types ----------------------------------------------------------------------
# The supervisor <-> worker messages (internal; worker/serve.py's docstring is their spec). Both
# sides name them by these constants, never by literals.
RUN = "run"            # supervisor -> worker: one request, or the probe
BATCH = "batch"        # supervisor -> worker: several requests for one forward pass
FORGET = "forget"      # supervisor -> worker: unmap revoked client buffers
STOP = "stop"          # supervisor -> worker: exit 0
PROMOTE = "promote"    # supervisor -> standby worker: take a slot (its id, cores, threads), go READY
HELLO = "hello"        # worker -> supervisor: the spawn secret, first
STATE = "state"        # worker -> supervisor: LOADING, WARMING, READY
FAILED = "failed"      # worker -> supervisor: why it could not start
HEARTBEAT = "heartbeat"
RESULT = "result"      # worker -> supervisor: one request's answer


# -- framing ------------------------------------------------------------------------------------


def pack(header: dict) -> bytes:
    return msgpack.packb(header, use_bin_type=True)


def add_to_map(packed, key: str, value: Any) -> bytes:
    """A packed map with one more entry, without decoding it: the supervisor adds ``timing`` to
    the reply header a worker wrote. ``key`` must not be in the map already."""
    first = packed[0]
    if 0x80 <= first < 0x8F:  # a fixmap with room for one more entry
        return b"".join((bytes((first + 1,)), packed[1:], pack(key), pack(value)))
    header = unpack_header(packed, strict=False)
    header[key] = value
    return pack(header)


def unpack_header(buf, strict: bool = True) -> dict:
    """Decode one header frame with hard limits; never trusts its size or shape.

    ``strict`` also refuses non-str map keys and repeated keys; it costs a Python call per map,
    so headers a strict parse already accepted (the client header the supervisor forwards to a
    worker, unchanged) and messages between the daemon's own processes skip it."""
    if len(buf) > MAX_HEADER_BYTES:
        raise bad(f"header frame of {len(buf)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(buf, **(_STRICT_UNPACK_LIMITS if strict else _UNPACK_LIMITS))
    except _MapKeyError as exc:
        raise bad(f"header is not acceptable: {exc}") from None
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise bad(f"header is not valid msgpack ({type(exc).__name__})") from None
    if not isinstance(header, dict):
        raise bad("header must be a msgpack map")
    return header


@dataclass(slots=True)
class Envelope:
    """A ROUTER-side message split into its parts; ``route`` is what a reply is sent back to."""

    route: list
    header: Any  # the raw header frame
    payload: list


def split_router_message(frames: list) -> Envelope:
    """[routing-id, ("")?, SIGNATURE, header, payload...] -> Envelope, or ProtocolError.

    On error the caller still replies to ``frames[0]`` (and the delimiter, if any).
    """
    route = reply_route(frames)
    body = frames[len(route):]
    if len(body) < 2:
        raise bad("expected signature and header frames")
    if bytes(body[0]) != SIGNATURE:
        raise bad("bad signature frame: expected b'MWP1'")
    return Envelope(route, body[1], body[2:])


def reply_route(frames: list) -> list:
    """The routing prefix of a (possibly malformed) ROUTER message: id, plus delimiter if sent."""
    return frames[:2] if len(frames) > 1 and len(frames[1]) == 0 else frames[:1]


def error_header(request_id: Any, code: str, message: str, detail: str | None = None) -> dict:
    error = {"code": code, "message": message}
    if detail is not None:
        error["detail"] = detail
    return {"id": request_id, "ok": False, "error": error}


# -- header fields ------------------------------------------------------------------------------


def _is_int(value: Any) -> bool:
    return type(value) is int  # bool is an int subclass: reject it explicitly


def request_id_of(header: dict) -> Any:
    """The client's id if it is usable, else None (replies still go out, with a null id)."""
    rid = header.get("id")
    if _is_int(rid) and -MAX_INT <= rid <= MAX_INT:
        return rid
    if isinstance(rid, str) and len(rid.encode()) <= MAX_ID_BYTES:
        return rid
    return None


def require_id(header: dict) -> Any:
    rid = request_id_of(header)
    if rid is None:
        raise bad("'id' must be an int or a str of at most 128 bytes")
    return rid


def require_str(header: dict, key: str, max_bytes: int = MAX_NAME_BYTES) -> str:
    value = header.get(key)
    if not isinstance(value, str) or not value or len(value.encode()) > max_bytes:
        raise bad(f"'{key}' must be a non-empty string of at most {max_bytes} bytes")
    return value


def require_uint(value: Any, what: str, limit: int = MAX_INT) -> int:
    if not _is_int(value) or value < 0 or value > limit:
        raise bad(f"{what} must be an integer in [0, {limit}]")
    return value


# -- tensors ------------------------------------------------------------------------------------


class TensorDesc(NamedTuple):
    """A checked descriptor. A NamedTuple: the hot path builds one per tensor per hop."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    frame: int | None = None
    shm: tuple[str, int, int] | None = None  # (token, offset, nbytes)


def tensor_nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    """prod(shape) * itemsize, refusing anything above MAX_TENSOR_BYTES at every step.

    A zero dimension makes the tensor empty but not harmless: ``[0, 2**48, 2**48]`` holds no
    bytes, yet a worker asked to build it overflows its element count. So the bound is checked
    on the product of the non-zero dimensions too."""
    itemsize = DTYPES[dtype]
    total, extent = itemsize, itemsize
    for dim in shape:
        total *= dim
        extent *= dim or 1
        if extent > MAX_TENSOR_BYTES:
            raise bad(f"tensor of shape {list(shape)} and dtype {dtype} exceeds {MAX_TENSOR_BYTES} bytes"
                      + (" (counting its non-zero dimensions)" if total <= MAX_TENSOR_BYTES else ""))
    return total


def parse_shape(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > MAX_DIMS:
        raise bad(f"{what}: 'shape' must be a list of at most {MAX_DIMS} ints")
    for dim in value:  # checked inline: this runs for every tensor of every request and reply
        if type(dim) is not int or not 0 <= dim <= MAX_TENSOR_BYTES:
            require_uint(dim, f"{what}: every dimension", MAX_TENSOR_BYTES)  # raises
    return tuple(value)


def parse_token(value: Any, what: str) -> str:
    # The message never echoes the value: a token is a secret (Triton's CVEs leaked names).
    if not isinstance(value, str) or not TOKEN_RE.fullmatch(value):
        raise bad(f"{what}: a buffer token is 32 lowercase hex digits")
    return value


def parse_region(value: Any, what: str) -> tuple[str, int, int]:
    if not isinstance(value, list) or len(value) != 3:
        raise bad(f"{what}: a region is [token, offset, nbytes]")
    token = parse_token(value[0], what)
    offset = require_uint(value[1], f"{what}: offset")
    nbytes = require_uint(value[2], f"{what}: nbytes")
    return token, offset, nbytes


def parse_tensor_desc(value: Any, index: int, next_frame: int) -> TensorDesc:
    what = f"tensor {index}"
    if not isinstance(value, dict):
        raise bad(f"{what}: descriptor must be a map")
    dtype = value.get("dtype")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise bad(f"{what}: unknown dtype {str(dtype)[:32]!r}; known: {', '.join(DTYPES)}")
    shape = parse_shape(value.get("shape"), what)
    nbytes = tensor_nbytes(dtype, shape)
    has_frame, has_shm = "frame" in value, "shm" in value
    if has_frame == has_shm:
        raise bad(f"{what}: exactly one of 'frame' and 'shm' is required")
    if has_frame:
        if value["frame"] != next_frame or not _is_int(value["frame"]):
            raise bad(f"{what}: inline tensors must number their frames 0, 1, 2... in order")
        return TensorDesc(dtype, shape, nbytes, frame=next_frame)
    region = parse_region(value["shm"], what)
    if region[2] != nbytes:
        raise bad(f"{what}: region holds {region[2]} bytes but dtype x shape needs {nbytes}")
    return TensorDesc(dtype, shape, nbytes, shm=region)


def parse_tensors(value: Any) -> list[TensorDesc]:
    if not isinstance(value, list) or len(value) > MAX_TENSORS:
        raise bad(f"'tensors' must be a list of at most {MAX_TENSORS} descriptors")
    descs: list[TensorDesc] = []
    next_frame = 0
    for index, item in enumerate(value):
        desc = parse_tensor_desc(item, index, next_frame)
        if desc.frame is not None:
            next_frame += 1
        descs.append(desc)
    return descs


def check_tree(tree: Any, n_tensors: int, what: str = "'inputs'") -> None:
    """TREE must use every tensor index exactly once, within the depth limit."""
    seen: set[int] = set()
    _walk_tree(tree, n_tensors, seen, 0)
    if len(seen) != n_tensors:
        raise bad(f"{what} uses {len(seen)} of {n_tensors} tensors; every tensor exactly once")


def _walk_tree(node: Any, n_tensors: int, seen: set[int], depth: int) -> None:
    if depth > MAX_TREE_DEPTH:
        raise bad(f"tensor tree nests deeper than {MAX_TREE_DEPTH}")
    if _is_int(node):
        if not 0 <= node < n_tensors or node in seen:
            raise bad("tensor tree refers to a missing or repeated tensor index")
        seen.add(node)
    elif isinstance(node, list):
        for child in node:
            _walk_tree(child, n_tensors, seen, depth + 1)
    elif isinstance(node, dict) and len(node) == 1 and isinstance(node.get("tuple"), list):
        for child in node["tuple"]:
            _walk_tree(child, n_tensors, seen, depth + 1)
    elif isinstance(node, dict) and len(node) == 1 and isinstance(node.get("dict"), dict):
        for key, child in node["dict"].items():
            if not isinstance(key, str) or len(key.encode()) > MAX_NAME_BYTES:
                raise bad("tensor names must be strings of at most 256 bytes")
            _walk_tree(child, n_tensors, seen, depth + 1)
    else:
        raise bad("tensor tree nodes are ints, lists, {'tuple': [...]} or {'dict': {...}}")


@dataclass(slots=True)
class InferRequest:
    id: Any
    model: str
    tree: Any
    tensors: list[TensorDesc]
    timeout_ms: int | None
    out: tuple[str, int, int] | None

    def buffers(self) -> set[str]:
        """The tokens this request references."""
        tokens = {desc.shm[0] for desc in self.tensors if desc.shm is not None}
        if self.out is not None:
            tokens.add(self.out[0])
        return tokens


def parse_infer(header: dict, n_frames: int) -> InferRequest:
    """Validate an ``infer`` header against the payload frame count; no payload is read."""
    rid = require_id(header)
    model = require_str(header, "model")
    tensors = parse_tensors(header.get("tensors"))
    check_tree(header.get("inputs"), len(tensors))
    inline = sum(1 for desc in tensors if desc.frame is not None)
    if inline != n_frames:
        raise bad(f"{inline} inline tensors but {n_frames} payload frames")
    timeout_ms = header.get("timeout_ms")
    if timeout_ms is not None:
        timeout_ms = require_uint(timeout_ms, "'timeout_ms'", 7 * 24 * 3600 * 1000)
    out = header.get("out")
    if out is not None:
        out = parse_region(out, "'out'")
    return InferRequest(rid, model, header.get("inputs"), tensors, timeout_ms, out)


def frame_lengths_match(tensors: list[TensorDesc], payload: list) -> None:
    """An inline frame must hold exactly dtype x shape bytes: checked by length, never read."""
    for desc in tensors:
        if desc.frame is not None and len(payload[desc.frame]) != desc.nbytes:
            raise bad(
                f"frame {desc.frame} holds {len(payload[desc.frame])} bytes but "
                f"{desc.dtype}{list(desc.shape)} needs {desc.nbytes}"
            )
