"""KServe BYTES through the real gateway: tritonclient (HTTP binary and JSON, gRPC) and raw
HTTP against a daemon serving the text models of tests/textmodels.py.

``upper`` declares its input ``dtype = "str"``: the gateway checks UTF-8 and the model gets
str; ``blobs`` declares bytes and gets bytes as sent. Outputs of str/bytes come back as BYTES.
Every malformed BYTES input (a count that disagrees with the shape, a prefix past the end,
invalid UTF-8 for a str input, 10**6 empty strings, one string over the limit) is a 400 /
INVALID_ARGUMENT naming the input, and the gateway serves on."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

pytest.importorskip("uvicorn", reason="the gateway extra is not installed: pip install '.[gateway]'")
pytest.importorskip("grpc", reason="the gateway extra is not installed: pip install '.[gateway]'")
httpclient = pytest.importorskip("tritonclient.http", reason="tritonclient is in the gateway-test extra")
grpcclient = pytest.importorskip("tritonclient.grpc", reason="tritonclient is in the gateway-test extra")
from tritonclient.utils import InferenceServerException  # noqa: E402

from tests.test_gateway import _post, gateway_daemon, gateway_row, no_buffer_left  # noqa: E402

TEXTS = ["héllo", "", "wörld", "日本語"]
MODELS = [
    {"name": "upper", "source": "python:tests.textmodels:make_upper", "workers": 1,
     "cores_per_worker": 1, "threads": 1, "warmup": 1,
     "inputs": [{"name": "texts", "dtype": "str", "shape": [-1]}],
     "outputs": [{"name": "lengths", "dtype": "int64", "shape": [-1]},
                 {"name": "upper", "dtype": "str", "shape": [-1]}]},
    {"name": "blobs", "source": "python:tests.textmodels:make_blobs", "workers": 1,
     "cores_per_worker": 1, "threads": 1, "warmup": 1,
     "inputs": [{"name": "blobs", "dtype": "bytes", "shape": [-1]}]},
]


@pytest.fixture(autouse=True)
def no_buffer_outlives_its_test():
    """The gateway is a long-lived client and keeps its buffer arena: checked at the end."""
    yield


@pytest.fixture(scope="module")
def daemon():
    with gateway_daemon(MODELS) as instance:
        instance.wait_ready()
        gateway_row(instance)
        yield instance
    no_buffer_left()


def prefixed(items: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(item)) + item for item in items)


def texts_input(module, array: np.ndarray, binary: bool = True):
    item = module.InferInput("texts", list(array.shape), "BYTES")
    if module is httpclient:
        item.set_data_from_numpy(array, binary_data=binary)
    else:
        item.set_data_from_numpy(array)
    return item


@pytest.mark.parametrize("kind, binary", [("http", True), ("http", False), ("grpc", True)],
                         ids=["http-binary", "http-json", "grpc"])
def test_texts_through_tritonclient(daemon, kind, binary):
    row = gateway_row(daemon)
    module = httpclient if kind == "http" else grpcclient
    client = module.InferenceServerClient(row[kind])
    array = np.array([text.encode() for text in TEXTS], dtype=np.object_)
    outputs = None
    if module is httpclient:
        outputs = [httpclient.InferRequestedOutput(name, binary_data=binary)
                   for name in ("lengths", "upper")]
    result = client.infer("upper", [texts_input(module, array, binary)], outputs=outputs)
    assert result.as_numpy("lengths").tolist() == [len(text) for text in TEXTS]
    upper = result.as_numpy("upper")
    assert upper.shape == (4,)
    assert [item.decode() if isinstance(item, bytes) else item for item in upper.tolist()] == \
        [text.upper() for text in TEXTS]
    metadata = client.get_model_metadata("upper")
    if kind == "grpc":
        datatypes = [item.datatype for item in (*metadata.inputs, *metadata.outputs)]
    else:
        datatypes = [item["datatype"] for item in (*metadata["inputs"], *metadata["outputs"])]
    assert datatypes == ["BYTES", "INT64", "BYTES"]


def test_bytes_through_grpc_bytes_contents_and_http(daemon):
    row = gateway_row(daemon)
    blobs = [b"\x00\x01\xff", b"", bytes(range(256))]
    # gRPC typed contents (bytes_contents), built by hand with tritonclient's own messages
    # (the same .proto; ours cannot load beside it): its infer() always sends raw
    import grpc
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc as pb_grpc

    with grpc.insecure_channel(row["grpc"]) as channel:
        request = pb.ModelInferRequest(model_name="blobs")
        item = request.inputs.add(name="blobs", datatype="BYTES", shape=[3])
        item.contents.bytes_contents.extend(blobs)
        reply = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=30)
    assert [output.datatype for output in reply.outputs] == ["INT64", "BYTES"]
    sums = np.frombuffer(reply.raw_output_contents[0], dtype="<i8").tolist()
    assert sums == [sum(blob) for blob in blobs]
    assert reply.raw_output_contents[1] == prefixed([blob[::-1] for blob in blobs])
    # REST, binary both ways: the output bytes are not UTF-8, so JSON cannot carry them
    client = httpclient.InferenceServerClient(row["http"])
    blob_input = httpclient.InferInput("blobs", [3], "BYTES")
    blob_input.set_data_from_numpy(np.array(blobs, dtype=np.object_), binary_data=True)
    result = client.infer("blobs", [blob_input])
    assert result.as_numpy("output__1").tolist() == [blob[::-1] for blob in blobs]
    with pytest.raises(InferenceServerException, match="not UTF-8 text"):
        client.infer("blobs", [blob_input],
                     outputs=[httpclient.InferRequestedOutput("output__1", binary_data=False)])


def _infer_json(address: str, model: str, item: dict) -> tuple[int, dict]:
    return _post(address, f"/v2/models/{model}/infer", json.dumps({"inputs": [item]}).encode())


def _infer_binary(address: str, model: str, name: str, shape: list, data: bytes) -> tuple[int, dict]:
    header = json.dumps({"inputs": [{"name": name, "datatype": "BYTES", "shape": shape,
                                     "parameters": {"binary_data_size": len(data)}}]}).encode()
    return _post(address, f"/v2/models/{model}/infer", header + data,
                 {"Inference-Header-Content-Length": str(len(header))})


def test_curl_style_json_strings(daemon):
    address = gateway_row(daemon)["http"]
    status, body = _infer_json(address, "upper", {"name": "texts", "datatype": "BYTES",
                                                   "shape": [2], "data": ["héllo", "x"]})
    assert status == 200, body
    assert body["outputs"] == [
        {"name": "lengths", "datatype": "INT64", "shape": [2], "data": [5, 1]},
        {"name": "upper", "datatype": "BYTES", "shape": [2], "data": ["HÉLLO", "X"]}]


HUGE = (64 << 20) + 1


def test_malformed_bytes_are_400_and_the_gateway_serves_on(daemon):
    address = gateway_row(daemon)["http"]
    (worker,) = daemon.workers("upper")
    texts = {"name": "texts", "datatype": "BYTES"}
    cases = [
        (_infer_json(address, "upper", {**texts, "shape": [3], "data": ["a", "b"]}),
         "input 'texts': 2 values in 'data', but shape [3] holds 3"),
        (_infer_json(address, "upper", {**texts, "shape": [10**6], "data": [""] * 10**6}),
         "more than 65536 BYTES elements"),
        (_infer_binary(address, "upper", "texts", [2], prefixed([b"ab"])),
         "element 1: its length prefix lies past the end"),
        (_infer_binary(address, "upper", "texts", [1], struct.pack("<I", 99) + b"abc"),
         "element 0: 99 bytes"),
        (_infer_binary(address, "upper", "texts", [1], prefixed([b"ab"]) + b"!"),
         "1 bytes after the last"),
        (_infer_binary(address, "upper", "texts", [2], prefixed([b"ok", b"\xc3\x28"])),
         "input 'texts' is declared str: element 1 is not valid UTF-8"),
        (_infer_binary(address, "upper", "texts", [10**6], b"\0" * 4 * 10**6),
         "more than 65536 BYTES elements"),
        (_infer_binary(address, "upper", "texts", [1], struct.pack("<I", HUGE) + b"x" * HUGE),
         f"{HUGE + 4} bytes of BYTES data exceed"),
    ]
    for (status, body), words in cases:
        assert status == 400, body
        assert body["error"].startswith("BAD_INPUT: ") and words in body["error"], body
    grpc_client = grpcclient.InferenceServerClient(gateway_row(daemon)["grpc"])
    bad = grpcclient.InferInput("texts", [2], "BYTES")
    bad.set_data_from_numpy(np.array([b"ok", b"\xff"], dtype=np.object_))  # not UTF-8
    with pytest.raises(InferenceServerException) as raised:
        grpc_client.infer("upper", [bad])
    assert raised.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "not valid UTF-8" in raised.value.message()
    # the gateway and the worker serve on
    status, body = _infer_json(address, "upper", {**texts, "shape": [1], "data": ["ok"]})
    assert status == 200 and body["outputs"][1]["data"] == ["OK"]
    assert [row["pid"] for row in daemon.workers("upper")] == [worker["pid"]]
