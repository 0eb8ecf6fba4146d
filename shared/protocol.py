"""modelwarden wire protocol, version 1.

docs/PROTOCOL.md is the specification, the only one: the frames, the header of every message on
the frontend, control and admin sockets and on the buffer channel, the tensor encoding, replies,
error codes and limits, with worked examples; its Appendix A has the internal messages between
the supervisor and its workers. This module holds what both ends must agree on, as constants and
parsers that never assert (``ProtocolError(code, message, detail)``): message types, error codes,
dtypes, limits, header parsing. It imports nothing of ours but shared/mpack.py (the msgpack
reader it decodes headers with), so any client may vendor the two.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import msgpack

try:
    import cython  # compiled: Cython's own; uncompiled: its shadow module, when installed
except ImportError:
    cython = None  # uncompiled without Cython: only add_timing's compiled branch uses it

import modelwarden.shared.mpack as mpack
from modelwarden.shared.mpack import (pack as pack_value, pack_keyed, pack_uint, read_at,
                                      uint_at, unpack as read_msgpack, value_end, value_span)

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
    WORKER_DIED: "the worker died while running the request and retries are off or spent",
    POISON: "the request was running on two workers that both died; it is not retried again",
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
# Variable-length element types beside the fixed dtypes: a payload of uint32 little-endian
# length prefixes, each followed by its element's bytes (KServe's binary BYTES form); "str"
# elements must be valid UTF-8. Their descriptors carry "nbytes" and "longest" (section 5.8).
ELEMENT_TYPES: tuple[str, ...] = ("str", "bytes")

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
MAX_ELEMENTS = 65536  # str/bytes elements in one descriptor
MAX_ELEMENT_BYTES = 64 << 20  # a str/bytes payload, prefixes included
ELEMENT_PREFIX = 4  # bytes of each element's length prefix

TOKEN_RE = re.compile(r"[0-9a-f]{32}")

# What one header may hold, enforced while it is decoded (shared/mpack.py): a str as long as a
# header, a bin as long as an id, and four entries per tensor in any one array or map.
_MAX_STR = MAX_HEADER_BYTES
_MAX_BIN = MAX_ID_BYTES
_MAX_ENTRIES = 4 * MAX_TENSORS


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


# -- frontend message types ---------------------------------------------------------------------
# A client's requests on a frontend (docs/PROTOCOL.md). The control and admin sockets' commands
# ("status", "stop", ...) are named by supervisor/commands.py, which holds both halves of each.
INFER = "infer"         # client -> supervisor: one inference request
CLIENT_HELLO = "hello"  # client -> supervisor: what do you serve (the offer: models, shm, channel)


# -- worker link message types (shared/link.py) -------------------------------------------------
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
RESULTS = "results"    # worker -> supervisor: the answers to every member of one batch


# -- framing ------------------------------------------------------------------------------------


def pack(header: dict) -> bytes:
    """``msgpack.packb(header, use_bin_type=True)``'s bytes. Compiled, written by shared/mpack.py
    (about 7,000 instructions for a request header, where packb makes a Packer and takes 9,000);
    uncompiled, by msgpack-python itself, whose C is faster than mpack's Python writer
    (tests/test_unit_mpack.py holds the two to the same bytes)."""
    if COMPILED:
        return pack_value(header)
    return msgpack.packb(header, use_bin_type=True)


def packer():
    """``pack`` for one loop's use alone: compiled, mpack's (which holds no state); uncompiled,
    msgpack's Packer made once, not at every call as packb does."""
    if COMPILED:
        return pack_value
    return msgpack.Packer(use_bin_type=True).pack


def add_to_map(packed, key: str, value: Any) -> bytes:
    """A packed map with one more entry, without decoding it: the supervisor adds ``timing`` to
    the reply header a worker wrote. ``key`` must not be in the map already."""
    first = packed[0]
    if 0x80 <= first < 0x8F:  # a fixmap with room for one more entry
        return b"".join((_FIXMAPS[first + 1 - 0x80], packed[1:], pack_value(key), pack_value(value)))
    header = unpack_header(packed, strict=False)
    header[key] = value
    return pack(header)


_FIXMAPS = [bytes((0x80 + size,)) for size in range(16)]  # a fixmap's first byte, by size
_TIMING_KEY = pack_value("timing") + b"\x84" + pack_value("queue_us")
_COMPUTE_KEY = pack_value("compute_us")
_TOTAL_KEY = pack_value("total_us")
_BATCH_KEY = pack_value("batch")
_COUNT_KEYS = (_TIMING_KEY, _COMPUTE_KEY, _TOTAL_KEY, _BATCH_KEY)  # what precedes each count
# The timing entry's most bytes: its keys, and four counts of at most 9 bytes each.
_TIMING_ROOM = len(_TIMING_KEY) + len(_COMPUTE_KEY) + len(_TOTAL_KEY) + len(_BATCH_KEY) + 4 * 9
if _TIMING_ROOM > 96:  # the C buffer add_timing writes the entry into (protocol.pxd)
    raise ImportError(f"the timing entry needs {_TIMING_ROOM} bytes; add_timing's buffer has 96")
COMPILED = not __file__.endswith(".py")


def add_timing(packed, queue_us: int, compute_us: Any, total_us: int, batch: Any) -> bytes:
    """``add_to_map(packed, "timing", {"queue_us": ..., "compute_us": ..., "total_us": ...,
    "batch": ...})``, byte for byte, with the keys packed once: every answer gets one. Compiled,
    the entry is written on the C stack and the answer is one new bytes object."""
    first = packed[0]
    if not (0x80 <= first < 0x8F and _is_count(queue_us) and _is_count(compute_us)
            and _is_count(total_us) and _is_count(batch)):
        return add_to_map(packed, "timing", {"queue_us": queue_us, "compute_us": compute_us,
                                             "total_us": total_us, "batch": batch})
    if COMPILED and type(packed) is bytes:
        end = _put_timing(entry, queue_us, compute_us, total_us, batch)
        size = PyBytes_GET_SIZE(packed)
        out = PyBytes_FromStringAndSize(cython.NULL, size + end)
        data = PyBytes_AS_STRING(out)
        memcpy(data, PyBytes_AS_STRING(packed), size)
        memcpy(data + size, entry, end)
        data[0] = first + 1
        return out
    written = bytearray(_TIMING_ROOM)
    end = _put_timing(written, queue_us, compute_us, total_us, batch)
    return b"".join((_FIXMAPS[first + 1 - 0x80], packed[1:], written[:end]))


def _is_count(value: Any) -> bool:
    """What the timing entry holds as a rule: an int in msgpack's unsigned range."""
    return type(value) is int and 0 <= value <= 0xFFFFFFFFFFFFFFFF


def _put_timing(data, queue_us, compute_us, total_us, batch):
    """The ``timing`` key and map, written into ``data`` (compiled: a C buffer of _TIMING_ROOM
    bytes; uncompiled: a bytearray) from its start; where they end."""
    pos = _put_bytes(data, 0, _TIMING_KEY)
    pos = mpack.put_uint(data, pos, queue_us)
    pos = _put_bytes(data, pos, _COMPUTE_KEY)
    pos = mpack.put_uint(data, pos, compute_us)
    pos = _put_bytes(data, pos, _TOTAL_KEY)
    pos = mpack.put_uint(data, pos, total_us)
    pos = _put_bytes(data, pos, _BATCH_KEY)
    return mpack.put_uint(data, pos, batch)


def _put_bytes(data, pos, value):
    """``value`` copied into ``data`` from ``pos``; where it ends."""
    size = len(value)
    if COMPILED:
        memcpy(data + pos, PyBytes_AS_STRING(value), size)
    else:
        data[pos:pos + size] = value
    return pos + size


def read_timing(packed: bytes, start: int) -> dict | None:
    """The ``timing`` entry ``add_timing`` wrote, read back from ``start`` (its key) of
    ``packed``: the map the full decode gives, when the entry ends ``packed`` in that very layout
    and every count is a non-negative int; else None (the caller decodes the whole header)."""
    counts = _counts_after(packed, start, _COUNT_KEYS)
    if counts is None:
        return None
    return {"queue_us": counts[0], "compute_us": counts[1], "total_us": counts[2], "batch": counts[3]}


def _counts_after(data: bytes, pos: int, keys: tuple) -> list | None:
    """The counts in ``data`` from ``pos`` when it holds each of ``keys`` (packed bytes) followed
    by a non-negative int in a form ``pack_uint`` writes, and nothing after; else None."""
    counts = []
    for key in keys:
        if not _holds_at(data, pos, key):
            return None
        pos += len(key)
        end = value_end(data, pos, 0)
        if end < 0:
            return None
        count = uint_at(data, pos, end)
        if count < 0:
            return None
        counts.append(count)
        pos = end
    return counts if pos == len(data) else None


# A worker's success envelope as its loop writes it (worker/serve.py ``_answer``): these keys, in
# this order, each followed by a count.
_RESULT_KEYS = (b"\x85" + pack_value("type") + pack_value(RESULT) + pack_value("rid"),
                pack_value("ok") + pack_value(True) + pack_value("compute_us"),
                pack_value("batch"))


def read_result(packed: Any) -> dict | None:
    """The map the full decode gives of a worker's ``{"type": "result", "rid": ..., "ok": True,
    "compute_us": ..., "batch": ...}`` in that very layout, every count a non-negative int, read
    in place (a quarter of the decode's cost: the supervisor reads one per request); else None,
    and the caller decodes it."""
    if type(packed) is not bytes:
        return None
    counts = _counts_after(packed, 0, _RESULT_KEYS)
    if counts is None:
        return None
    header = _RESULT_MAP.copy()  # a copy of a small dict is a copy of its table: no hashing
    header["rid"] = counts[0]
    header["compute_us"] = counts[1]
    header["batch"] = counts[2]
    return header


_RESULT_MAP = {"type": RESULT, "rid": 0, "ok": True, "compute_us": 0, "batch": 0}


def result_header(rid: Any, compute_us: Any, batch: Any) -> bytes:
    """``pack({"type": "result", "rid": rid, "ok": True, "compute_us": compute_us, "batch":
    batch})``, byte for byte: the worker's header of every success it answers alone, in the
    layout ``read_result`` reads in place, written from its keys packed once."""
    if _is_count(rid) and _is_count(compute_us) and _is_count(batch):
        return b"".join((_RESULT_KEYS[0], pack_uint(rid), _RESULT_KEYS[1], pack_uint(compute_us),
                         _RESULT_KEYS[2], pack_uint(batch)))
    return pack({"type": RESULT, "rid": rid, "ok": True, "compute_us": compute_us,
                 "batch": batch})


def _keyed_map(names: tuple, keys: tuple, values: tuple) -> bytes:
    """``pack(dict(zip(names, values)))``, byte for byte, for at most 15 entries; ``keys`` are
    ``names`` packed once. Compiled, no dict is made and no key is written again
    (mpack.pack_keyed); uncompiled, msgpack packs the dict."""
    if COMPILED:
        return pack_keyed(_FIXMAPS[len(values)], keys[:len(values)], values)
    return pack(dict(zip(names, values)))


# The client's request header, in this order; "out" only when the request has an out region.
_INFER_KEY_NAMES = ("type", "id", "model", "inputs", "tensors", "timeout_ms", "out")
_INFER_KEYS = tuple(pack_value(name) for name in _INFER_KEY_NAMES)


def infer_header(rid: Any, model: Any, tree: Any, tensors: Any, timeout_ms: Any,
                 out: Any = None) -> bytes:
    """``pack({"type": "infer", "id": rid, "model": model, "inputs": tree, "tensors": tensors,
    "timeout_ms": timeout_ms})``, with ``"out": out`` last unless it is None, byte for byte: the
    client's header of every request."""
    values = (INFER, rid, model, tree, tensors, timeout_ms) if out is None else (
        INFER, rid, model, tree, tensors, timeout_ms, out)
    return _keyed_map(_INFER_KEY_NAMES, _INFER_KEYS, values)


# A worker's success reply to the client, in this order (the client's reply cache reads its
# layout: the first key is "id").
_REPLY_KEY_NAMES = ("id", "ok", "outputs", "tensors", "worker", "version")
_REPLY_KEYS = tuple(pack_value(name) for name in _REPLY_KEY_NAMES)


def reply_header(client_id: Any, tree: Any, tensors: Any, worker: Any, version: Any) -> bytes:
    """``pack({"id": client_id, "ok": True, "outputs": tree, "tensors": tensors, "worker":
    worker, "version": version})``, byte for byte: the worker's reply header of every success."""
    return _keyed_map(_REPLY_KEY_NAMES, _REPLY_KEYS, (client_id, True, tree, tensors, worker,
                                                      version))


def unpack_header(buf, strict: bool = True) -> dict:
    """Decode one header frame with hard limits; never trusts its size or shape.

    ``strict`` also refuses non-str map keys and repeated keys (msgpack would keep the last, so a
    validator and a consumer could read two values); it is for what an outsider sends. Headers a
    strict parse already accepted (the client header a worker gets, unchanged) and messages
    between the daemon's own processes are read without it."""
    if len(buf) > MAX_HEADER_BYTES:
        raise bad(f"header frame of {len(buf)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = read_msgpack(buf, strict, _MAX_STR, _MAX_BIN, _MAX_ENTRIES)
    except mpack.NotAcceptable as exc:
        raise bad(f"header is not acceptable: {exc.reason}") from None
    except mpack.Malformed as exc:
        raise bad(f"header is not valid msgpack ({exc.reason})") from None
    if not isinstance(header, dict):
        raise bad("header must be a msgpack map")
    return header


class Envelope:
    """A ROUTER-side message split into its parts; ``route`` is what a reply is sent back to."""

    def __init__(self, route, header, payload):
        self.route = route  # [routing id] or [routing id, b""]
        self.header = header  # the raw header frame
        self.payload = payload  # the payload frames


def split_router_message(frames: list) -> Envelope:
    """[routing-id, ("")?, SIGNATURE, header, payload...] -> Envelope, or ProtocolError.

    On error the caller still replies to ``frames[0]`` (and the delimiter, if any).
    """
    route = reply_route(frames)
    body = frames[len(route):]
    if len(body) < 2:
        raise bad("expected signature and header frames")
    signature = body[0]
    if (signature if type(signature) is bytes else bytes(signature)) != SIGNATURE:
        raise bad("bad signature frame: expected b'MWP1'")
    return Envelope(route, body[1], body[2:])


def reply_route(frames: list) -> list:
    """The routing prefix of a (possibly malformed) ROUTER message: id, plus delimiter if sent."""
    return frames[:2] if len(frames) > 1 and len(frames[1]) == 0 else frames[:1]


def split_reply(frames: list) -> tuple[dict, list]:
    """A reply as a DEALER receives it (an empty delimiter first, or not): its header and its
    payload frames. The one splitter for every client of the daemon: frames are zmq.Frames
    (``copy=False``) or bytes. InternalError when they are not a modelwarden reply."""
    header, payload = reply_parts(frames)
    return unpack_header(header, strict=False), payload


def reply_parts(frames: list) -> tuple[bytes, list]:
    """``split_reply`` but for the header's decoding: its bytes, and the payload frames."""
    start = 1 if frames and len(frames[0]) == 0 else 0
    if len(frames) < start + 2 or _bytes_of(frames[start]) != SIGNATURE:
        from modelwarden.shared.errors import InternalError  # errors imports this module

        raise InternalError("malformed reply from the daemon")
    return _bytes_of(frames[start + 1]), frames[start + 2:]


def _bytes_of(frame: Any) -> bytes:
    """A frame's bytes: the frame itself if it is bytes, else a copy (compiled: straight through
    the buffer protocol, without calling the bytes type, which costs twice as much)."""
    if type(frame) is bytes:
        return frame
    if COMPILED:
        return PyBytes_FromObject(frame)
    return bytes(frame)


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
    return usable_id(header.get("id"))


def usable_id(rid: Any) -> Any:
    """``rid`` if it is an id a reply may echo (an int64, or a str of at most MAX_ID_BYTES),
    else None."""
    if _is_int(rid) and -MAX_INT <= rid <= MAX_INT:
        return rid
    if isinstance(rid, str) and (len(rid) * 4 <= MAX_ID_BYTES or len(rid.encode()) <= MAX_ID_BYTES):
        return rid
    return None


def require_id(header: dict) -> Any:
    rid = request_id_of(header)
    if rid is None:
        raise bad("'id' must be an int or a str of at most 128 bytes")
    return rid


def require_str(header: dict, key: str, max_bytes: int = MAX_NAME_BYTES) -> str:
    value = header.get(key)
    # A char is at most 4 bytes of UTF-8: a short string needs no encoding to be measured.
    if (not isinstance(value, str) or not value
            or (len(value) * 4 > max_bytes and len(value.encode()) > max_bytes)):
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
    longest: int | None = None  # str/bytes: the longest element's bytes; None for fixed dtypes


def _desc(dtype, shape, nbytes, frame, shm, longest):
    """``TensorDesc(...)`` without its Python-level ``__new__`` (the same tuple, made in C)."""
    return tuple.__new__(TensorDesc, (dtype, shape, nbytes, frame, shm, longest))


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


_TENSOR_NAMES = [f"tensor {index}" for index in range(MAX_TENSORS)]  # made once, not per tensor
_DTYPES = DTYPES
_ABSENT = object()  # a key not in a map (None is a value a map may hold)


def parse_tensor_desc(value: Any, index: int, next_frame: int) -> TensorDesc:
    what = _TENSOR_NAMES[index] if 0 <= index < MAX_TENSORS else f"tensor {index}"
    if not isinstance(value, dict):
        raise bad(f"{what}: descriptor must be a map")
    fields = value  # a dict from here on (protocol.pxd types it: its lookups are C calls)
    dtype = fields.get("dtype")
    elements = dtype in ELEMENT_TYPES
    if not isinstance(dtype, str) or (dtype not in _DTYPES and not elements):
        raise bad(f"{what}: unknown dtype {str(dtype)[:32]!r}; known: "
                  f"{', '.join((*DTYPES, *ELEMENT_TYPES))}")
    shape = parse_shape(fields.get("shape"), what)
    longest = None
    if elements:
        nbytes, longest = element_sizes(fields, shape, what)
    else:
        nbytes = tensor_nbytes(dtype, shape)
    frame = fields.get("frame", _ABSENT)
    shm = fields.get("shm", _ABSENT)
    if (frame is _ABSENT) == (shm is _ABSENT):
        raise bad(f"{what}: exactly one of 'frame' and 'shm' is required")
    if frame is not _ABSENT:
        if frame != next_frame or not _is_int(frame):
            raise bad(f"{what}: inline tensors must number their frames 0, 1, 2... in order")
        return _desc(dtype, shape, nbytes, next_frame, None, longest)
    region = parse_region(shm, what)
    if region[2] != nbytes:
        raise bad(f"{what}: region holds {region[2]} bytes but {_needs(dtype)} needs {nbytes}")
    return _desc(dtype, shape, nbytes, None, region, longest)


def _needs(dtype: str) -> str:
    return "its 'nbytes'" if dtype in ELEMENT_TYPES else "dtype x shape"


def element_count(shape: tuple[int, ...], what: str) -> int:
    """prod(shape) of a str/bytes descriptor, refused past MAX_ELEMENTS at every step (a zero
    dimension counted as one, as for tensors: the product stays small however it is ordered)."""
    count, extent = 1, 1
    for dim in shape:
        count *= dim
        extent *= dim or 1
        if extent > MAX_ELEMENTS:
            raise bad(f"{what}: shape {list(shape)} holds more than {MAX_ELEMENTS} str/bytes "
                      "elements")
    return count


def element_sizes(value: dict, shape: tuple[int, ...], what: str) -> tuple[int, int]:
    """(nbytes, longest) of a str/bytes descriptor, checked from the header alone: every
    element needs its 4-byte prefix, the payload stays under MAX_ELEMENT_BYTES, and the longest
    element fits in what the prefixes leave."""
    count = element_count(shape, what)
    nbytes = require_uint(value.get("nbytes"), f"{what}: 'nbytes'")
    longest = require_uint(value.get("longest"), f"{what}: 'longest'")
    if nbytes > MAX_ELEMENT_BYTES:
        raise bad(f"{what}: {nbytes} bytes of str/bytes elements exceed {MAX_ELEMENT_BYTES}")
    prefixes = ELEMENT_PREFIX * count
    if nbytes < prefixes:
        raise bad(f"{what}: {count} elements need at least {prefixes} bytes of length "
                  f"prefixes, 'nbytes' says {nbytes}")
    if longest > nbytes - prefixes:
        raise bad(f"{what}: 'longest' {longest} is more than the {nbytes - prefixes} bytes "
                  "the elements hold")
    return nbytes, longest


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


class InferRequest:
    """A checked infer header (compiled, an extension type: protocol.pxd). ``derived``: what
    the router works out from a header but for its id (its batching signature), remembered;
    every request InferCache parses from one header shares its dict, so that is worked out once
    per header, not once per request."""

    def __init__(self, id, model, tree, tensors, timeout_ms, out, derived=None):
        self.id = id
        self.model = model
        self.tree = tree
        self.tensors = tensors  # [TensorDesc]
        self.timeout_ms = timeout_ms  # int, or None
        self.out = out  # (token, offset, nbytes), or None
        self.derived = {} if derived is None else derived

    def buffers(self) -> "set[str] | frozenset":
        """The tokens this request references (most reference none: no set is made for them)."""
        tokens = None
        for desc in self.tensors:
            if desc.shm is not None:
                if tokens is None:
                    tokens = set()
                tokens.add(desc.shm[0])
        if self.out is not None:
            if tokens is None:
                tokens = set()
            tokens.add(self.out[0])
        return _NO_TOKENS if tokens is None else tokens


_NO_TOKENS = frozenset()


def _holds_at(data: bytes, start: int, expected: bytes) -> bool:
    """``data.startswith(expected, start)`` for ``0 <= start``, compiled without a method call
    (a quarter of the request path's header reading went on them)."""
    if COMPILED:
        return (start + PyBytes_GET_SIZE(expected) <= PyBytes_GET_SIZE(data)
                and memcmp(PyBytes_AS_STRING(data) + start, PyBytes_AS_STRING(expected),
                           PyBytes_GET_SIZE(expected)) == 0)
    return data.startswith(expected, start)


def _with_id(parsed: InferRequest, rid) -> InferRequest:
    """``parsed`` for another ``id``: the same checked request, its fields shared, made without
    a call of ``__init__`` (compiled, a new object and seven C fields set)."""
    request = InferRequest.__new__(InferRequest)
    request.id = rid
    request.model = parsed.model
    request.tree = parsed.tree
    request.tensors = parsed.tensors
    request.timeout_ms = parsed.timeout_ms
    request.out = parsed.out
    request.derived = parsed.derived
    return request


def parse_infer(header: dict, n_frames: int) -> InferRequest:
    """Validate an ``infer`` header against the payload frame count; no payload is read."""
    rid = require_id(header)
    model = require_str(header, "model")
    tensors = parse_tensors(header.get("tensors"))
    check_tree(header.get("inputs"), len(tensors))
    inline = 0
    for desc in tensors:
        if desc.frame is not None:
            inline += 1
    if inline != n_frames:
        raise bad(f"{inline} inline tensors but {n_frames} payload frames")
    timeout_ms = header.get("timeout_ms")
    if timeout_ms is not None:
        timeout_ms = require_uint(timeout_ms, "'timeout_ms'", 7 * 24 * 3600 * 1000)
    out = header.get("out")
    if out is not None:
        out = parse_region(out, "'out'")
    return InferRequest(rid, model, header.get("inputs"), tensors, timeout_ms, out)


class InferCache:
    """``parse_infer(unpack_header(header), n_frames)`` remembered for the headers it was worked
    out for, but for their ``id``. A client sends the same header again and again but for its id
    (the same model, the same shapes, the same timeout), and the parse is a function of the
    header's bytes alone: a header equal byte for byte to one parsed before, but for the bytes of
    its id's value, parses to what that one did, with its own id. So a header is looked up by the
    bytes before its id (``prefix``), its id is read (an int or a str, checked as
    ``request_id_of`` checks it), and the bytes after must be the remembered ``suffix``. Anything
    else -- a header never seen, an id that is not a usable one, another frame count -- is not
    found, and the full parse reads it (and refuses it, saying why). One cache stands for one
    way of parsing (the supervisor's strict one, a worker's lax one): it learns only from that.

    Bounded: at most ``size`` headers of at most ``LONGEST`` bytes; past that it starts afresh
    (a peer sending ever new headers only keeps the cache from helping)."""

    LONGEST = 4096

    def __init__(self, size: int = 64) -> None:
        self.size = size
        self.groups: dict = {}  # prefix -> [(suffix, inline frames, InferRequest)]
        self.lengths: list = []  # the distinct prefix lengths, fewest bytes first
        self.count = 0

    def parse(self, header, n_frames: int) -> "InferRequest | None":
        if type(header) is not bytes or not self.count:
            return None
        for length in self.lengths:
            group = self.groups.get(header[:length])
            if group is None:
                continue
            end = value_end(header, length, MAX_ID_BYTES)
            if end < 0:
                return None
            tail = len(header) - end
            for suffix, inline, parsed in group:
                if len(suffix) == tail and _holds_at(header, end, suffix):
                    if inline != n_frames:
                        return None
                    rid = uint_at(header, length, end)  # the usual id: a count, read as one
                    if not 0 <= rid <= MAX_INT:
                        rid = usable_id(read_at(header, length, end, MAX_ID_BYTES))
                        if rid is None:
                            return None
                    return _with_id(parsed, rid)
            return None
        return None

    def learn(self, header, parsed: "InferRequest", n_frames: int) -> None:
        """Remember ``parsed``, which the full parse made of ``header`` and ``n_frames``."""
        if type(header) is not bytes or len(header) > self.LONGEST:
            return
        span = value_span(header, "id")
        if span is None:
            return
        prefix, suffix = header[:span[0]], header[span[1]:]
        group = self.groups.get(prefix)
        if group is not None:
            for entry in group:
                if entry[0] == suffix:
                    return
        if self.count >= self.size:
            self.groups.clear()
            self.lengths.clear()
            self.count = 0
            group = None
        if group is None:
            group = self.groups[prefix] = []
            if len(prefix) not in self.lengths:
                self.lengths.append(len(prefix))
                self.lengths.sort()
        group.append((suffix, n_frames, parsed))
        self.count += 1


def frame_lengths_match(tensors: list[TensorDesc], payload: list) -> None:
    """An inline frame must hold exactly dtype x shape bytes: checked by length, never read."""
    for desc in tensors:
        if desc.frame is not None and len(payload[desc.frame]) != desc.nbytes:
            raise bad(
                f"frame {desc.frame} holds {len(payload[desc.frame])} bytes but "
                f"{desc.dtype}{list(desc.shape)} needs {desc.nbytes}"
                + (" (its 'nbytes')" if desc.longest is not None else "")
            )
