"""Unit tests of the client's request building and reply decoding (client/session.py), over a real
shared-memory arena with no daemon (no channel: buffers are not registered anywhere).

The out region: a request reserves room for the outputs the worker will have to write; an
output that comes back as a pointer into one of the request's own input buffers needed none, so
a model answering that way (identity, in-place ops) must not cost a second buffer per request in
flight -- at 64 in flight of 4 MiB that was 256 MiB of extra shared memory to fault in.
"""

from __future__ import annotations

import secrets
import threading

import pytest
import torch
import zmq

from modelwarden.shared import descriptors, protocol
from modelwarden.shared.errors import InternalError, ModelError
from modelwarden.client.session import Pending, Session
from modelwarden.shared.shm import ShmArena

THRESHOLD = 1024


class LocalChannel:
    """Hands out tokens as the daemon's buffer channel would, without a daemon."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.connected = True

    def register(self, fds: list[int]) -> list[str]:
        return [secrets.token_hex(16) for _ in fds]

    def unregister(self, tokens: list[str]) -> None:
        pass

    def close(self) -> None:
        self.connected = False


@pytest.fixture
def session():
    session = Session("ipc:///nowhere", shm=None, copy_outputs=False)
    session.arena = ShmArena(LocalChannel())
    session.threshold = THRESHOLD
    yield session
    session.close()


def request_header(messages: list) -> dict:
    (parts,) = messages
    return protocol.unpack_header(parts[1])


def reply_with(header: dict, pending, out_desc: dict) -> dict:
    return {"id": pending.id, "ok": True, "outputs": 0, "tensors": [out_desc]}


def test_an_output_aliasing_its_input_stops_reserving_an_out_region(session):
    x = torch.randn(4096)  # 16 KiB: shared memory
    messages, pending = session.build("identity", x, 5.0)
    header = request_header(messages)
    assert "out" in header  # no reply yet: room for outputs as large as the inputs
    alias = header["tensors"][0]  # the worker answers with the input's own region
    y = session.decode(pending, session.read(reply_with(header, pending, alias), []), [])
    assert torch.equal(y, x)
    del y
    messages, pending = session.build("identity", x, 5.0)
    assert "out" not in request_header(messages)
    session.release(pending)


def test_an_output_written_in_the_out_region_keeps_it_reserved(session):
    x = torch.randn(4096)
    messages, pending = session.build("double", x, 5.0)
    header = request_header(messages)
    token, offset, _ = header["out"]
    session.arena.segment(token).array[offset:offset + x.nbytes] = (2 * x).numpy().view("uint8")
    written = {"dtype": "float32", "shape": [4096], "shm": [token, offset, x.nbytes]}
    y = session.decode(pending, session.read(reply_with(header, pending, written), []), [])
    assert torch.equal(y, 2 * x)
    for _ in range(3):  # y holds its region: no later request may be handed it
        messages, pending = session.build("double", x, 5.0)
        out = request_header(messages)["out"]
        assert out[0] != token and out[2] >= x.nbytes
        session.release(pending)
    assert torch.equal(y, 2 * x)
    del y
    messages, pending = session.build("double", x, 5.0)
    assert token in pending.tokens  # freed with the tensor: reused
    session.release(pending)


def test_a_large_output_that_came_inline_asks_for_room_next_time(session):
    small = torch.randn(16)  # inputs under the threshold: no out region at first
    messages, pending = session.build("grow", small, 5.0)
    assert "out" not in request_header(messages)
    big = torch.randn(2048)
    inline = {"dtype": "float32", "shape": [2048], "frame": 0}
    frames = [zmq.Frame(big.numpy().tobytes())]
    y = session.decode(pending, session.read(reply_with({}, pending, inline), frames), frames)
    del frames
    assert torch.equal(y, big)  # the tensor keeps its frame alive
    messages, pending = session.build("grow", small, 5.0)
    assert request_header(messages)["out"][2] >= big.nbytes
    session.release(pending)


def test_a_malformed_reply_is_an_internal_error_and_releases_the_leases(session):
    messages, pending = session.build("identity", torch.randn(4096), 5.0)
    assert pending.regions
    bad = {"id": pending.id, "ok": True, "outputs": 0,
           "tensors": [{"dtype": "float32", "shape": [4], "frame": 3}]}
    with pytest.raises(InternalError, match="malformed reply"):
        session.decode(pending, session.read(bad, []), [])
    assert pending.regions == []


def test_a_region_outside_our_buffer_is_refused(session):
    messages, pending = session.build("identity", torch.randn(4096), 5.0)
    token = request_header(messages)["tensors"][0]["shm"][0]
    size = session.arena.segment(token).size
    past = {"dtype": "uint8", "shape": [64], "shm": [token, size - 32, 64]}
    with pytest.raises(InternalError, match="does not own"):
        session.decode(pending, session.read(reply_with({}, pending, past), []), [])


def test_an_error_reply_raises_its_class_with_the_worker(session):
    messages, pending = session.build("identity", torch.randn(4), 5.0)
    header = protocol.error_header(pending.id, protocol.MODEL_ERROR, "boom")
    header["worker"] = "identity#1"
    with pytest.raises(ModelError) as info:
        session.decode(pending, session.read(header, []), [])
    assert info.value.worker == "identity#1" and info.value.message == "boom"


def _reply_frames(rid, data: bytes, queue_us: int) -> list:
    """A success as a client's DEALER gets it: signature, the header the daemon writes (the
    worker's map with the supervisor's timing appended), the payload frame."""
    worker = protocol.pack({"id": rid, "ok": True, "outputs": 0, "worker": "identity#0",
                            "version": "v1",
                            "tensors": [{"dtype": "uint8", "shape": [len(data)], "frame": 0}]})
    return [protocol.SIGNATURE, protocol.add_timing(worker, queue_us, 10, 20 + queue_us, 1), data]


def test_split_reads_a_success_once_and_finds_the_next_ones_in_its_cache(session):
    for rid in range(1, 6):
        got, reply, payload = session.split(_reply_frames(rid, bytes([rid]) * 4, 100 * rid))
        assert got == rid and type(reply) is descriptors.InferReply
        assert reply.id == rid and reply.timing["queue_us"] == 100 * rid and reply.worker == "identity#0"
        assert session.read(reply, payload) is reply
        pending = Pending(rid, "identity", False, False, keep=[])
        assert session.decode(pending, reply, payload).tolist() == [rid] * 4
    assert len(session.replies.entries) == 1  # learnt from the first, found for the rest


def test_split_gives_a_hello_answer_and_a_failure_as_their_header_map(session):
    hello = {"id": 1, "ok": True, "protocol": 1, "models": []}
    rid, header, _ = session.split([protocol.SIGNATURE, protocol.pack(hello)])
    assert rid == 1 and header == hello
    failure = protocol.error_header(2, protocol.MODEL_ERROR, "boom")
    rid, header, _ = session.split([protocol.SIGNATURE, protocol.pack(failure)])
    assert rid == 2 and header == failure
    with pytest.raises(ModelError):
        session.decode(Pending(2, "identity", False, False, keep=[]), session.read(header, []), [])


def test_a_malformed_success_is_split_as_its_map_and_read_as_an_internal_error(session):
    frames = _reply_frames(3, b"abcd", 5)
    frames[2] = b"abc"  # one byte short of its descriptor
    rid, header, payload = session.split(frames)
    assert rid == 3 and isinstance(header, dict)
    reply = session.read(header, payload)
    assert not reply.ok and reply.error.code == protocol.INTERNAL and session.replies.entries == []


def test_a_hello_answered_as_an_inference_is_refused(session):
    _, reply, _ = session.split(_reply_frames(1, b"x", 1))
    with pytest.raises(InternalError, match="a hello answered as an inference"):
        session.take_offer(reply)
    assert session.offer is None
