"""Edges of the wire format that only a worker can check (the supervisor never reads payload
bytes): 0-d tensors keep their shape, and bool tensors hold only 0x00 or 0x01."""

import numpy as np
import pytest
import struct

from modelwarden.shared import protocol
from tests.helpers import Daemon, header_frame, raw_request


@pytest.fixture(scope="module")
def daemon():
    echo = {"name": "echo", "source": "python:tests.faulty:make_echo", "kwargs": {"copy": True},
            "workers": 1, "warmup": 0, "cores_per_worker": 1}
    with Daemon([echo]) as running:
        running.wait_ready()
        yield running


def one_tensor(dtype: str, shape: list, payload: bytes) -> list:
    header = {"type": "infer", "id": 5, "model": "echo", "inputs": 0,
              "tensors": [{"dtype": dtype, "shape": shape, "frame": 0}]}
    return [protocol.SIGNATURE, header_frame(header), payload]


def test_a_0d_tensor_comes_back_0d(daemon):
    reply = raw_request(daemon.endpoint, one_tensor("float32", [], struct.pack("<f", 2.5)))
    assert reply["ok"], reply
    assert reply["tensors"] == [{"dtype": "float32", "shape": [], "frame": 0}]


@pytest.mark.parametrize("byte", [2, 0x80, 0xFF])
def test_bool_bytes_other_than_0_and_1_are_refused(daemon, byte):
    payload = bytes([0, 1, byte, 1])
    reply = raw_request(daemon.endpoint, one_tensor("bool", [4], payload))
    assert reply["ok"] is False
    assert reply["error"]["code"] == protocol.BAD_REQUEST
    assert "bool" in reply["error"]["message"]


def test_bool_bytes_0_and_1_are_served_and_the_worker_serves_on(daemon):
    payload = np.array([0, 1, 1, 0], dtype=np.uint8).tobytes()
    reply = raw_request(daemon.endpoint, one_tensor("bool", [4], payload))
    assert reply["ok"], reply
    assert reply["tensors"] == [{"dtype": "bool", "shape": [4], "frame": 0}]
