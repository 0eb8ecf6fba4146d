"""shared/mpack.py, the request path's msgpack, against msgpack-python (the reference): the same
bytes written, the same values read, the same inputs refused; and what it refuses on top."""

from __future__ import annotations

import math
import random

import msgpack
import pytest

from modelwarden.shared import mpack

LIMITS = (1 << 18, 128, 4096)  # max str bytes, max bin bytes, max entries (protocol's)
REFERENCE = dict(max_str_len=LIMITS[0], max_bin_len=LIMITS[1], max_array_len=LIMITS[2],
                 max_map_len=LIMITS[2], max_ext_len=0, raw=False, strict_map_key=True,
                 use_list=True)


def unpack(data, strict=False):
    return mpack.unpack(data, strict, *LIMITS)


def reference(data):
    return msgpack.unpackb(data, **REFERENCE)


def random_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(12 if depth < 4 else 8)
    if kind == 0:
        return rng.choice([None, True, False])
    if kind == 1:
        return rng.randrange(-2**63, 2**64)  # every width, both signs
    if kind == 2:
        return rng.choice([0, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, -1, -32, -33,
                           -128, -129, -32768, -32769, -2**31, -2**31 - 1, -2**63, 2**64 - 1])
    if kind == 3:
        return rng.choice([0.0, -0.0, 1.5, 1e300, -1e-300, math.inf])
    if kind == 4:
        return "".join(chr(rng.randrange(1, 0x3000)) for _ in range(rng.choice([0, 5, 31, 32, 300])))
    if kind == 5:
        return rng.choice(["type", "infer", "float32", "id", "tensors", "x" * 16, "y" * 17])
    if kind == 6:
        return rng.randbytes(rng.choice([0, 1, 128]))
    if kind == 7:
        return rng.randrange(-40, 200)
    if kind in (8, 9):
        return [random_value(rng, depth + 1) for _ in range(rng.choice([0, 3, 15, 16, 20]))]
    if kind == 10:
        return tuple(random_value(rng, depth + 1) for _ in range(rng.randrange(3)))
    return {f"k{rng.randrange(40)}": random_value(rng, depth + 1) for _ in range(rng.choice([0, 4, 17]))}


def test_what_it_writes_is_what_msgpack_writes_and_what_it_reads_is_what_msgpack_reads():
    rng = random.Random(7)
    for _ in range(3000):
        value = random_value(rng)
        packed = msgpack.packb(value, use_bin_type=True)
        assert mpack.pack(value) == packed
        assert repr(unpack(packed)) == repr(reference(packed))


def test_mutated_bytes_are_read_or_refused_as_msgpack_does():
    rng = random.Random(11)
    compared = refused = 0
    for _ in range(3000):
        data = bytearray(msgpack.packb(random_value(rng), use_bin_type=True))
        for _ in range(rng.randrange(1, 4)):
            if data and rng.random() < 0.7:
                data[rng.randrange(len(data))] = rng.randrange(256)
            elif data:
                del data[rng.randrange(len(data)):]
        try:
            expected = repr(reference(bytes(data)))
        except Exception:
            expected = None
        try:
            got = repr(unpack(bytes(data)))
        except mpack.Malformed:
            got = None
        assert got == expected, bytes(data)
        compared += 1
        refused += got is None
    assert 0 < refused < compared  # both kinds of input were exercised


@pytest.mark.parametrize("data, reason", [
    (b"", "incomplete input"),
    (b"\x81\xa1a", "incomplete input"),
    (b"\xdb\xff\xff\xff\xf0", "exceeds"),  # a str declaring 4 GB
    (b"\xdd\xff\xff\xff\xff", "exceeds"),  # an array declaring 4 G entries
    (b"\xdf\x00\x01\x00\x00", "exceeds"),  # a map declaring 65,536 entries
    (b"\xc4\x81" + b"a" * 129, "exceeds"),  # a bin past max_bin
    (b"\x01\x02", "ExtraData"),
    (b"\xc1", "FormatError"),
    (b"\xd4\x01\x00", "ext types"),  # fixext 1
    (b"\xa2\xff\xfe", "UnicodeDecodeError"),
    (b"\x81\x01\x02", "not a str"),
    (b"\x81\x90\x01", "not a str"),
])
def test_what_it_refuses_and_why(data, reason):
    with pytest.raises(mpack.Malformed) as refused:
        unpack(data)
    assert reason in refused.value.reason
    with pytest.raises(Exception):
        reference(data)  # msgpack refuses each too


def test_an_empty_ext_that_msgpack_reads_is_refused_too():
    # msgpack-python's max_ext_len=0 still lets an ext of length 0 through, as an ExtType no
    # header field means anything with: it is refused like every other ext.
    data = b"\x81\xa2id\xc7\x00\x01"
    assert isinstance(reference(data)["id"], msgpack.ExtType)
    with pytest.raises(mpack.Malformed, match="ext types"):
        unpack(data)


def test_nesting_past_max_depth_is_refused_before_any_stack_runs_out():
    at_limit = b"\x91" * mpack.MAX_DEPTH + b"\x01"
    assert unpack(at_limit) is not None
    with pytest.raises(mpack.Malformed, match="StackError"):
        unpack(b"\x91" * (mpack.MAX_DEPTH + 1) + b"\x01")
    with pytest.raises(mpack.Malformed, match="StackError"):
        unpack(b"\x91" * 100_000)


def test_strict_refuses_bytes_keys_and_repeated_keys_and_lax_keeps_the_last():
    repeated = b"\x82\xa2id\x01\xa2id\x02"
    bytes_key = msgpack.packb({b"id": 1}, use_bin_type=True)
    for data, reason in ((repeated, "repeats a key"), (bytes_key, "must be strings")):
        with pytest.raises(mpack.NotAcceptable, match=reason):
            unpack(data, strict=True)
    assert unpack(repeated) == {"id": 2} == reference(repeated)
    assert unpack(bytes_key) == {b"id": 1} == reference(bytes_key)


def test_a_repeated_key_deep_in_the_header_is_found():
    data = msgpack.packb({"tensors": [{"dtype": "a", "shape": []}]}).replace(b"\xa5shape", b"\xa5dtype")
    with pytest.raises(mpack.NotAcceptable):
        unpack(data, strict=True)


def test_short_strings_are_found_again_by_their_bytes_not_by_their_slot():
    # Strings that share a cache slot, or a length, must never be confused: every short string
    # of two bytes, then each again, in an order that evicts and refills the slots.
    words = [bytes((a, b)).decode("latin-1") for a in range(97, 123) for b in range(97, 123)]
    packed = [msgpack.packb(word) for word in words]
    for _ in range(2):
        assert [unpack(data) for data in packed] == words
        assert [unpack(data) for data in reversed(packed)] == words[::-1]


def test_any_buffer_is_read_and_the_input_is_never_kept():
    data = msgpack.packb({"a": [1, "b"]})
    assert unpack(memoryview(data)) == unpack(bytearray(data)) == {"a": [1, "b"]}


@pytest.mark.parametrize("value, error", [
    (2**64, OverflowError), (-2**63 - 1, OverflowError), (object(), TypeError), ({1, 2}, TypeError),
])
def test_it_refuses_to_write_what_msgpack_refuses(value, error):
    with pytest.raises(error):
        msgpack.packb(value, use_bin_type=True)
    with pytest.raises(error):
        mpack.pack(value)


def test_pack_uint_writes_the_smallest_form():
    for value in (0, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 1):
        assert mpack.pack_uint(value) == msgpack.packb(value)


@pytest.mark.parametrize("value", [-1, -2**63, 2**64, 2**70])
def test_pack_uint_refuses_what_is_not_a_uint64(value):
    with pytest.raises(OverflowError):
        mpack.pack_uint(value)


def test_pack_two_after_writes_the_map_msgpack_would():
    prefix = b"\x83" + msgpack.packb("type") + msgpack.packb("run") + msgpack.packb("until")
    key = msgpack.packb("rid")
    for first in (0, 127, 128, 65536, 2**32, 2**64 - 1):
        for second in (1, 255, 2**33, 2**64 - 1):
            packed = mpack.pack_two_after(prefix, first, key, second)
            assert packed == msgpack.packb({"type": "run", "until": first, "rid": second})


@pytest.mark.parametrize("first, second", [(-1, 0), (0, -1), (2**64, 0), (0, 2**64)])
def test_pack_two_after_refuses_what_is_not_a_uint64(first, second):
    with pytest.raises(OverflowError):
        mpack.pack_two_after(b"\x83", first, b"", second)


def test_pack_uint_arrays_writes_the_map_msgpack_would():
    """The batch message's writer, at every array and integer width msgpack distinguishes."""
    prefix = b"\x84" + msgpack.packb("type") + msgpack.packb("batch")
    keys = tuple(msgpack.packb(key) for key in ("rids", "frames", "until"))
    widths = [0, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 1]
    for size in (0, 1, 15, 16, 65535, 65536):
        values = [widths[index % len(widths)] for index in range(size)]
        arrays = (values, values[::-1], [1] * size)
        packed = mpack.pack_uint_arrays(prefix, keys, arrays)
        assert packed == msgpack.packb({"type": "batch", "rids": arrays[0], "frames": arrays[1],
                                        "until": arrays[2]})


@pytest.mark.parametrize("bad", [-1, 2**64])
def test_pack_uint_arrays_refuses_what_is_not_a_uint64(bad):
    with pytest.raises(OverflowError):
        mpack.pack_uint_arrays(b"\x81", (b"\xa1k",), ([1, bad],))
    with pytest.raises(ValueError):
        mpack.pack_uint_arrays(b"\x81", (b"\xa1k",), ())


def test_pack_keyed_writes_the_map_msgpack_would_and_refuses_what_pack_refuses():
    """The request header's writer: keys packed once, each value packed as pack packs it (one
    level down), whatever it holds."""
    rng = random.Random(7)
    for _ in range(200):
        names = [f"k{index}" for index in range(rng.randrange(0, 20))]
        values = tuple(random_value(rng, 1) for _ in names)
        prefix = bytes((0x80 + len(names),)) if len(names) < 16 else b"\xde\x00" + bytes((len(names),))
        packed = mpack.pack_keyed(prefix, tuple(msgpack.packb(name) for name in names), values)
        assert packed == msgpack.packb(dict(zip(names, values)), use_bin_type=True)
    with pytest.raises(ValueError):
        mpack.pack_keyed(b"\x81", (b"\xa1k",), ())
    with pytest.raises(TypeError):
        mpack.pack_keyed(b"\x81", (b"\xa1k",), (object(),))
    deep: list = []
    for depth in range(mpack.MAX_DEPTH + 2):  # as deep as pack takes, counting the map's level
        try:
            expected = mpack.pack({"k": deep})
        except ValueError:
            with pytest.raises(ValueError):
                mpack.pack_keyed(b"\x81", (b"\xa1k",), (deep,))
            assert depth >= mpack.MAX_DEPTH - 1
            break
        assert mpack.pack_keyed(b"\x81", (b"\xa1k",), (deep,)) == expected
        deep = [deep]
    else:
        raise AssertionError("pack took a value nested deeper than its limit")


def test_subclasses_of_str_int_and_dict_are_written_as_their_base():
    import enum

    class Kind(str, enum.Enum):
        INFER = "infer"

    class Code(enum.IntEnum):
        TWO = 2

    value = {"type": Kind.INFER, "n": Code.TWO, "nested": {"x": Kind.INFER}}
    assert mpack.pack(value) == msgpack.packb(value, use_bin_type=True)
