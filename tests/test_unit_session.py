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

from modelwarden.shared import protocol
from modelwarden.shared.errors import InternalError, ModelError
from modelwarden.client.session import Session
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
