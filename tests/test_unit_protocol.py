"""Unit tests of the wire protocol's validators (shared/protocol.py): no daemon, no sockets.

Every hostile input must come back as ProtocolError(BAD_REQUEST), never as another exception,
and an error about a buffer must never echo its token (a secret).
"""

from __future__ import annotations

import msgpack
import pytest
import zmq

from modelwarden.shared import descriptors, mpack, protocol
from modelwarden.shared.protocol import (
    BAD_REQUEST,
    MAX_HEADER_BYTES,
    MAX_TENSOR_BYTES,
    MAX_TENSORS,
    MAX_TREE_DEPTH,
    SIGNATURE,
    ProtocolError,
    TensorDesc,
    check_tree,
    parse_infer,
    parse_region,
    parse_tensor_desc,
    split_router_message,
    tensor_nbytes,
    unpack_header,
)

SEG = "0123456789abcdef" * 2  # buffer tokens: 32 lowercase hex digits
SEG2 = "fedcba9876543210" * 2


def rejected(call, *args, **kwargs) -> ProtocolError:
    """Run ``call`` and insist it refuses with BAD_REQUEST (any other exception fails the test)."""
    with pytest.raises(ProtocolError) as info:
        call(*args, **kwargs)
    assert info.value.code == BAD_REQUEST, info.value.code
    assert info.value.message == str(info.value)
    return info.value


def infer_header(**changes) -> dict:
    header = {
        "type": "infer",
        "id": 7,
        "model": "mlp",
        "inputs": [0, {"dict": {"w": 1}}],
        "tensors": [
            {"dtype": "float32", "shape": [2, 3], "frame": 0},
            {"dtype": "int64", "shape": [4], "shm": [SEG, 64, 32]},
        ],
    }
    header.update(changes)
    return header


# -- parse_infer --------------------------------------------------------------------------------


def test_parse_infer_accepts_a_valid_request_with_inline_and_shm_tensors():
    request = parse_infer(infer_header(timeout_ms=1500, out=[SEG2, 0, 4096]), n_frames=1)
    assert request.id == 7
    assert request.model == "mlp"
    assert request.tree == [0, {"dict": {"w": 1}}]
    assert request.timeout_ms == 1500
    assert request.out == (SEG2, 0, 4096)
    assert request.tensors == [
        TensorDesc("float32", (2, 3), 24, frame=0),
        TensorDesc("int64", (4,), 32, shm=(SEG, 64, 32)),
    ]
    assert request.buffers() == {SEG, SEG2}


def test_parse_infer_accepts_string_ids_and_no_optional_fields():
    request = parse_infer(infer_header(id="req-" + "x" * 124), n_frames=1)
    assert request.id == "req-" + "x" * 124
    assert request.timeout_ms is None and request.out is None
    assert request.buffers() == {SEG}


def test_parse_infer_accepts_a_request_without_tensors():
    request = parse_infer(infer_header(inputs=[], tensors=[]), n_frames=0)
    assert request.tensors == [] and request.tree == []


def test_inline_frames_are_numbered_in_order_across_shm_descriptors():
    tensors = [
        {"dtype": "float32", "shape": [1], "frame": 0},
        {"dtype": "float32", "shape": [1], "shm": [SEG, 0, 4]},
        {"dtype": "float32", "shape": [1], "frame": 1},
    ]
    request = parse_infer(infer_header(inputs=[0, 1, 2], tensors=tensors), n_frames=2)
    assert [desc.frame for desc in request.tensors] == [0, None, 1]


@pytest.mark.parametrize("changes, n_frames", [
    ({"id": True}, 1),  # a bool is not an int id
    ({"id": None}, 1),
    ({"id": 1.5}, 1),
    ({"id": "x" * 129}, 1),
    ({"id": 2**63}, 1),
    ({"model": ""}, 1),
    ({"model": 5}, 1),
    ({"model": "m" * 257}, 1),
    ({"model": None}, 1),
    ({"tensors": None}, 1),
    ({"tensors": {"0": {}}}, 1),
    ({"tensors": [{"dtype": "float32", "shape": [1], "frame": 0}] * (MAX_TENSORS + 1),
      "inputs": list(range(MAX_TENSORS + 1))}, MAX_TENSORS + 1),
    ({"inputs": None}, 1),
    ({}, 0),  # one inline tensor, no payload frame
    ({}, 2),  # one inline tensor, two payload frames
    ({"timeout_ms": -1}, 1),
    ({"timeout_ms": True}, 1),
    ({"timeout_ms": 1.5}, 1),
    ({"timeout_ms": 7 * 24 * 3600 * 1000 + 1}, 1),
    ({"timeout_ms": 2**64}, 1),
    ({"out": [SEG2, 0]}, 1),
    ({"out": [SEG2, -1, 10]}, 1),
    ({"out": [SEG2, 2**64 - 32, 32]}, 1),
    ({"out": [SEG2, 0, True]}, 1),
    ({"out": ["../../etc/passwd", 0, 10]}, 1),
    ({"out": SEG2}, 1),
])
def test_parse_infer_rejects_hostile_headers(changes, n_frames):
    rejected(parse_infer, infer_header(**changes), n_frames)


def test_parse_infer_rejects_a_missing_id_or_model():
    for key in ("id", "model", "tensors", "inputs"):
        header = infer_header()
        del header[key]
        rejected(parse_infer, header, 1)


def test_parse_infer_accepts_the_largest_timeout():
    assert parse_infer(infer_header(timeout_ms=7 * 24 * 3600 * 1000), 1).timeout_ms == 604800000


# -- parse_tensor_desc --------------------------------------------------------------------------


def test_tensor_desc_inline_scalar_and_zero_sized():
    assert parse_tensor_desc({"dtype": "bool", "shape": [], "frame": 0}, 0, 0) == \
        TensorDesc("bool", (), 1, frame=0)
    assert parse_tensor_desc({"dtype": "float64", "shape": [0, 5], "frame": 3}, 4, 3) == \
        TensorDesc("float64", (0, 5), 0, frame=3)


def test_tensor_desc_shm_region_is_kept():
    desc = parse_tensor_desc({"dtype": "bfloat16", "shape": [8, 2], "shm": [SEG, 1024, 32]}, 0, 0)
    assert desc == TensorDesc("bfloat16", (8, 2), 32, shm=(SEG, 1024, 32))


def test_tensor_desc_accepts_exactly_max_tensor_bytes():
    desc = parse_tensor_desc({"dtype": "float32", "shape": [MAX_TENSOR_BYTES // 4], "frame": 0}, 0, 0)
    assert desc.nbytes == MAX_TENSOR_BYTES


@pytest.mark.parametrize("value, next_frame", [
    (None, 0),
    ([], 0),
    ("float32", 0),
    ({"shape": [1], "frame": 0}, 0),  # no dtype
    ({"dtype": "float33", "shape": [1], "frame": 0}, 0),
    ({"dtype": None, "shape": [1], "frame": 0}, 0),
    ({"dtype": 4, "shape": [1], "frame": 0}, 0),
    ({"dtype": "float32", "frame": 0}, 0),  # no shape
    ({"dtype": "float32", "shape": "2,3", "frame": 0}, 0),
    ({"dtype": "float32", "shape": {"0": 2}, "frame": 0}, 0),
    ({"dtype": "float32", "shape": [1] * 33, "frame": 0}, 0),
    ({"dtype": "float32", "shape": [-1], "frame": 0}, 0),
    ({"dtype": "float32", "shape": [2, -3], "frame": 0}, 0),
    ({"dtype": "float32", "shape": [True, 2], "frame": 0}, 0),
    ({"dtype": "float32", "shape": [2.0], "frame": 0}, 0),
    ({"dtype": "float32", "shape": ["2"], "frame": 0}, 0),
    ({"dtype": "float32", "shape": [None], "frame": 0}, 0),
    ({"dtype": "float32", "shape": [MAX_TENSOR_BYTES + 1], "frame": 0}, 0),
    ({"dtype": "float32", "shape": [2**64 - 32], "frame": 0}, 0),
    ({"dtype": "float32", "shape": [MAX_TENSOR_BYTES // 4 + 1], "frame": 0}, 0),
    ({"dtype": "uint8", "shape": [2**24, 2**24, 2], "frame": 0}, 0),  # product > MAX
    ({"dtype": "complex128", "shape": [2**16] * 4, "frame": 0}, 0),  # 2**68 bytes
    # exactly one of frame and shm
    ({"dtype": "float32", "shape": [1]}, 0),
    ({"dtype": "float32", "shape": [1], "frame": 0, "shm": [SEG, 0, 4]}, 0),
    # frames numbered out of order, or not ints
    ({"dtype": "float32", "shape": [1], "frame": 1}, 0),
    ({"dtype": "float32", "shape": [1], "frame": 0}, 1),
    ({"dtype": "float32", "shape": [1], "frame": -1}, 0),
    ({"dtype": "float32", "shape": [1], "frame": True}, 1),  # True == 1 but is not an int
    ({"dtype": "float32", "shape": [1], "frame": False}, 0),
    ({"dtype": "float32", "shape": [1], "frame": 0.0}, 0),
    ({"dtype": "float32", "shape": [1], "frame": "0"}, 0),
    ({"dtype": "float32", "shape": [1], "frame": None}, 0),
    ({"dtype": "float32", "shape": [1], "frame": 2**64}, 0),
    # shm regions
    ({"dtype": "float32", "shape": [1], "shm": None}, 0),
    ({"dtype": "float32", "shape": [1], "shm": [SEG, 0]}, 0),
    ({"dtype": "float32", "shape": [1], "shm": [SEG, 0, 4, 0]}, 0),
    ({"dtype": "float32", "shape": [1], "shm": {"name": SEG, "offset": 0, "nbytes": 4}}, 0),
    ({"dtype": "float32", "shape": [1], "shm": [SEG, 2**64 - 32, 4]}, 0),
    ({"dtype": "float32", "shape": [1], "shm": [SEG, -1, 4]}, 0),
    ({"dtype": "float32", "shape": [1], "shm": [SEG, True, 4]}, 0),
    ({"dtype": "float32", "shape": [1], "shm": [SEG, 0.0, 4]}, 0),
    ({"dtype": "float32", "shape": [1], "shm": [SEG, 0, True]}, 0),
    ({"dtype": "float32", "shape": [1], "shm": [SEG, 0, -4]}, 0),
    # nbytes must equal dtype x shape, neither more nor less
    ({"dtype": "float32", "shape": [1], "shm": [SEG, 0, 3]}, 0),
    ({"dtype": "float32", "shape": [1], "shm": [SEG, 0, 5]}, 0),
    ({"dtype": "float32", "shape": [2, 3], "shm": [SEG, 0, 6]}, 0),
    ({"dtype": "float32", "shape": [1], "shm": [SEG, 0, 2**64 - 32]}, 0),
    ({"dtype": "float32", "shape": [1], "shm": ["/dev/shm/" + SEG, 0, 4]}, 0),
    ({"dtype": "float32", "shape": [1], "shm": [SEG.encode(), 0, 4]}, 0),
])
def test_tensor_desc_rejects_hostile_descriptors(value, next_frame):
    rejected(parse_tensor_desc, value, 0, next_frame)


@pytest.mark.parametrize("dtype", [["float32"], {"float32": 1}])
def test_tensor_desc_rejects_an_unhashable_dtype(dtype):
    rejected(parse_tensor_desc, {"dtype": dtype, "shape": [1], "frame": 0}, 0, 0)


def test_unknown_dtype_message_is_truncated():
    error = rejected(parse_tensor_desc, {"dtype": "q" * 10_000, "shape": [1], "frame": 0}, 0, 0)
    assert len(error.message) < 400


# -- tensor_nbytes ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype, shape, expected", [
    ("float32", (2, 3), 24),
    ("bool", (), 1),
    ("int16", (0,), 0),
    ("complex128", (4, 4), 256),
    ("bfloat16", (7,), 14),
    ("complex128", (MAX_TENSOR_BYTES // 16,), MAX_TENSOR_BYTES),
    ("uint8", (2**16, 2**16, 2**16), MAX_TENSOR_BYTES),
])
def test_tensor_nbytes(dtype, shape, expected):
    assert tensor_nbytes(dtype, shape) == expected


@pytest.mark.parametrize("dtype, shape", [
    ("complex128", (MAX_TENSOR_BYTES // 16 + 1,)),
    ("uint8", (2**16, 2**16, 2**16, 2)),
    ("float64", (2**40, 2**40)),
    ("int8", (MAX_TENSOR_BYTES, 2)),
    ("float32", (0, 2**48, 2**48)),  # holds no bytes, but a worker building it would overflow
    ("uint8", (2**30, 0, 2**30)),
])
def test_tensor_nbytes_refuses_overflowing_dims(dtype, shape):
    error = rejected(tensor_nbytes, dtype, shape)
    assert str(MAX_TENSOR_BYTES) in error.message


# -- check_tree ---------------------------------------------------------------------------------


def nested(leaf, levels: int, kind: str = "list"):
    node = leaf
    for _ in range(levels):
        node = [node] if kind == "list" else {"tuple": [node]}
    return node


@pytest.mark.parametrize("tree, n", [
    (0, 1),
    ([], 0),
    ([0, 1, 2], 3),
    ([2, 0, 1], 3),
    ({"tuple": [1, 0]}, 2),
    ({"dict": {"a": 0, "b": [1, {"tuple": [2]}]}}, 3),
    ({"dict": {}}, 0),
    ({"dict": {"k" * 256: 0}}, 1),
    (nested(0, MAX_TREE_DEPTH), 1),
    (nested(0, MAX_TREE_DEPTH, "tuple"), 1),
    (list(range(MAX_TENSORS)), MAX_TENSORS),
])
def test_check_tree_accepts_trees_using_every_tensor_once(tree, n):
    assert check_tree(tree, n) is None


@pytest.mark.parametrize("tree, n", [
    ([0, 0], 2),  # reuses 0 (and skips 1)
    ([0, 1, 0], 2),  # reuses 0
    ([0], 2),  # skips 1
    ([], 1),
    ({"dict": {"a": 0, "b": 0}}, 1),
    ({"tuple": [0, [0]]}, 1),
    ([0, 2], 2),  # out of range
    ([-1, 0], 2),
    ([0, 2**64], 2),
    ([0, True], 2),  # True == 1 but a bool is no index
    (False, 1),
    (0.0, 1),
    (None, 0),
    ("0", 1),
    ({"list": [0]}, 1),
    ({"tuple": 0}, 1),
    ({"tuple": [0], "dict": {}}, 1),
    ({"dict": [0]}, 1),
    ({"dict": {"k" * 257: 0}}, 1),
    (nested(0, MAX_TREE_DEPTH + 1), 1),
    (nested(0, MAX_TREE_DEPTH + 1, "tuple"), 1),
    (nested([], MAX_TREE_DEPTH + 1), 0),
    (nested(0, 10_000), 1),  # far deeper than Python's recursion limit: still a clean refusal
])
def test_check_tree_rejects_bad_trees(tree, n):
    rejected(check_tree, tree, n)


def test_check_tree_rejects_a_deep_dict_tree():
    tree = 0
    for _ in range(MAX_TREE_DEPTH + 1):
        tree = {"dict": {"x": tree}}
    rejected(check_tree, tree, 1)


# -- framing: unpack_header and split_router_message --------------------------------------------


def test_unpack_header_decodes_a_map():
    header = {"type": "infer", "id": 1, "tensors": [{"dtype": "float32", "shape": [1], "frame": 0}]}
    assert unpack_header(protocol.pack(header)) == header


@pytest.mark.parametrize("raw, problem", [
    (msgpack.packb({b"type": "infer", "id": 1}, use_bin_type=True), "map keys must be strings"),
    (msgpack.packb({"type": "infer", "tensors": [{b"dtype": "float32"}]}, use_bin_type=True),
     "map keys must be strings"),
    (msgpack.packb({"type": "infer", 1: 2}, use_bin_type=True), "not valid msgpack"),  # strict_map_key,
    (b"\x82" + protocol.pack("id") + protocol.pack(1) + protocol.pack("id") + protocol.pack(2),
     "repeats a key"),
    (b"\x81" + protocol.pack("inputs") + b"\x82" + protocol.pack("dict") + protocol.pack(0)
     + protocol.pack("dict") + protocol.pack(1), "repeats a key"),
])
def test_unpack_header_refuses_bin_and_repeated_keys(raw, problem):
    error = rejected(unpack_header, raw)
    assert problem in error.message


def test_unpack_header_without_strict_keeps_the_last_of_repeated_keys():
    # Only for headers a strict parse already accepted: documented, and pinned here.
    raw = b"\x82" + protocol.pack("id") + protocol.pack(1) + protocol.pack("id") + protocol.pack(2)
    assert unpack_header(raw, strict=False) == {"id": 2}


def test_unpack_header_reads_a_zmq_frame_buffer():
    frame = zmq.Frame(protocol.pack({"type": "hello", "id": "a"}))
    assert unpack_header(frame.buffer) == {"type": "hello", "id": "a"}


def test_unpack_header_accepts_exactly_max_header_bytes():
    overhead = len(protocol.pack({"a": "x" * 70_000})) - 70_000
    buf = protocol.pack({"a": "x" * (MAX_HEADER_BYTES - overhead)})
    assert len(buf) == MAX_HEADER_BYTES
    assert len(unpack_header(buf)["a"]) == MAX_HEADER_BYTES - overhead


def test_unpack_header_refuses_oversized_frames_before_decoding():
    buf = protocol.pack({"a": "x" * MAX_HEADER_BYTES})
    assert len(buf) > MAX_HEADER_BYTES
    error = rejected(unpack_header, buf)
    assert str(MAX_HEADER_BYTES) in error.message
    # size is checked first: even garbage of that size is refused for its size
    assert str(MAX_HEADER_BYTES) in rejected(unpack_header, b"\xc1" * (MAX_HEADER_BYTES + 1)).message


@pytest.mark.parametrize("buf", [
    b"",
    b"\xc1",  # never-used type byte
    b"\x81\xa1a",  # map with a key and no value
    protocol.pack({"a": 1}) + b"\x00",  # trailing bytes
    b"\x81\xa1a" + b"\x91" * 5000 + b"\x90",  # nested 5000 arrays deep
    msgpack.packb({1: 2}),  # non-string keys
    msgpack.packb({"a": b"x" * 129}, use_bin_type=True),  # bin longer than an id
    b"\x81\xa1a\xd4\x01\x02",  # ext type
    b"\xdf\xff\xff\xff\xff",  # map claiming 2**32-1 entries
    b"\xdd\xff\xff\xff\xff",  # array claiming 2**32-1 entries
    b"\xdb\xff\xff\xff\xff",  # str claiming 4 GiB
    bytes(range(256)),
])
def test_unpack_header_rejects_garbage(buf):
    error = rejected(unpack_header, buf)
    assert "msgpack" in error.message


@pytest.mark.parametrize("value", [[1, 2], 7, "infer", None, True, 1.5, b"bin"])
def test_unpack_header_rejects_non_map_headers(value):
    error = rejected(unpack_header, msgpack.packb(value, use_bin_type=True))
    assert "map" in error.message


def test_split_router_message_without_delimiter():
    envelope = split_router_message([b"peer", SIGNATURE, b"hdr", b"p0", b"p1"])
    assert envelope.route == [b"peer"]
    assert envelope.header == b"hdr"
    assert envelope.payload == [b"p0", b"p1"]


def test_split_router_message_with_delimiter_and_zmq_frames():
    frames = [zmq.Frame(b"peer"), zmq.Frame(b""), zmq.Frame(SIGNATURE), zmq.Frame(b"hdr")]
    envelope = split_router_message(frames)
    assert [bytes(f) for f in envelope.route] == [b"peer", b""]
    assert bytes(envelope.header) == b"hdr"
    assert envelope.payload == []
    assert protocol.reply_route(frames) == frames[:2]


@pytest.mark.parametrize("frames", [
    [b"peer"],
    [b"peer", b""],
    [b"peer", SIGNATURE],
    [b"peer", b"", SIGNATURE],
    [b"peer", b"MWP2", b"hdr"],
    [b"peer", b"mwp1", b"hdr"],
    [b"peer", b"MWP1\x00", b"hdr"],
    [b"peer", b"", b"", SIGNATURE, b"hdr"],  # two delimiters
    [b"peer", b"hdr", SIGNATURE],  # frames in the wrong order
])
def test_split_router_message_rejects_bad_framing(frames):
    rejected(split_router_message, frames)


def test_reply_route_of_malformed_messages():
    assert protocol.reply_route([b"peer"]) == [b"peer"]
    assert protocol.reply_route([b"peer", b"", b"x"]) == [b"peer", b""]
    assert protocol.reply_route([b"peer", b"x", b""]) == [b"peer"]


# -- parse_region and tokens -------------------------------------------------------------------


def test_parse_region_accepts_a_valid_region():
    assert parse_region([SEG, 0, 1], "'out'") == (SEG, 0, 1)
    assert parse_region([SEG2, protocol.MAX_INT, protocol.MAX_INT], "'out'") == \
        (SEG2, protocol.MAX_INT, protocol.MAX_INT)


BAD_TOKENS = [
    "/dev/shm/" + SEG,
    "../" + SEG,
    SEG + "/../../etc/passwd",
    "mw.123.456." + SEG,  # an old segment name is no token
    "0123456789ABCDEF" * 2,  # uppercase hex
    SEG + "0",  # 33 hex digits
    SEG[:-1],  # 31 hex digits
    "0123456789abcdeg" * 2,
    "٠١٢٣٤٥٦٧٨٩abcdef" * 2,  # non-ASCII digits
    " " + SEG,
    SEG + " ",
    SEG + "\x00",
    SEG + "\n",
    "modelwarden-secret-buffer",
]


@pytest.mark.parametrize("token", BAD_TOKENS)
def test_parse_region_rejects_bad_tokens_without_echoing_them(token):
    error = rejected(parse_region, [token, 0, 16], "tensor 3")
    assert token not in error.message
    assert token.strip() not in error.message
    assert "tensor 3" in error.message


@pytest.mark.parametrize("token", [None, 7, SEG.encode(), [SEG], ""])
def test_parse_region_rejects_non_string_tokens(token):
    rejected(parse_region, [token, 0, 16], "x")


@pytest.mark.parametrize("region", [
    [SEG, 2**64 - 32, 32],
    [SEG, 2**63, 1],
    [SEG, -1, 16],
    [SEG, 0, -16],
    [SEG, True, 16],
    [SEG, 0, False],
    [SEG, 1.0, 16],
    [SEG, "0", 16],
    [SEG, 0, None],
    [SEG, 0],
    [SEG, 0, 16, 0],
    (SEG, 0, 16),  # msgpack decodes arrays as lists; a tuple is not what the wire gives
    {"token": SEG},
    SEG,
    None,
])
def test_parse_region_rejects_bad_offsets_and_shapes_without_echoing_the_token(region):
    error = rejected(parse_region, region, "'out'")
    assert SEG not in error.message


def test_no_buffer_error_echoes_the_token():
    """Every refusal in a request that names a buffer leaves the token out of the message."""
    secret = "5ec12e7" + "0" * 25
    headers = [
        infer_header(tensors=[{"dtype": "float32", "shape": [2], "shm": [secret, 0, 9]}], inputs=[0]),
        infer_header(tensors=[{"dtype": "float32", "shape": [2], "shm": [secret, -1, 8]}], inputs=[0]),
        infer_header(tensors=[{"dtype": "float32", "shape": [2], "shm": [secret, 0, 8],
                               "frame": 0}], inputs=[0]),
        infer_header(tensors=[{"dtype": "float32", "shape": [2], "shm": [secret + "/x", 0, 8]}],
                     inputs=[0]),
        infer_header(out=[secret, 2**64 - 32, 32]),
        infer_header(out=[secret + "..", 0, 32]),
        infer_header(out=[secret, 0, 32], timeout_ms=-5),
        infer_header(tensors=[{"dtype": "float32", "shape": [2], "shm": [secret, 0, 8]}], inputs=[0, 0]),
    ]
    for header in headers:
        error = rejected(parse_infer, header, 0 if "out" not in header else 1)
        assert "5ec12e7" not in error.message, error.message


# -- the rest of the request path that needs no socket ------------------------------------------


def test_frame_lengths_must_match_descriptors():
    tensors = parse_infer(infer_header(), 1).tensors
    protocol.frame_lengths_match(tensors, [b"\x00" * 24])
    for payload in ([b"\x00" * 23], [b"\x00" * 25], [b""]):
        rejected(protocol.frame_lengths_match, tensors, payload)


def test_request_id_of_falls_back_to_none():
    assert protocol.request_id_of({"id": -5}) == -5
    assert protocol.request_id_of({"id": "abc"}) == "abc"
    for rid in (True, False, None, 1.0, [1], "é" * 65, 2**63, -(2**63)):
        assert protocol.request_id_of({"id": rid}) is None


def test_add_to_map_appends_an_entry_without_decoding():
    import msgpack
    packed = protocol.pack({"id": 7, "ok": True, "worker": "m#0"})
    grown = protocol.add_to_map(memoryview(packed), "timing", {"queue_us": 3, "batch": 2})
    assert msgpack.unpackb(grown) == {"id": 7, "ok": True, "worker": "m#0",
                                      "timing": {"queue_us": 3, "batch": 2}}
    big = protocol.pack({f"k{i}": i for i in range(15)})  # a full fixmap: decoded and re-packed
    assert msgpack.unpackb(protocol.add_to_map(big, "timing", 1))["timing"] == 1


def test_the_one_reply_splitter_takes_frames_or_bytes_and_refuses_what_is_not_a_reply():
    """split_reply serves the client, the control request and the gateway's catalog alike."""
    from modelwarden.shared.errors import InternalError

    header = protocol.pack({"id": 3, "ok": True})
    for frames in ([protocol.SIGNATURE, header, b"payload"], [b"", protocol.SIGNATURE, header, b"payload"]):
        for kind in (bytes, zmq.Frame):
            got, payload = protocol.split_reply([kind(frame) for frame in frames])
            assert got == {"id": 3, "ok": True} and [bytes(part) for part in payload] == [b"payload"]
    for frames in ([b"MDPC99", header], [protocol.SIGNATURE], [b"", header, protocol.SIGNATURE]):
        with pytest.raises(InternalError, match="malformed reply from the daemon"):
            protocol.split_reply(frames)


# -- str/bytes element descriptors: every check made from the header alone ----------------------


def element(**changes) -> dict:
    desc = {"dtype": "str", "shape": [3], "nbytes": 27, "longest": 11, "frame": 0}
    desc.update(changes)
    return {key: value for key, value in desc.items() if value is not None}


def test_an_element_descriptor_parses_with_its_sizes():
    assert parse_tensor_desc(element(), 0, 0) == TensorDesc("str", (3,), 27, frame=0, longest=11)
    desc = parse_tensor_desc(element(dtype="bytes", frame=None, shm=[SEG, 8, 27]), 0, 0)
    assert desc == TensorDesc("bytes", (3,), 27, shm=(SEG, 8, 27), longest=11)
    assert parse_tensor_desc(element(shape=[0], nbytes=0, longest=0), 0, 0).nbytes == 0
    # a fixed dtype keeps longest None
    assert parse_tensor_desc({"dtype": "uint8", "shape": [2], "frame": 0}, 0, 0).longest is None


def test_the_limits_are_the_contracts():
    assert protocol.ELEMENT_TYPES == ("str", "bytes")
    assert protocol.MAX_ELEMENTS == 65536 and protocol.MAX_ELEMENT_BYTES == 64 << 20
    assert set(protocol.DTYPES).isdisjoint(protocol.ELEMENT_TYPES)


@pytest.mark.parametrize("changes, words", [
    (dict(nbytes=None), "nbytes"),
    (dict(longest=None), "longest"),
    (dict(nbytes=27.0), "nbytes"),
    (dict(longest=True), "longest"),
    (dict(nbytes=-1), "nbytes"),
    (dict(shape=[10**6], nbytes=4 * 10**6, longest=0), "65536"),  # a million empty strings
    (dict(shape=[0, 70000], nbytes=0, longest=0), "65536"),  # zero dims count as one
    (dict(shape=[1], nbytes=(1 << 30) + 4, longest=1 << 30), "exceed"),  # one 1 GiB string
    (dict(nbytes=11), "prefixes"),  # 3 elements need 12 bytes of prefixes
    (dict(longest=16), "longest"),  # 27 - 12 = 15 bytes for the elements
    (dict(frame=None, shm=[SEG, 0, 26]), "nbytes"),  # a region of another size
])
def test_element_descriptors_refused_from_the_header(changes, words):
    error = rejected(parse_tensor_desc, element(**changes), 0, 0)
    assert words in error.message, error.message
    assert SEG not in error.message


def test_an_inline_element_frame_must_hold_nbytes():
    descs = protocol.parse_tensors([element()])
    protocol.frame_lengths_match(descs, [b"x" * 27])
    error = rejected(protocol.frame_lengths_match, descs, [b"x" * 26])
    assert "nbytes" in error.message


# -- InferCache: the parse of a header seen before, but for its id ------------------------------


def _infer_header(rid, **fields) -> bytes:
    header = {"type": "infer", "id": rid, "model": "m", "inputs": 0,
              "tensors": [{"dtype": "float32", "shape": [2, 3], "frame": 0}], **fields}
    return protocol.pack(header)


def _same(a, b) -> bool:
    return (a.id, a.model, a.tree, a.tensors, a.timeout_ms, a.out) == \
        (b.id, b.model, b.tree, b.tensors, b.timeout_ms, b.out)


def test_the_cache_gives_what_the_full_parse_gives_for_every_id():
    cache = protocol.InferCache()
    first = _infer_header(1, timeout_ms=500)
    cache.learn(first, protocol.parse_infer(unpack_header(first), 1), 1)
    ids = [0, 7, 127, 128, 255, 65535, 2**32, 2**63 - 1, -1, -33, -2**63 + 1, "", "x", "é" * 64]
    for rid in ids:
        header = _infer_header(rid, timeout_ms=500)
        hit = cache.parse(header, 1)
        assert hit is not None and _same(hit, protocol.parse_infer(unpack_header(header), 1)), rid


@pytest.mark.parametrize("header, frames", [
    (_infer_header(2**63, timeout_ms=500), 1),  # an id the full parse refuses
    (_infer_header("x" * 129, timeout_ms=500), 1),  # an id too long
    (_infer_header(True, timeout_ms=500), 1),  # not an int
    (_infer_header(1.5, timeout_ms=500), 1),
    (_infer_header([1], timeout_ms=500), 1),
    (_infer_header(None, timeout_ms=500), 1),
    (_infer_header(3, timeout_ms=501), 1),  # the same but for another field
    (_infer_header(3, timeout_ms=500), 2),  # another frame count
    (_infer_header(3, timeout_ms=500) + b"\x00", 1),  # a byte more
    (_infer_header(3, timeout_ms=500)[:-1], 1),  # a byte less
    (_infer_header(3, timeout_ms=500).replace(b"\xa1m", b"\xa1n"), 1),  # another model
    (memoryview(_infer_header(3, timeout_ms=500)), 1),  # not bytes: never looked up
])
def test_the_cache_finds_nothing_the_full_parse_would_not_give_the_same(header, frames):
    cache = protocol.InferCache()
    first = _infer_header(1, timeout_ms=500)
    cache.learn(first, protocol.parse_infer(unpack_header(first), 1), 1)
    assert cache.parse(header, frames) is None


def test_the_cache_is_bounded_and_starts_afresh():
    cache = protocol.InferCache(size=4)
    for model in "abcdef":
        header = protocol.pack({"type": "infer", "id": 1, "model": model, "inputs": 0,
                                "tensors": [{"dtype": "uint8", "shape": [1], "frame": 0}]})
        cache.learn(header, protocol.parse_infer(unpack_header(header), 1), 1)
        assert cache.count <= 4
    assert cache.count == 2 and cache.parse(header.replace(b"\x01", b"\x02", 1), 1).model == "f"
    big = _infer_header(1, timeout_ms=500, pad="x" * protocol.InferCache.LONGEST)
    cache.learn(big, protocol.parse_infer(unpack_header(big), 1), 1)
    assert cache.parse(big, 1) is None  # too long to remember


COUNTS = [0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 1]


@pytest.mark.parametrize("header", [
    {"id": 9, "ok": True, "outputs": 0, "worker": "m#0"},  # a fixmap with room for timing
    {"id": 9, "ok": False, "error": {"code": "BAD_INPUT", "message": "no"}},
    {f"k{index}": index for index in range(15)},  # a full fixmap: the map grows a map16
])
def test_add_timing_writes_what_msgpack_writes_for_the_map_with_timing(header):
    packed = msgpack.packb(header)
    odd = [None, -1, 1.5, 2**64, "x"]  # what a broken worker may report instead of a count
    for index, count in enumerate(COUNTS + odd):
        queue_us, total_us = COUNTS[index % len(COUNTS)], COUNTS[-1 - index % len(COUNTS)]
        timing = {"queue_us": queue_us, "compute_us": count, "total_us": total_us,
                  "batch": COUNTS[(index + 3) % len(COUNTS)]}
        if count == 2**64:  # msgpack cannot write it either
            with pytest.raises(OverflowError):
                protocol.add_timing(packed, queue_us, count, total_us, timing["batch"])
            continue
        expected = msgpack.packb({**header, "timing": timing})
        assert protocol.add_timing(packed, queue_us, count, total_us, timing["batch"]) == expected
        # a header frame may arrive as any buffer (a large one stays in libzmq's memory)
        assert protocol.add_timing(memoryview(packed), queue_us, count, total_us,
                                   timing["batch"]) == expected


def _result(**fields) -> bytes:
    return msgpack.packb({"type": "result", "rid": 7, "ok": True, "compute_us": 250, "batch": 1,
                          **fields})


def test_read_result_gives_what_the_full_decode_gives_for_every_count_width():
    for index, count in enumerate(COUNTS):
        packed = _result(rid=count, compute_us=COUNTS[-1 - index], batch=COUNTS[index // 2])
        found = protocol.read_result(packed)
        assert found == protocol.unpack_header(packed, strict=False), count
        assert list(found) == ["type", "rid", "ok", "compute_us", "batch"]


def test_the_workers_result_header_is_msgpacks_bytes_and_read_result_reads_it_in_place():
    for index, count in enumerate(COUNTS):
        fields = {"rid": count, "compute_us": COUNTS[-1 - index], "batch": COUNTS[index // 2]}
        written = protocol.result_header(fields["rid"], fields["compute_us"], fields["batch"])
        assert written == msgpack.packb({"type": "result", "rid": fields["rid"], "ok": True,
                                         "compute_us": fields["compute_us"],
                                         "batch": fields["batch"]}), fields
        assert protocol.read_result(written) == {"type": "result", "ok": True, **fields}


@pytest.mark.parametrize("out", [None, ["tok", 4096, 1 << 20]])
@pytest.mark.parametrize("rid", [1, 2**40, "request-7", 2**64 - 1])
def test_the_clients_request_header_is_msgpacks_bytes_of_its_map(rid, out):
    tree = {"dict": {"x": 0, "y": [1, {"tuple": [2]}]}}
    tensors = [{"dtype": "float32", "shape": [1, 256], "frame": 0},
               {"dtype": "str", "shape": [2], "nbytes": 12, "longest": 3, "shm": ["t", 0, 12]},
               {"dtype": "int64", "shape": [], "frame": 1}]
    header = {"type": "infer", "id": rid, "model": "mod\u00e9l", "inputs": tree,
              "tensors": tensors, "timeout_ms": 30_000}
    if out is not None:
        header["out"] = out
    written = protocol.infer_header(rid, "mod\u00e9l", tree, tensors, 30_000, out)
    assert written == msgpack.packb(header, use_bin_type=True)
    assert protocol.unpack_header(written) == header


@pytest.mark.parametrize("client_id", [1, 2**63, "c-1", None])
@pytest.mark.parametrize("version", [None, "v2"])
def test_the_workers_reply_header_is_msgpacks_bytes_of_its_map(client_id, version):
    """Byte for byte what packing the map writes: the client's reply cache reads its layout."""
    tree = [0, {"dict": {"y": 1}}]
    tensors = [{"dtype": "float32", "shape": [1, 10], "frame": 0},
               {"dtype": "uint8", "shape": [4096], "shm": ["tok", 64, 4096]}]
    written = protocol.reply_header(client_id, tree, tensors, "w1-0", version)
    reply = {"id": client_id, "ok": True, "outputs": tree, "tensors": tensors, "worker": "w1-0",
             "version": version}
    assert written == msgpack.packb(reply, use_bin_type=True)
    assert protocol.unpack_header(written, strict=False) == reply


@pytest.mark.parametrize("rid, compute_us", [(-1, 5), (7, 1.5), ("7", 5), (True, 5)])
def test_a_result_header_of_values_that_are_not_counts_is_packed_as_a_map(rid, compute_us):
    written = protocol.result_header(rid, compute_us, 1)
    assert msgpack.unpackb(written) == {"type": "result", "rid": rid, "ok": True,
                                        "compute_us": compute_us, "batch": 1}
    assert protocol.read_result(written) is None


@pytest.mark.parametrize("packed", [
    _result(ok=False),  # a failure: the decode reads it (it carries a code)
    _result(rid=-1),  # a count that is not a uint
    _result(compute_us=1.5),
    _result(batch="1"),
    _result(cuda_bytes=5),  # one more key (a probe on a GPU)
    msgpack.packb({"type": "result", "ok": True, "rid": 7, "compute_us": 250, "batch": 1}),
    msgpack.packb({"type": "results", "rid": 7, "ok": True, "compute_us": 250, "batch": 1}),
    _result() + b"\x00",  # a byte more
    _result()[:-1],  # a byte less
    bytearray(_result()),  # not bytes
])
def test_read_result_reads_nothing_but_the_workers_success_layout(packed):
    assert protocol.read_result(packed) is None


# -- ReplyCache: the parse of a reply header seen before, but for its id and timing -------------


def _reply_header(rid, queue_us=5, compute_us=120, total_us=300, batch=1, **fields) -> bytes:
    """A success header as the daemon writes it: the worker's map (id first), then the
    supervisor's timing appended."""
    worker = protocol.pack({"id": rid, "ok": True, "outputs": 0,
                            "tensors": [{"dtype": "float32", "shape": [2, 3], "frame": 0}],
                            "worker": "m#0", "version": "v1", **fields})
    return protocol.add_timing(worker, queue_us, compute_us, total_us, batch)


FRAME = [b"\x00" * 24]


def _learnt(*headers: bytes) -> descriptors.ReplyCache:
    cache = descriptors.ReplyCache()
    for header in headers:
        parsed = unpack_header(header, strict=False)
        cache.learn(header, len(parsed), descriptors.parse_reply(parsed, FRAME), 1)
    return cache


def test_the_reply_cache_gives_what_the_full_parse_gives_for_every_id_and_timing():
    cache = _learnt(_reply_header(1))
    ids = [0, 7, 127, 128, 2**32, 2**63 - 1, 2**64 - 1, -1, -2**63, "", "x", "é" * 64]
    counts = [0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 1]
    for rid, count in zip(ids, counts * 2):
        header = _reply_header(rid, queue_us=count, compute_us=counts[-1] - count, total_us=count,
                               batch=count % 7)
        found = cache.parse(header, FRAME)
        parsed = unpack_header(header, strict=False)
        assert found is not None, (rid, count)
        assert found == (parsed["id"], descriptors.parse_reply(parsed, FRAME)), (rid, count)


@pytest.mark.parametrize("header, frames", [
    (_reply_header(3, compute_us=-1), FRAME),  # a count the full parse refuses
    (protocol.add_timing(protocol.pack({"id": 3, "ok": True, "outputs": 0, "tensors": [
        {"dtype": "float32", "shape": [2, 3], "frame": 0}], "worker": "m#0", "version": "v1"}),
        5, 1.5, 300, 1), FRAME),  # a count that is not an int
    (_reply_header(3.5), FRAME),  # an id that is neither an int nor a str
    (_reply_header("x" * 129), FRAME),  # an id too long
    (_reply_header(3, version="v2"), FRAME),  # the same but for another field
    (_reply_header(3), [b"\x00" * 23]),  # a frame of the wrong length
    (_reply_header(3), FRAME * 2),  # another frame count
    (_reply_header(3) + b"\x00", FRAME),  # a byte more
    (_reply_header(3)[:-1], FRAME),  # a byte less
])
def test_the_reply_cache_finds_nothing_the_full_parse_would_not_give_the_same(header, frames):
    assert _learnt(_reply_header(1)).parse(header, frames) is None


def test_the_reply_cache_learns_only_maps_without_a_repeated_key():
    # The lax decode keeps a repeated key's last value: here the id after the first one.
    twice = _reply_header(1).replace(b"\x87\xa2id\x01", b"\x88\xa2id\x01\xa2id\x02", 1)
    assert unpack_header(twice, strict=False)["id"] == 2
    cache = _learnt(twice)
    assert cache.entries == []
    assert cache.parse(twice.replace(b"\xa2id\x01", b"\xa2id\x05", 1), FRAME) is None


def test_the_reply_cache_learns_no_failure_and_is_bounded():
    failure = protocol.add_timing(protocol.pack({"id": 1, "ok": False, "error": {
        "code": "BAD_INPUT", "message": "no"}}), 1, 2, 3, 1)
    cache = descriptors.ReplyCache(size=4)
    parsed = unpack_header(failure, strict=False)
    cache.learn(failure, len(parsed), descriptors.parse_reply(parsed, []), 0)
    assert cache.entries == []
    for version in "abcdef":
        header = _reply_header(1, version=version)
        parsed = unpack_header(header, strict=False)
        cache.learn(header, len(parsed), descriptors.parse_reply(parsed, FRAME), 1)
        assert len(cache.entries) <= 4
    assert len(cache.entries) == 2 and cache.parse(_reply_header(9, version="f"), FRAME)[1].version == "f"


@pytest.mark.parametrize("value", [0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32,
                                   2**64 - 1])
def test_uint_at_reads_every_unsigned_form_as_msgpack_does(value):
    packed = b"\x00" + protocol.pack_uint(value)
    assert mpack.uint_at(packed, 1, len(packed)) == msgpack.unpackb(packed[1:]) == value
    assert mpack.uint_at(packed, 1, len(packed) - 1) == -1  # not exactly those bytes


@pytest.mark.parametrize("value", [-1, -32, -33, -200, 1.5, "x", None, True])
def test_uint_at_refuses_what_is_not_an_unsigned_int(value):
    packed = msgpack.packb(value)
    assert mpack.uint_at(packed, 0, len(packed)) == -1
