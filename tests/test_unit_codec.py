"""Unit tests of the codec: descriptors built (shared/descriptors.py, shared/codec.py) and replies
read (``parse_reply``). No daemon, no sockets.

A malformed reply must come back as ProtocolError(INTERNAL) -- the sender's bug -- and never as
another exception: the client turns it into InternalError, the supervisor into a failed probe.
"""

from __future__ import annotations

import copy
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import zmq

from modelwarden.shared import codec, protocol
from modelwarden.shared.codec import (DTYPE_NAMES, OutRegion, alias_region, copy_into, encode, raw_bytes,
                                      encode_leaves, frame_tensor, from_bytes,
                                      inline_only, reply_placement, unflatten)
from modelwarden.shared.descriptors import (InferReply, ReplyError, inline_desc, parse_reply,
                                            parse_reply_tensors, shm_desc, wire_desc)
from modelwarden.shared.protocol import INTERNAL, ProtocolError, TensorDesc

TOKEN = "0123456789abcdef" * 2
OUT_TOKEN = "fedcba9876543210" * 2


def good_header(**changes) -> dict:
    header = {
        "id": 7, "ok": True, "worker": "mlp#1",
        "outputs": {"tuple": [0, {"dict": {"w": 1}}, [2]]},
        "tensors": [
            {"dtype": "float32", "shape": [2, 3], "frame": 0},
            {"dtype": "int64", "shape": [4], "shm": [TOKEN, 64, 32]},
            {"dtype": "bool", "shape": [], "frame": 1},
        ],
        "timing": {"queue_us": 12, "compute_us": 230, "total_us": 410},
    }
    header.update(changes)
    return header


def good_frames() -> list:
    return [zmq.Frame(bytes(24)), zmq.Frame(b"\x01")]


def malformed(header, frames=None, **kwargs) -> ProtocolError:
    """Parse and insist on ProtocolError(INTERNAL): any other exception fails the test."""
    with pytest.raises(ProtocolError) as info:
        parse_reply(header, good_frames() if frames is None else frames, **kwargs)
    assert info.value.code == INTERNAL, info.value.code
    assert info.value.message.startswith("malformed reply: ")
    return info.value


# -- good replies --------------------------------------------------------------------------------


def test_a_success_is_read_whole():
    reply = parse_reply(good_header(), good_frames())
    assert isinstance(reply, InferReply)
    assert reply.ok and reply.id == 7 and reply.worker == "mlp#1" and reply.error is None
    assert reply.outputs == {"tuple": [0, {"dict": {"w": 1}}, [2]]}
    assert reply.tensors == [TensorDesc("float32", (2, 3), 24, frame=0),
                             TensorDesc("int64", (4,), 32, shm=(TOKEN, 64, 32)),
                             TensorDesc("bool", (), 1, frame=1)]
    assert reply.timing == {"queue_us": 12, "compute_us": 230, "total_us": 410}


def test_optional_fields_may_be_absent_and_unknown_timing_names_are_kept():
    header = good_header(timing={"queue_us": 1, "batch": 16})
    del header["worker"], header["id"]
    reply = parse_reply(header, good_frames())
    assert reply.id is None and reply.worker is None and reply.timing["batch"] == 16
    del header["timing"]
    assert parse_reply(header, good_frames()).timing == {}


def test_a_worker_result_is_a_reply_too():
    result = {"type": "result", "rid": 3, "ok": True, "outputs": 0, "compute_us": 5,
              "tensors": [{"dtype": "float32", "shape": [1], "frame": 0}]}
    reply = parse_reply(result, [b"\x00" * 4])
    assert reply.ok and reply.id is None and reply.tensors[0].frame == 0


def test_an_empty_output_list_is_fine():
    reply = parse_reply(good_header(outputs=[], tensors=[]), [])
    assert reply.ok and reply.tensors == [] and reply.outputs == []


@pytest.mark.parametrize("detail", [None, protocol.BUFFER_NOT_REGISTERED])
def test_a_failure_with_and_without_detail(detail):
    header = protocol.error_header(9, protocol.BAD_INPUT, "wrong shape", detail)
    header["worker"] = "mlp#2"
    reply = parse_reply(header, [])
    assert not reply.ok and reply.id == 9 and reply.worker == "mlp#2"
    assert reply.error == ReplyError(protocol.BAD_INPUT, "wrong shape", detail)
    assert reply.tensors == [] and reply.outputs is None


def test_a_failure_with_an_unknown_code_is_still_read():
    # A newer daemon may answer a code this client does not know: the client raises RemoteError.
    reply = parse_reply(protocol.error_header(1, "NEW_CODE", "m"), [])
    assert reply.error.code == "NEW_CODE"


# -- malformed replies -------------------------------------------------------------------------


@pytest.mark.parametrize("header", [None, [], "ok", 3])
def test_a_header_that_is_not_a_map(header):
    malformed(header)


@pytest.mark.parametrize("ok", ["missing", None, 1, 0, "true", []])
def test_ok_must_be_a_bool(ok):
    header = good_header()
    if ok == "missing":
        del header["ok"]
    else:
        header["ok"] = ok
    assert "'ok'" in malformed(header).message


def test_a_success_without_outputs():
    header = good_header()
    del header["outputs"]
    assert "'outputs'" in malformed(header).message


@pytest.mark.parametrize("tensors", ["missing", None, {}, "x", [1], [[]]])
def test_tensors_must_be_a_list_of_descriptor_maps(tensors):
    header = good_header()
    if tensors == "missing":
        del header["tensors"]
    else:
        header["tensors"] = tensors
    malformed(header)


@pytest.mark.parametrize("desc", [
    {"shape": [1], "frame": 0},                                  # no dtype
    {"dtype": "float128", "shape": [1], "frame": 0},             # unknown dtype
    {"dtype": 4, "shape": [1], "frame": 0},                      # dtype not a str
    {"dtype": "float32", "frame": 0},                            # no shape
    {"dtype": "float32", "shape": "1", "frame": 0},              # shape not a list
    {"dtype": "float32", "shape": [-1], "frame": 0},             # negative dimension
    {"dtype": "float32", "shape": [True], "frame": 0},           # bool is not an int
    {"dtype": "float32", "shape": [1]},                          # neither frame nor shm
    {"dtype": "float32", "shape": [1], "frame": 0, "shm": [TOKEN, 0, 4]},  # both
    {"dtype": "float32", "shape": [1], "frame": "0"},            # frame not an int
    {"dtype": "float32", "shape": [1], "shm": [TOKEN, 0]},       # short region
    {"dtype": "float32", "shape": [1], "shm": ["nothex", 0, 4]},  # bad token
    {"dtype": "float32", "shape": [1], "shm": [TOKEN, 0, 8]},    # nbytes != dtype x shape
])
def test_every_bad_descriptor(desc):
    frames = [b"\x00" * 4] if "frame" in desc else []
    malformed(good_header(outputs=0, tensors=[desc]), frames)


def test_a_bad_token_is_never_echoed():
    secret = "S3CRET" * 6
    error = malformed(good_header(outputs=0, tensors=[
        {"dtype": "float32", "shape": [1], "shm": [secret, 0, 4]}]), [])
    assert secret not in error.message


@pytest.mark.parametrize("numbers", [[1, 0], [0, 0], [0, 2], [5, 1]])
def test_frames_are_numbered_in_order(numbers):
    descs = [{"dtype": "uint8", "shape": [1], "frame": n} for n in numbers]
    malformed(good_header(outputs=[0, 1], tensors=descs), [b"a", b"b"])


def test_a_frame_index_past_the_frames():
    descs = [{"dtype": "uint8", "shape": [1], "frame": 0}, {"dtype": "uint8", "shape": [1], "frame": 1}]
    assert "2 inline tensors but 1 payload frames" in malformed(
        good_header(outputs=[0, 1], tensors=descs), [b"a"]).message


def test_more_frames_than_inline_tensors():
    malformed(good_header(), good_frames() + [b"extra"])


@pytest.mark.parametrize("first", [bytes(23), bytes(25), b""])
def test_a_frame_length_mismatch(first):
    assert "needs 24" in malformed(good_header(), [first, b"\x01"]).message


def test_a_shared_memory_descriptor_where_only_inline_may_come():
    assert "shared-memory" in malformed(good_header(), shm=False).message
    inline_only_header = good_header(outputs=0, tensors=[good_header()["tensors"][0]])
    assert parse_reply(inline_only_header, [bytes(24)], shm=False).ok


@pytest.mark.parametrize("tree", [None, 3, [0, 1], [0, 1, 2, 2], {"tuple": 0},
                                  {"dict": {"a": 0}, "tuple": [1]}, {"set": [0, 1, 2]}])
def test_an_outputs_tree_that_does_not_use_every_tensor_once(tree):
    malformed(good_header(outputs=tree))


@pytest.mark.parametrize("timing", [[], "1", {"queue_us": -1}, {"queue_us": 1.5},
                                    {"queue_us": True}, {1: 1}, {"queue_us": None}])
def test_timing_is_a_map_of_counters(timing):
    assert "'timing'" in malformed(good_header(timing=timing)).message


@pytest.mark.parametrize("worker", [3, b"mlp#1", "w" * 300])
def test_worker_is_a_short_string(worker):
    assert "'worker'" in malformed(good_header(worker=worker)).message


@pytest.mark.parametrize("error", ["missing", None, "boom", [], {"message": "m"},
                                   {"code": 5, "message": "m"}, {"code": "", "message": "m"},
                                   {"code": "X" * 65, "message": "m"}, {"code": "BAD_INPUT"},
                                   {"code": "BAD_INPUT", "message": 3},
                                   {"code": "BAD_INPUT", "message": "m", "detail": 4}])
def test_a_failure_needs_a_well_formed_error(error):
    header = {"id": 1, "ok": False}
    if error != "missing":
        header["error"] = error
    assert "'error" in malformed(header, []).message


def test_a_failure_carries_no_payload():
    assert "no payload" in malformed(protocol.error_header(1, "BAD_INPUT", "m"), [b"x"]).message


def test_mutated_replies_never_raise_anything_but_protocol_error():
    """Random damage to a good reply: every outcome is a parsed reply or ProtocolError(INTERNAL)."""
    rng = random.Random(9)
    junk = [None, -1, 0, 1, 2**70, 1.5, "", "x", b"x", [], {}, [0], {"dict": {}}, True]

    def damage(node):
        if isinstance(node, dict) and node and rng.random() < 0.7:
            key = rng.choice(list(node))
            if rng.random() < 0.3:
                del node[key]
            elif rng.random() < 0.5:
                node[key] = rng.choice(junk)
            else:
                damage(node[key])
        elif isinstance(node, list) and node:
            index = rng.randrange(len(node))
            if rng.random() < 0.5:
                node[index] = rng.choice(junk)
            else:
                damage(node[index])

    for _ in range(3000):
        header = copy.deepcopy(good_header())
        damage(header)
        try:
            parse_reply(header, good_frames())
        except ProtocolError as exc:
            assert exc.code == INTERNAL


# -- builders ----------------------------------------------------------------------------------


def test_built_descriptors_parse_back_to_themselves():
    descs = [inline_desc("float16", (2, 2), 0), shm_desc("int8", [3], (TOKEN, 128, 3)),
             inline_desc("complex64", (), 1)]
    assert descs[0] == {"dtype": "float16", "shape": [2, 2], "frame": 0}
    assert descs[1] == {"dtype": "int8", "shape": [3], "shm": [TOKEN, 128, 3]}
    tensors = parse_reply_tensors(descs, [bytes(8), bytes(8)])
    assert [wire_desc(desc) for desc in tensors] == descs


VALUES = {
    "tensor": torch.arange(6, dtype=torch.float32).reshape(2, 3),
    "tuple": (torch.ones(2, dtype=torch.int64), torch.tensor(True), torch.zeros(0, 4)),
    "dict": {"a": torch.randn(3).to(torch.bfloat16), "b": [torch.tensor([1 + 2j])]},
    "numpy": np.arange(5, dtype=np.int16),
    "noncontiguous": torch.arange(12, dtype=torch.float64).reshape(3, 4).t(),
}


@pytest.mark.parametrize("name", list(VALUES))
def test_encode_inline_round_trips_through_the_reply_parser(name):
    value = VALUES[name]
    encoded = encode(value, inline_only)
    frames = [zmq.Frame(bytes(frame)) for frame in encoded.frames]  # as received
    reply = parse_reply({"ok": True, "outputs": encoded.tree, "tensors": encoded.descs}, frames)
    back = unflatten(reply.outputs, [frame_tensor(desc, frames) for desc in reply.tensors])
    assert_same(back, value)


def assert_same(got, want):
    if isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want)
        for item, expected in zip(got, want):
            assert_same(item, expected)
    elif isinstance(want, dict):
        assert got.keys() == want.keys()
        for key in want:
            assert_same(got[key], want[key])
    else:
        want = torch.from_numpy(want) if isinstance(want, np.ndarray) else want
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)


def test_encode_refuses_what_cannot_travel():
    with pytest.raises(TypeError):
        encode({"a": 3}, inline_only)
    with pytest.raises(TypeError):
        encode(torch.zeros(2, dtype=torch.uint16), inline_only)


# -- the worker's placement: alias, out region, inline ---------------------------------------------


def segment(nbytes: int, token: str) -> SimpleNamespace:
    array = np.zeros(nbytes, dtype=np.uint8)
    return SimpleNamespace(array=array, address=array.ctypes.data, size=nbytes, token=token)


def test_alias_region_finds_a_view_of_an_input():
    source = segment(4096, TOKEN)
    whole = torch.from_numpy(source.array).view(torch.float32)
    assert alias_region(whole[256:512], 1024, [source]) == (source, 1024)
    assert alias_region(whole[::2], 2048, [source]) is None  # not contiguous
    assert alias_region(torch.zeros(4), 16, [source]) is None  # elsewhere
    assert alias_region(whole[:0], 0, [source]) is None  # empty: nothing to point at
    assert alias_region(whole, 4096, []) is None


def test_reply_placement_aliases_writes_out_then_goes_inline():
    source, out_segment = segment(4096, TOKEN), segment(1000, OUT_TOKEN)
    out = OutRegion(OUT_TOKEN, 64, out_segment.array[64:], align=64)  # 936 bytes of room
    aliased = torch.from_numpy(source.array).view(torch.float32)[16:32]
    big = torch.arange(100, dtype=torch.float32)  # 400 bytes: fits
    second = torch.arange(100, 200, dtype=torch.float32)  # fits at the next aligned offset (448)
    third = torch.ones(100, dtype=torch.float32)  # 400 more do not fit: inline
    small = torch.ones(2)  # under the threshold: inline
    encoded = encode((aliased, big, second, third, small),
                     reply_placement([source], out, threshold=64))
    shm = [desc.get("shm") for desc in encoded.descs]
    assert shm[:3] == [[TOKEN, 64, 64], [OUT_TOKEN, 64, 400], [OUT_TOKEN, 64 + 448, 400]]
    assert shm[3:] == [None, None] and len(encoded.frames) == 2
    written = torch.from_numpy(out_segment.array[64:]).view(torch.float32)
    assert torch.equal(written[:100], big) and torch.equal(written[112:212], second)
    assert out.cursor == 896


def test_reply_placement_without_out_region_or_sources_is_inline():
    encoded = encode([torch.ones(1000)], reply_placement([], None, threshold=0))
    assert encoded.descs == [inline_desc("float32", [1000], 0)]


def test_encode_leaves_is_encode_without_the_tree():
    leaves = [torch.ones(3), np.zeros(2, dtype=np.int8)]
    descs, frames = encode_leaves(leaves, inline_only)
    assert descs == encode(leaves, inline_only).descs
    assert [bytes(frame) for frame in frames] == [torch.ones(3).numpy().tobytes(), bytes(2)]


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("name", ["contiguous", "strided", "bfloat16", "conj", "grad", "scalar"])
def test_copy_into_writes_exact_bytes(name, parallel):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    tensor = {"contiguous": base, "strided": base.t()[::2], "bfloat16": base.to(torch.bfloat16).t(),
              "conj": torch.complex(base, -base).conj(), "grad": base.clone().requires_grad_(),
              "scalar": torch.tensor(7, dtype=torch.int64)}[name]
    dtype = DTYPE_NAMES[tensor.dtype]
    view = np.zeros(tensor.nbytes, dtype=np.uint8)
    copy_into(view, tensor, dtype, parallel=parallel)
    assert torch.equal(from_bytes(view, dtype, tuple(tensor.shape)), tensor.detach().resolve_conj())


# -- str/bytes elements ----------------------------------------------------------------------------

from modelwarden.shared.codec import ElementList, Elements, decode_elements, elements, flatten  # noqa: E402
from modelwarden.shared.protocol import BAD_REQUEST, parse_tensors  # noqa: E402


def payload_of(items: list[bytes]) -> bytes:
    return b"".join(len(item).to_bytes(4, "little") + item for item in items)


def round_trip(value):
    encoded = encode(value, inline_only)
    tensors = parse_reply_tensors(encoded.descs, encoded.frames)
    return encoded, [frame_tensor(desc, encoded.frames) for desc in tensors]


@pytest.mark.parametrize("value, dtype, shape", [
    ("héllo", "str", []),
    (b"\x00\xff", "bytes", []),
    (["a", "bcd", ""], "str", [3]),
    (("a", "b"), "str", [2]),
    ([b"x", b""], "bytes", [2]),
    ([["a", "b"], ["c", "d"], ["e", "f"]], "str", [3, 2]),
    (np.array(["x", "yy"]), "str", [2]),
    (np.array([[b"q"], [b"rs"]]), "bytes", [2, 1]),
    (np.array(["a", "bé"], dtype=object), "str", [2]),
    (np.array([b"a", b"b\x00"], dtype=object), "bytes", [2]),  # object arrays keep NULs
])
def test_element_leaves_travel_as_one_descriptor(value, dtype, shape):
    encoded, (decoded,) = round_trip(value)
    assert encoded.tree == 0
    (desc,) = encoded.descs
    assert (desc["dtype"], desc["shape"]) == (dtype, shape)
    flat = np.array(value, dtype=object).reshape(-1).tolist() if shape else [value]
    raw = [item.encode() if isinstance(item, str) else item for item in flat]
    assert bytes(encoded.frames[0]) == payload_of(raw)
    assert desc["nbytes"] == len(payload_of(raw)) and desc["longest"] == max(map(len, raw))
    expected = np.array(value, dtype=object).tolist() if shape else value
    assert decoded == expected
    if shape:
        assert isinstance(decoded, ElementList) and decoded.shape == tuple(shape)
        assert decoded.dtype == dtype


def test_what_is_not_one_element_leaf():
    leaves: list = []
    # mixed str and bytes, ragged nests and an empty list are not one leaf
    assert flatten(["a", b"b"], leaves) == [0, 1]
    assert flatten([["a", "b"], ["c"]], leaves) == [2, 3]
    assert flatten([], leaves) == []
    assert [leaf.shape for leaf in leaves] == [(), (), (2,), (1,)]
    # a tuple of lists is a tuple of inputs; dicts name them
    assert flatten((["a"], ["b", "c"]), []) == {"tuple": [0, 1]}
    assert flatten({"q": ["a"], "x": torch.ones(1)}, leaves := []) == {"dict": {"q": 0, "x": 1}}
    assert isinstance(leaves[0], Elements) and isinstance(leaves[1], torch.Tensor)
    with pytest.raises(TypeError):
        encode(np.array(["a", 1], dtype=object), inline_only)
    with pytest.raises(TypeError):
        encode(np.array([], dtype=object), inline_only)


def test_encode_refuses_elements_past_the_limits():
    with pytest.raises(TypeError, match="65536"):
        encode([""] * (protocol.MAX_ELEMENTS + 1), inline_only)
    with pytest.raises(TypeError, match="at most"):
        encode([b"x" * protocol.MAX_ELEMENT_BYTES], inline_only)
    with pytest.raises(TypeError, match="UTF-8"):
        encode(["\ud800"], inline_only)  # a lone surrogate has no UTF-8 form


def test_elements_go_in_shared_memory_when_placed_there():
    seen = []

    def place(tensor, dtype, nbytes):
        seen.append((tensor.dtype, dtype, nbytes, bytes(tensor.numpy())))
        return TOKEN, 64, nbytes

    encoded = encode(["ab", "c"], place)
    assert encoded.frames == []
    assert encoded.descs == [{"dtype": "str", "shape": [2], "nbytes": 11, "longest": 2,
                              "shm": [TOKEN, 64, 11]}]
    assert seen == [(torch.uint8, "uint8", 11, payload_of([b"ab", b"c"]))]


def desc_of(dtype: str, shape: list, payload: bytes, longest: int | None = None) -> TensorDesc:
    count = int(np.prod(shape))
    if longest is None:
        longest = max(0, len(payload) - 4 * count)  # a bound the header checks accept
    return TensorDesc(dtype, tuple(shape), len(payload), frame=0, longest=longest)


def refused(dtype, shape, payload, longest=None) -> str:
    with pytest.raises(ProtocolError) as info:
        decode_elements(payload, desc_of(dtype, shape, payload, longest))
    assert info.value.code == BAD_REQUEST
    return info.value.message


def test_decode_elements_is_strict():
    good = payload_of([b"ab", b"cde"])
    assert decode_elements(good, desc_of("bytes", [2], good, 3)) == [b"ab", b"cde"]
    assert decode_elements(good, desc_of("str", [1, 2], good, 3)) == [["ab", "cde"]]
    # the declared count: fewer elements than the payload holds leaves trailing bytes
    assert "bytes after the last of its 1" in refused("bytes", [1], good, 2)
    # more declared than there are: a prefix past the end
    assert "element 2: its length prefix lies past the end" in refused("bytes", [3], good)
    # a prefix whose length runs past the end
    lying = payload_of([b"ab"]) + (100).to_bytes(4, "little") + b"cde"
    assert "element 1: 100 bytes" in refused("bytes", [2], lying)
    # trailing bytes
    assert "1 bytes after" in refused("bytes", [2], good + b"\x00")
    # a half prefix at the end
    assert "element 2" in refused("bytes", [3], good + b"\x00\x00")
    # UTF-8 where str is declared (bytes takes anything)
    bad_utf8 = payload_of([b"ok", b"\xc3\x28"])
    assert "element 1 is not valid UTF-8" in refused("str", [2], bad_utf8, 2)
    assert decode_elements(bad_utf8, desc_of("bytes", [2], bad_utf8, 2))[1] == b"\xc3\x28"
    surrogate = payload_of(["\ud800".encode("utf-8", "surrogatepass")])
    assert "element 0 is not valid UTF-8" in refused("str", [1], surrogate, 3)
    # the declared longest, both ways
    assert "declares 'longest' 2" in refused("bytes", [2], good, 2)
    assert "declares 'longest' 4" in refused("bytes", [2], good, 4)


def test_decode_elements_shapes():
    empty = b""
    assert decode_elements(empty, desc_of("str", [0], empty, 0)) == []
    assert decode_elements(empty, desc_of("str", [0, 3], empty, 0)) == []
    four = payload_of([b""] * 4)
    assert decode_elements(empty, desc_of("str", [2, 0], empty, 0)) == [[], []]
    assert decode_elements(four, desc_of("bytes", [2, 1, 2], four, 0)) == [[[b"", b""]], [[b"", b""]]]
    one = payload_of([b"x"])
    assert decode_elements(one, desc_of("str", [], one, 1)) == "x"
    # shared memory hands over a uint8 array
    assert decode_elements(np.frombuffer(one, np.uint8), desc_of("bytes", [1], one, 1)) == [b"x"]


def test_element_descriptors_round_trip_through_the_parser():
    encoded = encode({"t": ["a"], "b": b"zz"}, inline_only)
    assert parse_tensors(encoded.descs) == [TensorDesc("str", (1,), 5, frame=0, longest=1),
                                            TensorDesc("bytes", (), 6, frame=1, longest=2)]
    assert [wire_desc(desc) for desc in parse_tensors(encoded.descs)] == encoded.descs
    assert elements("str", (1,), ["é"]).payload == payload_of(["é".encode()])


@pytest.mark.parametrize("tensor", [
    torch.arange(100, dtype=torch.float32)[10:20],  # a view that starts past its storage's start
    torch.tensor([True, False, True]),
    torch.tensor(7, dtype=torch.int64),  # 0-d
    torch.empty(0, 3),
    torch.randn(4, 4).to(torch.bfloat16),
    torch.randn(2, 3, dtype=torch.complex64),
], ids=["offset-view", "bool", "0-d", "empty", "bfloat16", "complex"])
def test_a_small_inline_frame_is_a_copy_of_the_tensors_own_bytes(tensor):
    frame = codec.inline_frame(tensor, tensor.nbytes)
    assert type(frame) is bytes
    assert frame == raw_bytes(tensor).tobytes()
    sent = from_bytes(memoryview(frame), DTYPE_NAMES[tensor.dtype], tuple(tensor.shape))
    assert torch.equal(sent, tensor)


def test_a_large_inline_frame_is_a_view_of_the_tensor_and_one_numpy_refuses_still_says_why():
    large = torch.randn(codec.COPIED_BELOW // 4 + 1)
    frame = codec.inline_frame(large, large.nbytes)
    assert isinstance(frame, np.ndarray) and frame.ctypes.data == large.data_ptr()
    for refused in (torch.randn(4, requires_grad=True), torch.randn(4, dtype=torch.complex64).conj(),
                    torch.randn(4, dtype=torch.complex64).conj().imag):
        with pytest.raises(RuntimeError):
            codec.inline_frame(refused, refused.nbytes)


@pytest.mark.parametrize("name", ["conj", "neg"])
def test_a_small_lazily_conjugated_or_negated_tensor_is_never_sent_as_its_stored_bytes(name):
    """encode knows each leaf's dtype and asks a tensor whether it is a conjugated view only when
    it is complex (no other can be): a conjugated or negated view is refused, as numpy refuses
    it, or sent as its values, never as the bytes it stores, which hold other values."""
    base = torch.randn(4, dtype=torch.complex64)
    # imag of a conj: a float view with the neg bit (strided: made contiguous before the frame)
    tensor = base.conj() if name == "conj" else base.conj().imag
    assert tensor.is_conj() or tensor.is_neg()
    plain = tensor.resolve_conj().resolve_neg()
    try:
        encoded = encode(tensor, codec.inline_only)
    except RuntimeError as exc:
        assert "conjugate" in str(exc) or "negative" in str(exc)
        return
    sent = codec.frame_tensor(parse_tensors(encoded.descs)[0], encoded.frames)
    assert torch.equal(sent, plain)
