"""gateway/kserve.py: datatypes, tensors in and out, REST bodies, error mapping; the committed
gRPC stubs are what grpcio-tools makes of the committed .proto."""

from __future__ import annotations

import collections
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

kserve = pytest.importorskip("modelwarden.gateway.kserve")

from modelwarden.shared import protocol  # noqa: E402
from modelwarden.shared.protocol import ProtocolError  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def test_every_error_code_maps_to_the_issue_s_status():
    expected_http = {"BAD_REQUEST": 400, "BAD_INPUT": 400, "UNKNOWN_MODEL": 404, "OVERLOADED": 503,
                     "NO_WORKER": 503, "SHUTTING_DOWN": 503, "TIMEOUT": 504, "MODEL_ERROR": 500,
                     "WORKER_DIED": 500, "POISON": 500, "INTERNAL": 500, "OUT_OF_MEMORY": 500}
    assert {code: kserve.http_status(code) for code in protocol.ERROR_CODES} == expected_http
    assert kserve.grpc_status("BAD_INPUT") == "INVALID_ARGUMENT"
    assert kserve.grpc_status("UNKNOWN_MODEL") == "NOT_FOUND"
    assert kserve.grpc_status("NO_WORKER") == "UNAVAILABLE"
    assert kserve.grpc_status("TIMEOUT") == "DEADLINE_EXCEEDED"
    assert kserve.grpc_status("POISON") == "INTERNAL"
    assert kserve.error_text("TIMEOUT", "late") == "TIMEOUT: late"


@pytest.mark.parametrize("datatype,dtype", [("BOOL", torch.bool), ("UINT8", torch.uint8),
                                            ("INT8", torch.int8), ("INT16", torch.int16),
                                            ("INT32", torch.int32), ("INT64", torch.int64),
                                            ("FP16", torch.float16), ("BF16", torch.bfloat16),
                                            ("FP32", torch.float32), ("FP64", torch.float64)])
def test_raw_bytes_round_trip_every_datatype(datatype, dtype):
    original = (torch.arange(6) % 2 == 1) if dtype == torch.bool else torch.arange(6).to(dtype)
    original = original.reshape(2, 3)
    data = bytes(kserve.tensor_bytes(original))
    assert len(data) == kserve.byte_size(datatype, (2, 3))
    back = kserve.raw_tensor("x", datatype, (2, 3), data)
    assert back.dtype == dtype and torch.equal(back, original)
    assert kserve.tensor_datatype(back) == datatype


def test_raw_data_of_the_wrong_length_is_bad_input():
    with pytest.raises(ProtocolError) as caught:
        kserve.raw_tensor("x", "FP32", (2, 3), b"\0" * 20)
    assert caught.value.code == "BAD_INPUT" and "20 bytes" in caught.value.message


def test_json_tensor_flat_and_nested_and_typed():
    assert torch.equal(kserve.json_tensor("x", "INT64", (2, 2), [[1, 2], [3, 4]]),
                       torch.tensor([[1, 2], [3, 4]]))
    assert torch.equal(kserve.json_tensor("x", "BOOL", (3,), [True, False, True]),
                       torch.tensor([True, False, True]))
    bf16 = kserve.json_tensor("x", "BF16", (2,), [1.5, -2])
    assert bf16.dtype == torch.bfloat16 and bf16.tolist() == [1.5, -2.0]
    for datatype, data in (("FP32", [1, 2, 3]), ("INT64", [1.5, 2]), ("BOOL", [1, 0]),
                           ("FP32", ["a", 1]), ("INT64", [True, 1])):
        with pytest.raises(ProtocolError) as caught:
            kserve.json_tensor("x", datatype, (2,), data)
        assert caught.value.code == "BAD_INPUT"
    with pytest.raises(ProtocolError, match="does not fit"):
        kserve.json_tensor("x", "INT8", (1,), [300])


def test_unknown_datatypes_are_refused_by_name():
    for datatype in ("FLOAT", "STRING", "UINT64", 7):
        with pytest.raises(ProtocolError) as caught:
            kserve.check_datatype("x", datatype)
        assert caught.value.code == "BAD_INPUT"


def test_metadata_reports_the_batch_dimension_as_dynamic():
    specs = [{"name": "x", "dtype": "float32", "shape": [4, 64]}]
    assert kserve.tensor_metadata(specs, 0) == [{"name": "x", "datatype": "FP32", "shape": [-1, 64]}]
    assert kserve.tensor_metadata(specs, None)[0]["shape"] == [4, 64]


def _body(inputs, **extra) -> dict:
    return {"inputs": inputs, **extra}


def test_model_config_drops_the_batch_dimension_only_when_it_is_dimension_0():
    specs = [{"name": "x", "dtype": "float16", "shape": [1, 3, 224, 224]}]
    outputs = [{"name": "y", "dtype": "int64", "shape": [1, 5]}]
    batched = {"inputs": specs, "outputs": outputs, "batch_dim": 0, "max_batch_size": 16,
               "batch_delay_us": 500}
    assert kserve.model_config("m", batched) == {
        "name": "m", "platform": "pytorch", "backend": "modelwarden", "max_batch_size": 16,
        "input": [{"name": "x", "data_type": "TYPE_FP16", "dims": [3, 224, 224]}],
        "output": [{"name": "y", "data_type": "TYPE_INT64", "dims": [5]}],
        "dynamic_batching": {"max_queue_delay_microseconds": 500}}
    # Batching along another dimension is not Triton's batching: whole shapes, -1 where it varies.
    other = kserve.model_config("m", {**batched, "batch_dim": 1})
    assert other["max_batch_size"] == 0 and "dynamic_batching" not in other
    assert other["input"][0]["dims"] == [1, -1, 224, 224]
    plain = kserve.model_config("m", {"inputs": specs, "outputs": [], "batch_dim": None})
    assert plain["max_batch_size"] == 0 and plain["input"][0]["dims"] == [1, 3, 224, 224]
    assert plain["output"] == [] and "dynamic_batching" not in plain
    complex_input = [{"name": "z", "dtype": "complex64", "shape": [4]}]
    assert kserve.model_config("m", {"inputs": complex_input})["input"] == [
        {"name": "z", "data_type": "TYPE_INVALID", "dims": [4]}]


def test_a_binary_request_splits_its_inputs_in_order():
    a, b = torch.randn(2, 3), torch.arange(4)
    binary = bytes(kserve.tensor_bytes(a)) + bytes(kserve.tensor_bytes(b))
    header = json.dumps(_body([
        {"name": "a", "datatype": "FP32", "shape": [2, 3], "parameters": {"binary_data_size": 24}},
        {"name": "b", "datatype": "INT64", "shape": [4], "parameters": {"binary_data_size": 32}}],
        id="r1", parameters={"binary_data_output": True, "timeout": 2_000_000})).encode()
    json_part, binary_part = kserve.split_body(header + binary, len(header))
    request = kserve.parse_infer_request(kserve.load_json(json_part), binary_part)
    assert [item.name for item in request.inputs] == ["a", "b"]
    assert torch.equal(request.inputs[0].tensor, a) and torch.equal(request.inputs[1].tensor, b)
    assert request.id == "r1" and request.timeout_s == 2.0 and request.wants_binary("y")


@pytest.mark.parametrize("binary,problem", [(b"\0" * 23, "binary_data_size 24"),
                                            (b"\0" * 25, "1 bytes of binary data after")])
def test_binary_data_that_does_not_add_up_is_bad_input(binary, problem):
    body = _body([{"name": "a", "datatype": "FP32", "shape": [2, 3],
                   "parameters": {"binary_data_size": 24}}])
    with pytest.raises(ProtocolError, match=problem) as caught:
        kserve.parse_infer_request(body, memoryview(binary))
    assert caught.value.code == "BAD_INPUT"


def test_a_declared_header_length_is_checked_before_the_body_is_read():
    assert kserve.header_length(None, 10, 100) is None
    assert kserve.header_length("5", 10, 100) == 5
    for value, body in (("3000000000", None), ("11", 10), ("-1", 10), ("x", 10)):
        with pytest.raises(ProtocolError) as caught:
            kserve.header_length(value, body, 1000)
        assert caught.value.code == "BAD_REQUEST"


def test_malformed_requests_are_bad_request():
    for body in ([], {"inputs": []}, {"inputs": [1]}, {"inputs": [{"name": ""}]},
                 _body([{"name": "a", "datatype": "FP32", "shape": [1], "data": [1]}], id=5),
                 _body([{"name": "a", "datatype": "FP32", "shape": [1], "data": [1]}],
                       parameters={"timeout": "soon"})):
        with pytest.raises(ProtocolError) as caught:
            kserve.parse_infer_request(body, memoryview(b""))
        assert caught.value.code == "BAD_REQUEST"
    with pytest.raises(ProtocolError, match="not valid JSON"):
        kserve.load_json(b"{nope")


def test_a_response_names_outputs_and_mixes_json_and_binary():
    request = kserve.InferRequest(inputs=[], id="7", outputs=["y", "z"], binary={"z": True})
    y, z = torch.tensor([1.0, 2.0]), torch.tensor([[True, False]])
    named = kserve.select_outputs(kserve.name_outputs([y, z], None, ["y", "z"]), request.outputs)
    body, json_length = kserve.infer_response("m", "v1", request, named)
    header = json.loads(body[:json_length])
    assert header["id"] == "7" and header["model_version"] == "v1"
    assert header["outputs"][0] == {"name": "y", "datatype": "FP32", "shape": [2], "data": [1.0, 2.0]}
    assert header["outputs"][1]["parameters"] == {"binary_data_size": 2}
    assert body[json_length:] == b"\x01\x00"
    with pytest.raises(ProtocolError, match="unknown output"):
        kserve.select_outputs(named, ["w"])


def test_outputs_are_named_as_declared_else_output_n():
    tensors = [torch.zeros(1), torch.ones(1)]
    assert [name for name, _ in kserve.name_outputs(tensors, None, None)] == ["output__0", "output__1"]
    declared = [{"name": "y", "dtype": "float32", "shape": [1]}, {"name": "z", "dtype": "float32", "shape": [1]}]
    assert [name for name, _ in kserve.name_outputs(tensors, declared, None)] == ["y", "z"]
    with pytest.raises(ProtocolError) as caught:
        kserve.name_outputs(tensors[:1], declared, None)
    assert caught.value.code == "MODEL_ERROR"
    flat, keys = kserve.flatten_outputs({"a": np.zeros(2), "b": torch.ones(1)})
    assert keys == ["a", "b"] and all(isinstance(t, torch.Tensor) for t in flat)


def test_committed_grpc_stubs_are_what_grpcio_tools_generates(tmp_path):
    pytest.importorskip("grpc_tools", reason="grpcio-tools is in the gateway-test extra")
    from modelwarden.gateway.proto import regenerate

    for generated in regenerate.generate(tmp_path):
        committed = ROOT / "gateway" / "proto" / generated.name
        assert committed.read_text() == generated.read_text(), (
            f"{committed} is stale: run `make stubs` and commit the result")


# -- every bad input is a typed 4xx ---------------------------------------------------------------

import logging  # noqa: E402
import random  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

from modelwarden.gateway import access, quota  # noqa: E402
from tests.helpers import ROOT  # noqa: E402

FUZZ_CASES = 3000
_VALUES = [None, True, False, 0, -1, 1, 2**31, 2**63, 10**400, -(2**70), 1.5, float("nan"), "",
           "FP32", "²", "x" * 300, [], [0], [-1], [2**39, 2**39], [0, 2**39, 2**39], [2**62],
           [[1, 2], [3]], [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]], {},
           {"binary_data_size": 2**40}, {"binary_data_size": -4}, {"timeout": 10**400},
           {"binary_data_output": "yes"}, {"binary_data": 1}, [{"name": 3}], [{}], ["a"]]
_KEYS = ["name", "datatype", "shape", "data", "parameters"]


def _fuzzed_body(rng: random.Random) -> dict:
    item = {"name": "x", "datatype": rng.choice(list(kserve.DATATYPES) + ["BYTES", 7]),
            "shape": [2], "data": [1, 2]}
    for _ in range(rng.randint(1, 3)):
        item[rng.choice(_KEYS)] = rng.choice(_VALUES)
    body = {"inputs": [item] * rng.choice([1, 1, 2])}
    for key in rng.sample(["id", "parameters", "outputs", "inputs"], rng.randint(0, 2)):
        body[key] = rng.choice(_VALUES)
    return body


def _typed_client_error(call) -> str:
    """'ok', or the code of a 4xx ProtocolError; anything else fails the test."""
    try:
        call()
    except ProtocolError as exc:
        assert kserve.http_status(exc.code) < 500, exc
        return exc.code
    return "ok"


def test_fuzzed_rest_bodies_and_headers_get_only_typed_4xx_errors():
    rng = random.Random(21)
    outcomes = collections.Counter()
    for _ in range(FUZZ_CASES):
        body = _fuzzed_body(rng)
        binary = memoryview(bytes(rng.choice([0, 4, 8, 16])))
        outcomes[_typed_client_error(lambda: kserve.parse_infer_request(body, binary))] += 1
    for header in ("²", "٣", "1e3", "-1", " 12 ", "9" * 30, "0x10", "", "１２"):
        outcomes[_typed_client_error(lambda: kserve.header_length(header, 100, 1000))] += 1
    for raw in (b"\xff\xfe", b"[" * 200_000, b'{"a": 1' , "¹".encode(), b"1" * 5000, b"NaN"):
        outcomes[_typed_client_error(lambda: kserve.parse_infer_request(
            kserve.load_json(raw), memoryview(b"")))] += 1
    assert outcomes["BAD_INPUT"] and outcomes["BAD_REQUEST"] and outcomes["ok"], outcomes


def test_the_known_500s_are_400s():
    with pytest.raises(ProtocolError) as raised:
        kserve.header_length("²", 10, 100)
    assert raised.value.code == "BAD_REQUEST"
    assert kserve.decimal("²") is None and kserve.decimal(" 42 ") == 42
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [0, 2**39, 2**39],
                        "parameters": {"binary_data_size": 0}}]}
    with pytest.raises(ProtocolError) as raised:
        kserve.parse_infer_request(body, memoryview(b""))
    assert raised.value.code == "BAD_INPUT" and "more than" in raised.value.message
    assert kserve.timeout_seconds(10**400) == kserve.MAX_TIMEOUT_S


def test_fuzzed_grpc_requests_get_only_typed_4xx_errors():
    """In a process of its own: our generated stubs and tritonclient's (imported by the gateway
    tests) declare the same protobuf package, and one descriptor pool cannot hold both."""
    pytest.importorskip("grpc")
    done = subprocess.run([sys.executable, "-c", "import json, tests.test_unit_kserve as t; "
                           "print(json.dumps(t.fuzzed_grpc_outcomes()))"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    outcomes = json.loads(done.stdout.splitlines()[-1])
    assert set(outcomes) <= {"ok", "BAD_INPUT", "BAD_REQUEST"}, outcomes
    assert outcomes.get("BAD_INPUT") and outcomes.get("BAD_REQUEST") and outcomes.get("ok"), outcomes


def fuzzed_grpc_outcomes() -> dict:
    """What decode_inputs answers to FUZZ_CASES random ModelInfer requests, by outcome."""
    from modelwarden.gateway.grpc_service import decode_inputs
    from modelwarden.gateway.proto import grpc_predict_v2_pb2 as pb

    rng = random.Random(5)
    outcomes = collections.Counter()
    for _ in range(FUZZ_CASES):
        request = pb.ModelInferRequest(model_name="m")
        for index in range(rng.choice([0, 1, 1, 2])):
            item = request.inputs.add(name=rng.choice(["x", "x", "y"]),
                                      datatype=rng.choice(list(kserve.DATATYPES) + ["BYTES", ""]))
            item.shape.extend(rng.choice([[2], [0], [-1], [2**39, 2**39], [0, 2**39, 2**39],
                                          [2**62, 2], [1] * 40, []]))
            field = rng.choice(["fp32_contents", "int_contents", "int64_contents", "uint_contents",
                                "bool_contents", "fp64_contents"])
            values = {"bool_contents": [True, False], "fp32_contents": [1.0, 2.0],
                      "fp64_contents": [1e300, 2.0]}.get(field, [rng.choice([0, 300, -300, 2**31 - 1]), 1])
            if field == "uint_contents":  # protobuf itself refuses a negative uint32
                values = [abs(value) for value in values]
            getattr(item.contents, field).extend(values)
        if rng.random() < 0.4:
            request.raw_input_contents.extend([bytes(rng.choice([0, 8, 16]))] * rng.choice([1, 2]))
        outcomes[_typed_client_error(lambda: decode_inputs(request))] += 1
    return dict(outcomes)


# -- quotas and refusal lines: policy with a fake clock -------------------------------------------


def test_one_identity_gets_its_share_and_gives_everything_back():
    quotas = quota.Quotas(quota.Limits(max_requests=8, max_bytes=1000, share=0.25))
    first, second = quotas.admit("token:aaaa"), quotas.admit("token:aaaa")
    with pytest.raises(quota.QuotaExceeded, match=r"token:aaaa has 2 calls in flight.*identity_share"):
        quotas.admit("token:aaaa")
    with quotas.admit("token:bbbb") as other:  # another identity is served meanwhile
        other.charge(250)
        with pytest.raises(quota.QuotaExceeded, match="max_bytes_in_flight 1000"):
            other.charge(1)
    first.charge(100)
    assert quotas.usage() == {"token:aaaa": {"requests": 2, "bytes": 100}}
    first.release(), second.release(), first.release()  # twice is once
    assert quotas.total == quota.Use() and quotas.usage() == {}


def test_the_gateway_s_total_is_never_exceeded_by_many_identities():
    quotas = quota.Quotas(quota.Limits(max_requests=4, max_bytes=100, share=0.5))
    tickets = [quotas.admit(f"peer:10.0.0.{n}") for n in range(4)]
    with pytest.raises(ProtocolError) as raised:
        quotas.admit("peer:10.0.0.9")
    assert raised.value.code == "OVERLOADED" and not isinstance(raised.value, quota.QuotaExceeded)
    assert "max_requests_in_flight" in raised.value.message
    for ticket in tickets:
        ticket.release()


def test_refusals_are_logged_once_a_minute_per_source_not_per_attempt(caplog):
    now = [1000.0]
    log = access.RefusalLog("call(s) refused", clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="modelwarden.gateway.access"):
        for _ in range(300):  # 300 attempts (each with another key) from one address
            log.refused("peer:10.0.0.1")
        log.refused("peer:10.0.0.2")
        now[0] += 61
        log.refused("peer:10.0.0.1")
    lines = [record.getMessage() for record in caplog.records]
    assert lines == ["gateway: 1 call(s) refused from peer:10.0.0.1 in the last minute",
                     "gateway: 1 call(s) refused from peer:10.0.0.2 in the last minute",
                     "gateway: 300 call(s) refused from peer:10.0.0.1 in the last minute"]


def test_a_token_is_named_by_its_digest_never_itself():
    import hashlib

    token = b"a-token-of-forty-characters-0123456789ab"
    name = access.token_id(hashlib.sha256(token).digest())
    assert re.fullmatch(r"token:[0-9a-f]{8}", name) and token.decode() not in name
    assert access.identity(name, "CN=alice", "peer:127.0.0.1") == name
    assert access.identity(None, "CN=alice", "peer:127.0.0.1") == "cert:CN=alice"
    assert access.identity(None, None, "uid:1000") == "uid:1000"


# -- BYTES: str/bytes elements ---------------------------------------------------------------------

from modelwarden.shared.codec import Elements  # noqa: E402
from modelwarden.shared.descriptors import ElementList  # noqa: E402


def _prefixed(items: list[bytes]) -> bytes:
    return b"".join(len(item).to_bytes(4, "little") + item for item in items)


def test_bytes_inputs_raw_and_json_become_elements():
    raw = _prefixed([b"ab", b"", b"\xff"])
    value = kserve.raw_tensor("t", "BYTES", (3,), raw)
    assert value == Elements("bytes", (3,), raw, 2)  # the payload passes through as it came
    assert kserve.json_tensor("t", "BYTES", (1, 2), [["hé", "x"]]) == \
        Elements("bytes", (1, 2), _prefixed(["hé".encode(), b"x"]), 3)
    assert kserve.check_datatype("t", "BYTES") == "BYTES"
    # declared str: the same payload, UTF-8 checked
    text = kserve.as_declared("t", kserve.json_tensor("t", "BYTES", (1,), ["hé"]), "str")
    assert text.dtype == "str" and text.payload == _prefixed(["hé".encode()])
    assert kserve.as_declared("t", value, "bytes") is value


@pytest.mark.parametrize("call, words", [
    (lambda: kserve.raw_tensor("t", "BYTES", (3,), _prefixed([b"ab", b"c"])), "element 2"),
    (lambda: kserve.raw_tensor("t", "BYTES", (1,), _prefixed([b"ab", b"c"])), "bytes after"),
    (lambda: kserve.raw_tensor("t", "BYTES", (1,), b"\x09\0\0\0abc"), "run past the end"),
    (lambda: kserve.raw_tensor("t", "BYTES", (10**6,), b"\0" * 4 * 10**6), "65536"),
    (lambda: kserve.json_tensor("t", "BYTES", (10**6,), [""] * 10**6), "65536"),
    (lambda: kserve.json_tensor("t", "BYTES", (2,), ["a"]), "1 values"),
    (lambda: kserve.json_tensor("t", "BYTES", (1,), [3]), "not a BYTES value"),
    (lambda: kserve.json_tensor("t", "BYTES", (1,), ["\ud800"]), "lone surrogate"),
    (lambda: kserve.json_tensor("t", "BYTES", (1,), ["x" * (64 << 20)]), "at most"),
    (lambda: kserve.as_declared("t", kserve.raw_tensor("t", "BYTES", (1,), _prefixed([b"\xc3("])),
                                "str"), "declared str: element 0 is not valid UTF-8"),
])
def test_malformed_bytes_inputs_are_bad_input(call, words):
    with pytest.raises(ProtocolError) as caught:
        call()
    assert caught.value.code == "BAD_INPUT" and words in caught.value.message, caught.value.message
    assert caught.value.message.startswith("input 't'")


def test_element_outputs_go_back_as_bytes():
    flat, keys = kserve.flatten_outputs((torch.ones(2), ElementList([["A"], ["B"]], "str", (2, 1)),
                                         b"\xff"))
    assert keys is None
    assert [kserve.tensor_datatype(item) for item in flat] == ["FP32", "BYTES", "BYTES"]
    assert [kserve.shape_of(item) for item in flat] == [[2], [2, 1], []]
    assert kserve.tensor_json(flat[1]) == ["A", "B"]
    assert bytes(kserve.tensor_bytes(flat[1])) == _prefixed([b"A", b"B"])
    with pytest.raises(ProtocolError, match="binary data"):
        kserve.tensor_json(flat[2], "raw")
    # an empty dimension keeps its shape (the client's ElementList says it)
    (empty,), _ = kserve.flatten_outputs(ElementList([], "bytes", (0, 3)))
    assert kserve.shape_of(empty) == [0, 3] and kserve.tensor_json(empty) == []


def test_metadata_and_config_say_bytes_for_str_and_bytes_inputs():
    specs = [{"name": "t", "dtype": "str", "shape": [-1]}, {"name": "b", "dtype": "bytes", "shape": [2]}]
    assert [item["datatype"] for item in kserve.tensor_metadata(specs, None)] == ["BYTES", "BYTES"]
    config = kserve.model_config("m", {"inputs": specs, "outputs": []})
    assert [item["data_type"] for item in config["input"]] == ["TYPE_STRING", "TYPE_STRING"]
