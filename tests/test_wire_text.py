"""str/bytes elements end to end: the native client and raw frames against a real daemon.

A ``python:`` model (tests/textmodels.py) takes a list of str and answers the lengths (a
tensor) and the texts upper-cased (str elements): inline, and in shared memory both ways. Every
malformed payload the issue names (a declared count that disagrees, a prefix past the end,
trailing bytes, invalid UTF-8 where str is declared, 10**6 empty strings, one string over the
limit, a lying ``longest``) is a typed BAD_REQUEST, and the daemon serves on with nothing left
behind (the worker's descriptors and the supervisor's in-flight count as before)."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from modelwarden.client.client import BadInput, Client
from modelwarden.shared import protocol
from tests.helpers import Daemon, fd_count, header_frame, poll_until, raw_request

TEXTS = ["héllo", "", "wörld of text", "日本語"]


@pytest.fixture(scope="module")
def daemon():
    upper = {"name": "upper", "source": "python:tests.textmodels:make_upper", "workers": 1,
             "warmup": 1, "cores_per_worker": 1,
             "inputs": [{"name": "texts", "dtype": "str", "shape": [-1]}]}
    free = {"name": "free", "source": "python:tests.textmodels:make_upper", "workers": 1,
            "warmup": 0, "cores_per_worker": 1}
    blobs = {"name": "blobs", "source": "python:tests.textmodels:make_blobs", "workers": 1,
             "warmup": 1, "cores_per_worker": 1,
             "inputs": [{"name": "blobs", "dtype": "bytes", "shape": [-1]}]}
    with Daemon([upper, free, blobs], daemon={"shm_threshold": 4096}) as running:
        running.wait_ready()
        yield running


def payload_of(items: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(item)) + item for item in items)


def text_request(desc: dict, payload: bytes, model: str = "upper") -> list:
    header = {"type": "infer", "id": 9, "model": model, "inputs": 0, "tensors": [desc]}
    return [protocol.SIGNATURE, header_frame(header), payload]


def test_a_list_of_str_in_lengths_and_upper_cased_str_out(daemon):
    with Client(daemon.endpoint) as client:
        lengths, upper = client.infer("upper", TEXTS)
        assert isinstance(lengths, torch.Tensor) and lengths.tolist() == [len(t) for t in TEXTS]
        assert upper == [text.upper() for text in TEXTS] and type(upper[0]) is str
        # numpy str_ and object arrays: one leaf each; a numpy request gets numpy tensors back
        lengths, upper = client.infer("upper", np.array(TEXTS))
        assert isinstance(lengths, np.ndarray) and upper == [text.upper() for text in TEXTS]
        _, upper = client.infer("upper", np.array(TEXTS, dtype=object))
        assert upper == [text.upper() for text in TEXTS]
        # a dict names the input; a model without declared inputs takes a bare str (0-d)
        assert client.infer("upper", {"texts": ["a"]})[1] == ["A"]
        length, word = client.infer("free", "abc")
        assert int(length) == 3 and word == "ABC"


def test_bytes_elements_and_the_declared_type_is_checked(daemon):
    blobs = [b"\x00\x01\xff", b"", bytes(range(256))]
    with Client(daemon.endpoint) as client:
        sums, reversed_ = client.infer("blobs", blobs)
        assert sums.tolist() == [sum(blob) for blob in blobs]
        assert reversed_ == [blob[::-1] for blob in blobs] and type(reversed_[0]) is bytes
        with pytest.raises(BadInput, match="dtype bytes, model takes str"):
            client.infer("upper", [b"abc"])
        with pytest.raises(BadInput, match="dtype str, model takes bytes"):
            client.infer("blobs", ["abc"])


def test_large_lists_travel_in_shared_memory_both_ways(daemon):
    texts = [f"text number {index} " * 8 for index in range(2000)]  # about 300 KB
    with Client(daemon.endpoint) as client:
        assert client.hello()["shm"]["enabled"]
        lengths, upper = client.infer("upper", texts)
        assert upper == [text.upper() for text in texts]
        assert lengths.tolist() == [len(text) for text in texts]
    with Client(daemon.endpoint, shm=False) as client:  # the same, inline
        assert client.infer("upper", texts)[1] == [text.upper() for text in texts]


def test_the_large_list_and_its_answer_lie_in_shared_memory(daemon):
    """What the test above cannot see: the descriptors. The client's Session (the sans-I/O
    core of Client) builds the request; the reply names regions of its out buffer."""
    import zmq

    from modelwarden.client.session import Session

    texts = [f"text number {index} " * 8 for index in range(2000)]
    session = Session(daemon.endpoint, None, False)
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(daemon.endpoint)
    try:
        _, hello = session.hello_message()
        socket.send_multipart(hello)
        assert socket.poll(10_000)
        session.accept_offer(protocol.split_reply(socket.recv_multipart())[0])
        (message,), pending = session.build("upper", texts, 10.0)
        (sent,) = protocol.unpack_header(message[1])["tensors"]
        assert sent["dtype"] == "str" and "shm" in sent and len(message) == 2  # no payload frame
        socket.send_multipart(message)
        assert socket.poll(10_000)
        header, frames = protocol.split_reply(socket.recv_multipart())
        assert frames == [] and all("shm" in desc for desc in header["tensors"])
        assert header["tensors"][1]["nbytes"] == sent["nbytes"]  # same byte lengths, upper-cased
        _, upper = session.decode(pending, session.read(header, frames), frames)
        assert upper == [text.upper() for text in texts]
    finally:
        socket.close()
        session.close()


def _element(shape, payload: bytes, longest: int, dtype: str = "str") -> dict:
    return {"dtype": dtype, "shape": shape, "nbytes": len(payload), "longest": longest, "frame": 0}


GOOD = payload_of([b"ab", b"cde"])
HUGE = 1 << 30  # one 1 GiB string, declared, never sent (MAX_ELEMENT_BYTES is 64 MiB)
MALFORMED = {
    # decoded by the worker
    "declared count too small (trailing element)": (_element([1], GOOD, 3), GOOD,
                                                     "bytes after the last of its 1 elements"),
    "declared count too large": (_element([3], GOOD + b"\0" * 2, 3), GOOD + b"\0" * 2,
                                 "element 2: its length prefix lies past the end"),
    "length prefix past the end": (_element([2], payload_of([b"ab"]) + struct.pack("<I", 99) + b"c", 3),
                                   payload_of([b"ab"]) + struct.pack("<I", 99) + b"c",
                                   "element 1: 99 bytes"),
    "trailing bytes": (_element([2], GOOD + b"zz", 3), GOOD + b"zz", "2 bytes after the last"),
    "invalid UTF-8": (_element([2], payload_of([b"ok", b"\xff\xfe"]), 2),
                      payload_of([b"ok", b"\xff\xfe"]), "element 1 is not valid UTF-8"),
    "longest lying": (_element([2], GOOD, 2), GOOD, "declares 'longest' 2"),
    # refused from the header, by the supervisor
    "a million empty strings": ({"dtype": "str", "shape": [10**6], "nbytes": 4 * 10**6,
                                 "longest": 0, "frame": 0}, b"", "65536"),
    "one string over the limit": ({"dtype": "str", "shape": [1], "nbytes": HUGE + 4,
                                   "longest": HUGE, "frame": 0}, b"", "exceed"),
    "longest past what the elements hold": (_element([2], GOOD, 6), GOOD, "'longest' 6"),
    "frame shorter than nbytes": ({**_element([2], GOOD, 3), "nbytes": 20}, GOOD, "needs 20"),
}


def test_malformed_elements_are_typed_errors_and_the_daemon_serves_on(daemon):
    (worker,) = daemon.workers("upper")
    fds = fd_count(worker["pid"])
    for case, (desc, payload, words) in MALFORMED.items():
        reply = raw_request(daemon.endpoint, text_request(desc, payload))
        assert reply["ok"] is False, case
        assert reply["error"]["code"] == protocol.BAD_REQUEST, (case, reply)
        assert words in reply["error"]["message"], (case, reply["error"]["message"])
    # the same worker, still serving, holding no more than before
    with Client(daemon.endpoint) as client:
        assert client.infer("upper", ["still here"])[1] == ["STILL HERE"]
    (after,) = daemon.workers("upper")
    assert after["pid"] == worker["pid"]
    poll_until(lambda: all(not w["inflight"] for w in daemon.workers()), 10,
               message="nothing left in flight")
    assert fd_count(worker["pid"]) == fds
