# cython: wraparound=False
"""msgpack, read and written by the request path itself: every header a client, a worker or the
daemon sends goes through here, compiled (shared/mpack.pxd gives the names C types).

Why not msgpack-python, which the rest of the tree still uses for what is not per request: its
``unpackb`` parses a dozen keyword arguments and builds an unpacker context on every call, and
the strictness we need (no repeated keys, str keys only) costs a Python call per map through
``object_pairs_hook``. On this machine that was ~13,000 instructions per header; the supervisor
reads two per request. Here the limits and the strictness are part of the one pass over the
bytes. What it accepts and what it writes are msgpack-python's, byte for byte and value for value:
tests/test_unit_mpack.py and the fuzzer (tests/fuzz/wire.py) hold it to that.

``unpack`` refuses, with ``Malformed(reason)``: truncated input, bytes after the object, the
reserved byte 0xc1, any ext type (timestamps included), a str or bin or container past its limit,
invalid UTF-8, nesting deeper than MAX_DEPTH, and map keys that are neither str nor bytes. With
``strict`` it also refuses, with ``NotAcceptable``, a bytes key and a key repeated in one map. The reason names the kind of
fault as msgpack-python's exception does ("ExtraData", "FormatError", "StackError"...), so the
errors a client sees did not change when this replaced it.

``pack`` writes None, bool, int (within int64/uint64), float (always float64), str, bytes-like,
list, tuple and dict, each as msgpack-python's ``packb(use_bin_type=True)`` does; anything else
is a TypeError, an int out of range an OverflowError, as there.
"""

from __future__ import annotations

import struct

try:
    import cython  # compiled: Cython's own; uncompiled: its shadow module, when installed
except ImportError:
    cython = None  # uncompiled without Cython: only the compiled branches use it

# Nesting: a header's tensor tree may be MAX_TREE_DEPTH (16) deep, each level two msgpack levels
# ({"tuple": [...]}); past 64 it is refused here, well within Python's recursion limit, so the
# uncompiled path refuses exactly what the compiled one does (msgpack-python's limit is 1024).
MAX_DEPTH = 64
_MAX_DEPTH = MAX_DEPTH  # compiled, a C int: the writer compares it per value
# Short strings -- every map key, dtypes, model names, "infer" -- come again in every header:
# a str made once and found again by its bytes skips the UTF-8 decode and, in the dict it goes
# into, the hashing of a new str. Bounded (a peer sending many different strings only evicts).
_CACHED_BELOW = 17
_CACHE_SLOTS = 512
_cached_raw: list = [b""] * _CACHE_SLOTS
_cached_text: list = [""] * _CACHE_SLOTS
_F32 = struct.Struct(">f")
_F64 = struct.Struct(">d")
_U64 = struct.Struct(">Q")
_I64 = struct.Struct(">q")


class Malformed(ValueError):
    """Bytes that are not one msgpack object within the limits. ``reason`` says why in a few
    words; it never quotes the input."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class NotAcceptable(Malformed):
    """Valid msgpack that ``strict`` refuses: a bytes map key, or a key repeated in one map
    (msgpack-python would keep the last, so a validator and a consumer could read two values)."""


def unpack(data, strict, max_str, max_bin, max_len):
    """The one object in ``data`` (bytes, or any buffer: copied once if it is not bytes).
    ``max_str``/``max_bin``: bytes of one str/bin; ``max_len``: entries of one array or map."""
    if type(data) is not bytes:
        data = bytes(data)
    reader = _Reader(data, strict, max_str, max_bin, max_len)
    value = reader.read(0)
    if reader.pos != len(data):
        raise Malformed("ExtraData")
    return value


def value_span(data, key):
    """(start, end) of the value of ``key`` in the map ``data`` holds (msgpack this module
    accepted), or None when the map has no such key: where a header's ``id`` lies."""
    reader = _Reader(bytes(data), False, len(data), len(data), len(data))
    if not reader.pos < reader.end:
        return None
    code = reader.data[0]
    if 0x80 <= code <= 0x8F:
        size = code & 0x0F
        reader.pos = 1
    elif code == 0xDE:
        reader.pos = 1
        size = reader.uint(2)
    elif code == 0xDF:
        reader.pos = 1
        size = reader.uint(4)
    else:
        return None
    for _ in range(size):
        if reader.read(1) == key:
            start = reader.pos
            reader.read(1)
            return start, reader.pos
        reader.read(1)
    return None


def read_at(data, start, end, max_str):
    """The one value that ``data[start:end]`` holds, exactly: None if those bytes are not one
    msgpack value (the caller then parses the whole message, and reports what is wrong)."""
    reader = _Reader(data, True, max_str, 0, 0)
    reader.pos = start
    reader.end = end
    try:
        value = reader.read(0)
    except Malformed:
        return None
    return value if reader.pos == end else None


def uint_at(data, start, end):
    """The unsigned int that ``data[start:end]`` holds, exactly, in the forms ``pack_uint``
    writes (a positive fixint, uint 8/16/32/64); -1 for anything else (the caller then parses
    the whole message)."""
    code = data[start]
    if code <= 0x7F:
        return code if end == start + 1 else -1
    if not (0xCC <= code <= 0xCF and end == start + 1 + (1 << (code - 0xCC))):
        return -1
    return _read_be(data, start + 1, end - start - 1)


def _read_be(data, start, width):
    """The big-endian unsigned int in the ``width`` bytes of ``data`` from ``start``."""
    value = 0
    for index in range(start, start + width):
        value = (value << 8) | data[index]
    return value


def value_end(data, start, limit):
    """Where the msgpack value at ``start`` of ``data`` ends if it is a str (at most ``limit``
    bytes long) or an int; -1 for anything else (or for bytes that end first)."""
    end = len(data)
    if start >= end:
        return -1
    code = data[start]
    if code <= 0x7F or code >= 0xE0:
        return start + 1
    if 0xA0 <= code <= 0xBF:
        size = code & 0x1F
        start += 1
    elif code == 0xD9:
        if start + 2 > end:
            return -1
        size = data[start + 1]
        start += 2
    elif code == 0xCC or code == 0xD0:
        return start + 2 if start + 2 <= end else -1
    elif code == 0xCD or code == 0xD1:
        return start + 3 if start + 3 <= end else -1
    elif code == 0xCE or code == 0xD2:
        return start + 5 if start + 5 <= end else -1
    elif code == 0xCF or code == 0xD3:
        return start + 9 if start + 9 <= end else -1
    else:
        return -1
    if size > limit or start + size > end:
        return -1
    return start + size


class _Reader:
    """One pass over one message; ``pos`` is the next byte to read."""

    def __init__(self, data, strict, max_str, max_bin, max_len):
        self.data = data
        self.end = len(data)
        self.pos = 0
        self.strict = strict
        self.max_str = max_str
        self.max_bin = max_bin
        self.max_len = max_len
        self.max_depth = MAX_DEPTH

    def take(self, count):
        """The position of the next ``count`` bytes, which must all be there."""
        start = self.pos
        if count > self.end - start:
            raise Malformed("incomplete input")
        self.pos = start + count
        return start

    def uint(self, width):
        """A big-endian unsigned int of 1, 2 or 4 bytes (8 go through struct: they are rare)."""
        return _read_be(self.data, self.take(width), width)

    def read(self, depth):
        if depth > self.max_depth:
            raise Malformed("StackError")
        start = self.pos
        if start >= self.end:
            raise Malformed("incomplete input")
        self.pos = start + 1
        code = self.data[start]
        if code <= 0x7F:
            return code
        if code >= 0xE0:
            return code - 0x100
        if 0xA0 <= code <= 0xBF:
            return self.text(code & 0x1F)
        if 0x90 <= code <= 0x9F:
            return self.array(code & 0x0F, depth)
        if 0x80 <= code <= 0x8F:
            return self.map(code & 0x0F, depth)
        if code == 0xC0:
            return None
        if code == 0xC2:
            return False
        if code == 0xC3:
            return True
        if code == 0xCC:
            return self.uint(1)
        if code == 0xCD:
            return self.uint(2)
        if code == 0xCE:
            return self.uint(4)
        if code == 0xCF:
            return _U64.unpack_from(self.data, self.take(8))[0]
        if code == 0xD0:
            value = self.uint(1)
            return value - 0x100 if value >= 0x80 else value
        if code == 0xD1:
            value = self.uint(2)
            return value - 0x10000 if value >= 0x8000 else value
        if code == 0xD2:
            value = self.uint(4)
            return value - 0x100000000 if value >= 0x80000000 else value
        if code == 0xD3:
            return _I64.unpack_from(self.data, self.take(8))[0]
        if code == 0xCA:
            return _F32.unpack_from(self.data, self.take(4))[0]
        if code == 0xCB:
            return _F64.unpack_from(self.data, self.take(8))[0]
        if code == 0xD9:
            return self.text(self.uint(1))
        if code == 0xDA:
            return self.text(self.uint(2))
        if code == 0xDB:
            return self.text(self.uint(4))
        if code == 0xC4:
            return self.binary(self.uint(1))
        if code == 0xC5:
            return self.binary(self.uint(2))
        if code == 0xC6:
            return self.binary(self.uint(4))
        if code == 0xDC:
            return self.array(self.uint(2), depth)
        if code == 0xDD:
            return self.array(self.uint(4), depth)
        if code == 0xDE:
            return self.map(self.uint(2), depth)
        if code == 0xDF:
            return self.map(self.uint(4), depth)
        if code == 0xC1:
            raise Malformed("FormatError")
        raise Malformed("ext types are not accepted")  # 0xc7-0xc9, 0xd4-0xd8

    def text(self, size):
        if size > self.max_str:
            raise Malformed(f"a str of {size} bytes exceeds {self.max_str}")
        start = self.take(size)
        if size >= _CACHED_BELOW:
            return self.decode(start, size)
        data = self.data
        if size == 0:
            return ""
        # The slot from the length and the two ends: cheap, and the bytes are compared whole.
        slot = (size * 131 + data[start] * 31 + data[start + size - 1]) & (_CACHE_SLOTS - 1)
        raw = _cached_raw[slot]
        if len(raw) == size:
            index = 0
            while index < size and raw[index] == data[start + index]:
                index += 1
            if index == size:
                return _cached_text[slot]
        text = self.decode(start, size)
        _cached_raw[slot] = data[start:start + size]
        _cached_text[slot] = text
        return text

    def decode(self, start, size):
        try:
            return self.data[start:start + size].decode("utf-8")
        except UnicodeDecodeError:
            raise Malformed("UnicodeDecodeError") from None

    def binary(self, size):
        if size > self.max_bin:
            raise Malformed(f"a bin of {size} bytes exceeds {self.max_bin}")
        start = self.take(size)
        return self.data[start:start + size]

    def array(self, size, depth):
        if size > self.max_len:
            raise Malformed(f"an array of {size} entries exceeds {self.max_len}")
        items = []
        for _ in range(size):
            items.append(self.read(depth + 1))
        return items

    def map(self, size, depth):
        if size > self.max_len:
            raise Malformed(f"a map of {size} entries exceeds {self.max_len}")
        result = {}
        entries = 0
        for _ in range(size):
            key = self.read(depth + 1)
            kind = type(key)
            if kind is not str:
                if kind is not bytes:
                    raise Malformed("a map key that is not a str")
                if self.strict:
                    # A bytes key could stand beside its str twin ("type" and b"type") and show
                    # a validator one value and a consumer the other.
                    raise NotAcceptable("map keys must be strings")
            result[key] = self.read(depth + 1)
            if len(result) == entries and self.strict:  # the key was there: no new entry
                raise NotAcceptable("a map repeats a key")
            entries += 1
        return result


# -- writing ------------------------------------------------------------------------------------


def pack(value):
    """``value`` as msgpack-python's ``packb(value, use_bin_type=True)`` writes it."""
    out = _Writer()
    _write(out, value, 0)
    return out.result()


def pack_uint(value):
    """A non-negative int below 2**64 (a request's rid, a time in microseconds): the hot path's
    shortcut. An int out of that range is an OverflowError."""
    if not 0 <= value <= 0xFFFFFFFFFFFFFFFF:
        raise OverflowError("Integer value out of range")
    if value <= 0x7F:
        return _FIXINTS[value]
    if COMPILED:  # written into 9 bytes on the C stack, then one bytes object: no struct call
        return PyBytes_FromStringAndSize(cython.cast(cython.p_char, buf), put_uint(buf, 0, value))
    out = bytearray(9)
    return bytes(out[:put_uint(out, 0, value)])


def pack_two_after(prefix, first, key, second):
    """``prefix + pack_uint(first) + key + pack_uint(second)`` as one new bytes object (a map's
    packed keys with two unsigned values: the supervisor's run message, its deadline then its
    rid). Compiled, written straight into it."""
    if not COMPILED:
        return prefix + pack_uint(first) + key + pack_uint(second)
    if not (0 <= first <= 0xFFFFFFFFFFFFFFFF and 0 <= second <= 0xFFFFFFFFFFFFFFFF):
        raise OverflowError("Integer value out of range")
    size = PyBytes_GET_SIZE(prefix)
    middle = PyBytes_GET_SIZE(key)
    first_end = put_uint(buf, 0, first)
    end = put_uint(buf, first_end, second)
    out = PyBytes_FromStringAndSize(cython.NULL, size + middle + end)
    data = PyBytes_AS_STRING(out)
    memcpy(data, PyBytes_AS_STRING(prefix), size)
    memcpy(data + size, buf, first_end)
    memcpy(data + size + first_end, PyBytes_AS_STRING(key), middle)
    memcpy(data + size + first_end + middle, buf + first_end, end - first_end)
    return out


def pack_uint_arrays(prefix, keys, arrays):
    """``prefix``, then per key its packed bytes (``keys[i]``, as given) and ``arrays[i]``, a
    list of non-negative ints below 2**64, as a msgpack array: the tail of a map whose values
    are such lists (the supervisor's batch message: its rids, frame counts and deadlines), the
    same bytes as packing the whole map, without walking each value's type. An int out of range
    is an OverflowError."""
    if len(keys) != len(arrays):
        raise ValueError("as many keys as arrays")
    out = _Writer()
    out.raw(prefix)
    for index in range(len(keys)):
        out.raw(keys[index])
        array = arrays[index]
        _write_size(out, len(array), 0x90, 0xDC)
        for value in array:  # compiled, a C unsigned long long: out of range raises here
            if not 0 <= value <= 0xFFFFFFFFFFFFFFFF:
                raise OverflowError("Integer value out of range")
            out.uint(value)
    return out.result()


def pack_keyed(prefix, keys, values):
    """``prefix``, then per key its packed bytes (``keys[i]``, as given) and ``values[i]``
    packed as ``pack`` packs it, as a map's entry: the tail of a map whose keys were packed
    once (the client's request header), the same bytes as packing the whole map, without
    writing each key again."""
    if len(keys) != len(values):
        raise ValueError("as many keys as values")
    out = _Writer()
    out.raw(prefix)
    for index in range(len(keys)):
        out.raw(keys[index])
        _write(out, values[index], 1)  # a map's value: one level down, as _write_map writes it
    return out.result()


def put_uint(data, pos, value):
    """``value`` (0 <= value < 2**64) in msgpack's shortest unsigned form, written into ``data``
    (compiled: a C buffer; uncompiled: a bytearray) from ``pos``, which must leave 9 bytes of
    room; where the written bytes end."""
    if value <= 0x7F:
        data[pos] = value
        return pos + 1
    if value <= 0xFF:
        data[pos] = 0xCC
        width = 1
    elif value <= 0xFFFF:
        data[pos] = 0xCD
        width = 2
    elif value <= 0xFFFFFFFF:
        data[pos] = 0xCE
        width = 4
    else:
        data[pos] = 0xCF
        width = 8
    end = pos + 1 + width
    index = end - 1
    while index > pos:
        data[index] = value & 0xFF
        value >>= 8
        index -= 1
    return end


COMPILED = not __file__.endswith(".py")
_FIXINTS = [bytes((value,)) for value in range(0x80)]


class _Writer:
    """Where ``pack`` writes. Compiled, a C buffer: its first 256 bytes inside the object, then
    doubled on the heap as needed (a bytearray grows a few bytes at a time and reallocates on
    most appends: a request header cost ~15,000 instructions that way). Uncompiled, a bytearray.
    The format's rules are ``_write``'s alone; these are its only ways to write."""

    def __init__(self):
        if COMPILED:
            self.data = self.first
            self.size = 0
            self.capacity = _FIRST_BYTES
        else:
            self.out = bytearray()

    def __dealloc__(self):  # compiled only (an extension type's finaliser)
        if self.data != cython.cast(cython.p_uchar, self.first):
            PyMem_Free(self.data)

    def byte(self, value):
        """One byte, 0..255."""
        if COMPILED:
            if self.size == self.capacity:
                self.grow(1)
            self.data[self.size] = value
            self.size += 1
        else:
            self.out.append(value)

    def raw(self, value):
        """The bytes of ``value`` (bytes) as they are."""
        if COMPILED:
            self.chars(PyBytes_AS_STRING(value), PyBytes_GET_SIZE(value))
        else:
            self.out += value

    def chars(self, text, size):
        """``size`` bytes from ``text`` (compiled only: a C pointer)."""
        if self.size + size > self.capacity:
            self.grow(size)
        memcpy(self.data + self.size, text, size)
        self.size += size

    def be(self, value, width):
        """``value`` (non-negative, below 256**width) as ``width`` big-endian bytes."""
        if COMPILED:
            if self.size + width > self.capacity:
                self.grow(width)
            index = self.size + width - 1
            while index >= self.size:
                self.data[index] = value & 0xFF
                value >>= 8
                index -= 1
            self.size += width
        else:
            self.out += value.to_bytes(width, "big")

    def uint(self, value):
        """``value`` (0 <= value < 2**64) as ``put_uint`` writes it."""
        if COMPILED:
            if self.size + 9 > self.capacity:
                self.grow(9)
            self.size = put_uint(self.data, self.size, value)
        else:
            scratch = bytearray(9)
            self.out += scratch[:put_uint(scratch, 0, value)]

    def grow(self, more):
        """Room for ``more`` bytes (compiled only)."""
        capacity = self.capacity
        while capacity < self.size + more:
            capacity *= 2
        if self.data == cython.cast(cython.p_uchar, self.first):
            data = cython.cast(cython.p_uchar, PyMem_Malloc(capacity))
            if data != cython.NULL:
                memcpy(data, self.data, self.size)
        else:
            data = cython.cast(cython.p_uchar, PyMem_Realloc(self.data, capacity))
        if data == cython.NULL:
            raise MemoryError()
        self.data = data
        self.capacity = capacity

    def result(self):
        if COMPILED:
            return PyBytes_FromStringAndSize(cython.cast(cython.p_char, self.data), self.size)
        return bytes(self.out)


_FIRST_BYTES = 256


def _write(out, value, depth):
    if depth > _MAX_DEPTH:
        raise ValueError("recursion limit exceeded")
    kind = type(value)
    if kind is str:  # a header is mostly keys: the exact types first, subclasses below
        _write_text(out, value)
    elif kind is int:
        _write_int(out, value)
    elif kind is dict:
        _write_map(out, value, depth)
    elif kind is list:
        _write_array(out, value, depth)
    elif value is None:
        out.byte(0xC0)
    elif value is True:
        out.byte(0xC3)
    elif value is False:
        out.byte(0xC2)
    elif isinstance(value, int):
        _write_int(out, value)
    elif isinstance(value, str):
        _write_text(out, value if type(value) is str else value[:])  # a subclass (an enum) as str
    elif isinstance(value, float):
        out.byte(0xCB)
        out.raw(_F64.pack(value))
    elif isinstance(value, dict):
        _write_map(out, value, depth)
    elif isinstance(value, (list, tuple)):
        _write_array(out, value, depth)
    elif isinstance(value, (bytes, bytearray, memoryview)):
        _write_binary(out, value)
    else:
        raise TypeError(f"can not serialize {type(value).__name__!r} object")


def _write_map(out, value, depth):
    _write_size(out, len(value), 0x80, 0xDE)
    for key, item in value.items():
        _write(out, key, depth + 1)
        _write(out, item, depth + 1)


def _write_array(out, value, depth):
    _write_size(out, len(value), 0x90, 0xDC)
    for item in value:
        _write(out, item, depth + 1)


def _write_int(out, value):
    if value >= 0:
        if value > 0xFFFFFFFFFFFFFFFF:
            raise OverflowError("Integer value out of range")
        out.uint(value)
    elif value >= -0x20:
        out.byte(value + 0x100)
    elif value >= -0x80:
        out.byte(0xD0)
        out.byte(value + 0x100)
    elif value >= -0x8000:
        out.byte(0xD1)
        out.be(value + 0x10000, 2)
    elif value >= -0x80000000:
        out.byte(0xD2)
        out.be(value + 0x100000000, 4)
    elif value >= -0x8000000000000000:
        out.byte(0xD3)
        out.be(value + 0x10000000000000000, 8)
    else:
        raise OverflowError("Integer value out of range")


def _write_text(out, value):
    # A lone surrogate raises UnicodeEncodeError, as msgpack's. Compiled, the UTF-8 is the str's
    # own (CPython keeps it: an ASCII str is its UTF-8), copied with no bytes object made.
    if COMPILED:
        text = PyUnicode_AsUTF8AndSize(value, cython.address(size))
    else:
        data = value.encode("utf-8")
        size = len(data)
    if size < 32:
        out.byte(0xA0 | size)
    else:
        _write_length(out, size, 0xD9, "String")
    if COMPILED:
        out.chars(text, size)
    else:
        out.raw(data)


def _write_binary(out, value):
    data = value if type(value) is bytes else bytes(value)
    _write_length(out, len(data), 0xC4, "Bytes object")
    out.raw(data)


def _write_length(out, size, code8, what):
    """A str's or bin's length: one byte after ``code8``, two after ``code8 + 1``, four after
    ``code8 + 2`` (msgpack's str8/16/32 and bin8/16/32)."""
    if size <= 0xFF:
        out.byte(code8)
        out.byte(size)
    elif size <= 0xFFFF:
        out.byte(code8 + 1)
        out.be(size, 2)
    elif size <= 0xFFFFFFFF:
        out.byte(code8 + 2)
        out.be(size, 4)
    else:
        raise ValueError(f"{what} is too large")


def _write_size(out, size, fix, code16):
    """The header of an array (fix 0x90, 0xdc/0xdd) or a map (fix 0x80, 0xde/0xdf)."""
    if size < 16:
        out.byte(fix | size)
    elif size <= 0xFFFF:
        out.byte(code16)
        out.be(size, 2)
    elif size <= 0xFFFFFFFF:
        out.byte(code16 + 1)
        out.be(size, 4)
    else:
        raise ValueError("too large to pack")
