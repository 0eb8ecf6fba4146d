"""Tensor descriptors and replies on the wire: the torch-free half of the codec.

Every descriptor is built here and every reply is read here, by the client, the worker and the
supervisor alike (``shared/codec.py`` adds the torch half: tensors in, tensors out). This module
imports nothing but ``shared.protocol``, so the supervisor, which never imports torch, reads
replies with the same parser as the client.

Building (the wire form, see ``shared.protocol``)::

    inline_desc("float32", (2, 64), 0)           -> {"dtype": ..., "shape": [2, 64], "frame": 0}
    shm_desc("float32", (2, 64), (TOKEN, 0, 512)) -> {"dtype": ..., "shape": [2, 64], "shm": [...]}

Reading: ``parse_reply(header, frames)`` checks a reply -- a client's reply or a worker's result
-- and returns an ``InferReply``: ``ok``, the outputs TREE, one checked ``TensorDesc`` per
output, the error (code, message, detail), the worker and the timing. Anything malformed raises
``ProtocolError(INTERNAL, ...)``: a malformed reply is the sender's bug (the daemon's or a
worker's), never the reader's, and it never raises anything else (no KeyError, no assert).
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple

from modelwarden.shared.mpack import pack, read_at, value_end, value_span
from modelwarden.shared.protocol import (BAD_REQUEST, ELEMENT_PREFIX, INTERNAL, MAX_ID_BYTES,
                                         MAX_NAME_BYTES, ProtocolError, TensorDesc, check_tree,
                                         frame_lengths_match, parse_tensors, read_timing,
                                         request_id_of, usable_id)

MAX_ERROR_CODE_BYTES = 64


# -- building -----------------------------------------------------------------------------------


def inline_desc(dtype: str, shape, frame: int) -> dict:
    """A tensor travelling as payload frame number ``frame`` (frames count 0, 1, 2... in order)."""
    return {"dtype": dtype, "shape": list(shape), "frame": frame}


def shm_desc(dtype: str, shape, region: tuple[str, int, int]) -> dict:
    """A tensor lying in shared memory: ``region`` is (token, offset, nbytes)."""
    return {"dtype": dtype, "shape": list(shape), "shm": list(region)}


def element_desc(dtype: str, shape, nbytes: int, longest: int, frame: int | None = None,
                 region: tuple[str, int, int] | None = None) -> dict:
    """A str/bytes descriptor: inline as payload frame ``frame``, or in ``region``."""
    desc = {"dtype": dtype, "shape": list(shape), "nbytes": nbytes, "longest": longest}
    if region is not None:
        desc["shm"] = list(region)
    else:
        desc["frame"] = frame
    return desc


def wire_desc(desc: TensorDesc) -> dict:
    """The wire form of a checked descriptor (what a relay or a test sends on)."""
    if desc.longest is not None:
        return element_desc(desc.dtype, desc.shape, desc.nbytes, desc.longest, desc.frame,
                            desc.shm)
    if desc.shm is not None:
        return shm_desc(desc.dtype, desc.shape, desc.shm)
    return inline_desc(desc.dtype, desc.shape, desc.frame)


# -- str/bytes elements -------------------------------------------------------------------------

_PREFIX = struct.Struct("<I")


def decode_elements(buffer: Any, desc: TensorDesc) -> Any:
    """The str/bytes elements of a checked descriptor's payload ``buffer`` (a frame's
    memoryview or a uint8 array over shared memory), nested per its shape (a 0-d shape gives
    the bare element). Strict, element by element: every length prefix and element inside the
    payload, no trailing bytes, the count and the longest element as declared, UTF-8 valid for
    str. Any failure is ProtocolError(BAD_REQUEST) naming the element."""
    count = 1
    for dim in desc.shape:
        count *= dim
    items, longest = split_elements(buffer, count, desc.dtype == "str")
    if longest != desc.longest:
        raise _element_error(f"declares 'longest' {desc.longest}, but its longest element "
                             f"holds {longest} bytes")
    return _nest(items, desc.shape, desc.dtype)


def split_elements(buffer: Any, count: int, text: bool) -> tuple[list, int]:
    """(the ``count`` elements of a length-prefixed payload, flat, as str when ``text`` else as
    bytes; the longest one's byte length). ProtocolError(BAD_REQUEST) naming the element when
    a prefix or an element lies past the end, a str is not UTF-8, or bytes are left over."""
    view = memoryview(buffer).cast("B")
    items, end, longest = _split_elements(view, count, text)
    if end != len(view):
        raise _element_error(f"{len(view) - end} bytes after the last of its {count} elements")
    return items, longest


def _split_elements(view: memoryview, count: int, text: bool) -> tuple[list, int, int]:
    """(the elements, where the last one ends, the longest one's byte length)."""
    items, offset, size, longest = [], 0, len(view), 0
    for index in range(count):
        if offset + ELEMENT_PREFIX > size:
            raise _element_error(f"element {index}: its length prefix lies past the end of the "
                                 f"payload ({size} bytes; {count} elements declared)")
        (length,) = _PREFIX.unpack_from(view, offset)
        start, offset = offset + ELEMENT_PREFIX, offset + ELEMENT_PREFIX + length
        if offset > size:
            raise _element_error(f"element {index}: {length} bytes from byte {start} run past "
                                 f"the end of the payload ({size} bytes)")
        longest = max(longest, length)
        items.append(_text(view[start:offset], index) if text else bytes(view[start:offset]))
    return items, offset, longest


def _text(data: memoryview, index: int) -> str:
    try:
        return str(data, "utf-8")
    except UnicodeDecodeError as exc:
        raise _element_error(f"element {index} is not valid UTF-8 (byte {exc.start}: "
                             f"{exc.reason})") from None


def _element_error(message: str) -> ProtocolError:
    return ProtocolError(BAD_REQUEST, f"str/bytes payload: {message}")


class ElementList(list):
    """A decoded str/bytes payload of one or more dimensions: a plain (nested) list that also
    says what it was on the wire, so a relay (the gateway) keeps an empty dimension's shape."""

    __slots__ = ("dtype", "shape")

    def __init__(self, items: list, dtype: str, shape: tuple[int, ...]) -> None:
        super().__init__(items)
        self.dtype = dtype
        self.shape = shape


def _nest(flat: list, shape: tuple[int, ...], dtype: str | None = None) -> Any:
    """A row-major flat list as nested lists of ``shape``; the bare element for 0-d. The
    outermost list is an ElementList when ``dtype`` is given."""
    if not shape:
        return flat[0]
    if dtype is not None:
        return ElementList(_nest(flat, shape), dtype, shape)
    if len(shape) == 1:
        return flat
    step = len(flat) // shape[0] if shape[0] else 0
    return [_nest(flat[row * step:(row + 1) * step], shape[1:]) for row in range(shape[0])]


# -- reading ------------------------------------------------------------------------------------


class ReplyError(NamedTuple):
    code: str
    message: str
    detail: str | None = None


class InferReply(NamedTuple):
    """A checked reply. ``tensors`` are empty and ``error`` set when ``ok`` is False."""

    id: Any  # the request id echoed, None if absent or unusable
    ok: bool
    outputs: Any  # TREE over ``tensors``; None on failure
    tensors: list[TensorDesc]
    error: ReplyError | None
    worker: str | None
    timing: dict[str, int]
    version: str | None = None  # the model version that answered


def malformed(message: str) -> ProtocolError:
    return ProtocolError(INTERNAL, f"malformed reply: {message}")


def parse_reply(header: Any, frames: list, shm: bool = True) -> InferReply:
    """Check a reply header against its payload frames. ``shm=False`` refuses shared-memory
    descriptors (a probe's answer is always inline)."""
    if not isinstance(header, dict):
        raise malformed("the header is not a map")
    ok = header.get("ok")
    if type(ok) is not bool:
        raise malformed("'ok' must be true or false")
    worker = _optional_str(header, "worker")
    timing = _timing(header.get("timing"))
    if not ok:
        if frames:
            raise malformed(f"a failure carries no payload, got {len(frames)} frames")
        return InferReply(request_id_of(header), False, None, [], _error(header.get("error")),
                          worker, timing, _optional_str(header, "version"))
    if "outputs" not in header:
        raise malformed("a success needs 'outputs'")
    tensors = parse_reply_tensors(header.get("tensors"), frames, shm)
    try:
        check_tree(header["outputs"], len(tensors), "'outputs'")
    except ProtocolError as exc:
        raise malformed(exc.message) from None
    return InferReply(request_id_of(header), True, header["outputs"], tensors, None, worker, timing,
                      _optional_str(header, "version"))


def parse_reply_tensors(descs: Any, frames: list, shm: bool = True) -> list[TensorDesc]:
    """The output descriptors of a reply, checked against its frames: inline ones number the
    frames 0, 1, 2... in order, use all of them, and each frame holds exactly its bytes."""
    try:
        tensors = parse_tensors(descs)
    except ProtocolError as exc:
        raise malformed(exc.message) from None
    inline = 0
    for desc in tensors:
        if desc.frame is not None:
            inline += 1
        elif not shm:
            raise malformed("a shared-memory descriptor where only inline tensors may come")
    if inline != len(frames):
        raise malformed(f"{inline} inline tensors but {len(frames)} payload frames")
    try:
        frame_lengths_match(tensors, frames)
    except ProtocolError as exc:
        raise malformed(exc.message) from None
    return tensors


class ReplyCache:
    """``parse_reply(header, frames)`` remembered for the success headers it was worked out for,
    but for their ``id`` and their ``timing``. A client gets the same reply header again and
    again but for those two (the same worker, version, outputs and descriptors), and the parse
    is a function of the header's bytes and the frames' lengths alone.

    The daemon writes a success header as a map whose first key is ``id`` (the worker writes it
    so) and whose last entry is the ``timing`` the supervisor appends (``protocol.add_timing``).
    So a header is found when its first byte, the bytes between its id and its timing
    (``middle``) and its payload's frame count are one remembered entry's, its id is an int or a
    str (read as the full decode reads it), its timing is add_timing's layout of non-negative
    ints (``protocol.read_timing``), and its frames hold the bytes the descriptors say. Anything
    else -- a header never seen, a failure, a map with a repeated key -- is not found, and the
    full parse reads it (and refuses it, saying why). Only the full parse's own verdicts are
    learnt, and only from headers without repeated keys: the lax decode keeps a repeated key's
    last value, which the id and the timing read here might not be.

    Bounded: at most ``size`` entries for headers of at most ``LONGEST`` bytes; past that it
    starts afresh. Shared by a client's threads: ``entries`` is replaced, never changed in place."""

    LONGEST = 4096

    def __init__(self, size: int = 16) -> None:
        self.size = size
        self.entries: list = []  # (first byte, middle, frame count, then the reply's
        # outputs, tensors, worker and version)

    def parse(self, header: bytes, frames: list) -> tuple | None:
        """(the id as the full decode reads it, the reply) if ``header`` is found, else None."""
        entries = self.entries
        if not entries or len(header) > self.LONGEST or not header.startswith(_ID_KEY, 1):
            return None
        end = value_end(header, _ID_AT, MAX_ID_BYTES)
        if end < 0:
            return None
        first = header[0]
        for entry_first, middle, count, outputs, tensors, worker, version in entries:
            if entry_first != first or len(frames) != count or not header.startswith(middle, end):
                continue
            timing = read_timing(header, end + len(middle))
            if timing is None:
                continue
            try:
                frame_lengths_match(tensors, frames)
            except ProtocolError:
                return None
            rid = read_at(header, _ID_AT, end, MAX_ID_BYTES)
            # InferReply(...) without the Python frame of a NamedTuple's __new__: the same tuple
            return rid, tuple.__new__(InferReply, (usable_id(rid), True, outputs, tensors, None,
                                                   worker, timing, version))
        return None

    def learn(self, header: bytes, keys: int, reply: InferReply, count: int) -> None:
        """Remember ``reply``: the full parse of ``header`` (a map the lax decode made ``keys``
        entries of) with ``count`` payload frames."""
        if (not reply.ok or len(header) > self.LONGEST or not 0x80 <= header[0] <= 0x8F
                or keys != header[0] - 0x80 or not header.startswith(_ID_KEY, 1)):
            return
        end = value_end(header, _ID_AT, MAX_ID_BYTES)
        span = value_span(header, "timing")
        if end < 0 or span is None:
            return
        key_at = span[0] - len(_TIMING)
        if key_at < end or read_timing(header, key_at) is None:
            return
        middle = header[end:key_at]
        for entry in self.entries:
            if entry[0] == header[0] and entry[1] == middle and entry[2] == count:
                return
        entries = [] if len(self.entries) >= self.size else list(self.entries)
        entries.append((header[0], middle, count, reply.outputs, reply.tensors, reply.worker,
                        reply.version))
        self.entries = entries


_ID_KEY = pack("id")
_ID_AT = 1 + len(_ID_KEY)  # where the id's value starts in a map whose first key is "id"
_TIMING = pack("timing")


def _error(value: Any) -> ReplyError:
    if not isinstance(value, dict):
        raise malformed("a failure needs an 'error' map")
    code, message, detail = value.get("code"), value.get("message"), value.get("detail")
    if not isinstance(code, str) or not code or len(code.encode()) > MAX_ERROR_CODE_BYTES:
        raise malformed(f"'error.code' must be a non-empty string of at most "
                        f"{MAX_ERROR_CODE_BYTES} bytes")
    if not isinstance(message, str):
        raise malformed("'error.message' must be a string")
    if detail is not None and not isinstance(detail, str):
        raise malformed("'error.detail' must be a string when present")
    return ReplyError(code, message, detail)


def _optional_str(header: dict, key: str) -> str | None:
    value = header.get(key)
    if value is not None and (not isinstance(value, str) or len(value.encode()) > MAX_NAME_BYTES):
        raise malformed(f"'{key}' must be a string of at most {MAX_NAME_BYTES} bytes")
    return value


def _timing(value: Any) -> dict[str, int]:
    """Named non-negative integer counters; names a reader does not know are kept (the set grows:
    batching adds ``batch``)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise malformed("'timing' must be a map")
    for key, count in value.items():
        if not isinstance(key, str) or type(count) is not int or count < 0:
            raise malformed("'timing' maps names to non-negative integers")
    return value
