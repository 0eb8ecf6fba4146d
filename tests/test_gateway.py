"""The KServe v2 gateway, end to end: the real daemon spawns the real gateway process, and
clients nobody here wrote (Triton's ``tritonclient`` over HTTP and gRPC, ``curl``, raw HTTP)
talk to it. Outputs are compared with the same models computed in this process."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("uvicorn", reason="the gateway extra is not installed: pip install '.[gateway]'")
pytest.importorskip("grpc", reason="the gateway extra is not installed: pip install '.[gateway]'")
httpclient = pytest.importorskip("tritonclient.http", reason="tritonclient is in the gateway-test extra")
grpcclient = pytest.importorskip("tritonclient.grpc", reason="tritonclient is in the gateway-test extra")
from tritonclient.utils import InferenceServerException  # noqa: E402

from examples.models import make_mlp  # noqa: E402
from modelwarden import Client  # noqa: E402
from tests.faulty import GATE, pair_reference  # noqa: E402
from tests.helpers import (Daemon, Gate, alive, join_within, memfd_holders, mlp_model,  # noqa: E402
                           peak_rss, peak_rss_reset, perf_analyzer, poll_until, rss_bytes)

ROOT = Path(__file__).resolve().parent.parent
MLP = make_mlp(hidden=32)  # what the daemon's mlp workers hold (fixed seed)


def gateway_daemon(models: list[dict], gateway: dict | None = None, env: dict | None = None,
                   **daemon) -> Daemon:
    """A Daemon whose configuration has a [gateway] section (ephemeral ports by default)."""
    instance = Daemon(models, daemon=daemon or None, env=env)
    section = gateway or {"http": "127.0.0.1:0", "grpc": "127.0.0.1:0"}
    lines = ["", "[gateway]"] + [f"{key} = {json.dumps(value)}" for key, value in section.items()]
    instance.config_path.write_text(instance.config_path.read_text() + "\n".join(lines) + "\n")
    return instance


def gateway_row(daemon: Daemon, pid_not: int | None = None, timeout: float = 90.0) -> dict:
    """The status row of a READY gateway (another process than ``pid_not``)."""
    def ready():
        row = daemon.status()["gateway"]
        return row if row["state"] == "READY" and row["pid"] != pid_not else None

    return poll_until(ready, timeout, message="the gateway READY")


MODELS = [
    mlp_model("mlp", workers=2, batching={"max_size": 8},
              outputs=[{"name": "logits", "dtype": "float32", "shape": [-1, 10]}]),
    {"name": "pair", "source": "python:tests.faulty:make_pair", "workers": 1, "cores_per_worker": 1,
     "threads": 1, "warmup": 1,
     "inputs": [{"name": "a", "dtype": "float32", "shape": [-1, 8]},
                {"name": "b", "dtype": "float32", "shape": [-1, 1]}],
     "outputs": [{"name": "y", "dtype": "float32", "shape": [-1, 8]},
                 {"name": "z", "dtype": "float32", "shape": [-1, 1]}]},
    # No declared inputs: any dtype passes; the outputs are fresh copies of the inputs, after
    # 50 ms (longer than a 1 ms timeout).
    {"name": "echo", "source": "python:tests.faulty:make_echo", "kwargs": {"copy": True, "delay": 0.05},
     "workers": 1, "cores_per_worker": 1, "threads": 1, "warmup": 0},
]


@pytest.fixture(autouse=True)
def no_buffer_outlives_its_test():
    """Replaces conftest.py's check after each test: the gateway is a long-lived client of the
    module's daemon and keeps its buffer arena (shared memory, as any client's) while it runs.
    The daemon fixture checks instead that no buffer outlives the daemon and its gateway."""
    yield


def no_buffer_left() -> None:
    poll_until(lambda: not memfd_holders(exclude=(os.getpid(),)), timeout=15,
               message="no other process holding a memfd:modelwarden")


@pytest.fixture(scope="module")
def daemon():
    with gateway_daemon(MODELS) as instance:
        instance.wait_ready()
        gateway_row(instance)
        yield instance
    no_buffer_left()


def clients(daemon: Daemon) -> dict:
    row = gateway_row(daemon)
    return {"http": httpclient.InferenceServerClient(row["http"]),
            "grpc": grpcclient.InferenceServerClient(row["grpc"])}


def infer(client, module, model: str, arrays: dict, datatypes: dict, binary: bool = True,
          outputs: list[str] | None = None, **kwargs):
    inputs = []
    for name, array in arrays.items():
        item = module.InferInput(name, list(array.shape), datatypes[name])
        if module is httpclient:
            item.set_data_from_numpy(array, binary_data=binary)
        else:
            item.set_data_from_numpy(array)
        inputs.append(item)
    requested = None
    if outputs is not None:
        requested = [module.InferRequestedOutput(name, binary_data=binary) if module is httpclient
                     else module.InferRequestedOutput(name) for name in outputs]
    return client.infer(model, inputs, outputs=requested, **kwargs)


TRANSPORTS = [("http", httpclient, True), ("http", httpclient, False), ("grpc", grpcclient, True)]
TRANSPORT_IDS = ["http-binary", "http-json", "grpc"]


# -- health and metadata -----------------------------------------------------------------------


def test_health_and_metadata_through_tritonclient(daemon):
    for kind, client in clients(daemon).items():
        assert client.is_server_live() and client.is_server_ready(), kind
        assert client.is_model_ready("mlp"), kind
        metadata = client.get_model_metadata("mlp")
        if kind == "grpc":
            metadata = {"inputs": [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}
                                   for t in metadata.inputs],
                        "outputs": [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}
                                    for t in metadata.outputs],
                        "versions": list(metadata.versions)}
        assert metadata["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 64]}]
        assert metadata["outputs"] == [{"name": "logits", "datatype": "FP32", "shape": [-1, 10]}]
        version = daemon.status()["models"][0]["version"]
        assert metadata["versions"] == [version]
        assert client.is_model_ready("mlp", version)


def _grpc_config(config: dict) -> dict:
    """tritonclient's JSON of a gRPC ModelConfig (int64 as strings, zeros left out) in the
    REST form."""
    def tensors(items):
        return [{**item, "dims": [int(dim) for dim in item["dims"]]} for item in items]

    return {**config, "max_batch_size": config.get("max_batch_size", 0),
            "input": tensors(config.get("input", [])), "output": tensors(config.get("output", []))}


def test_model_config_is_what_tritons_tools_read(daemon):
    """Triton's model_configuration extension, which perf_analyzer and model_analyzer read
    before they send a request: the batch dimension leaves dims when the model batches."""
    http_client, grpc_client = clients(daemon).values()
    batching = {"name": "mlp", "platform": "pytorch", "backend": "modelwarden", "max_batch_size": 8,
                "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [64]}],
                "output": [{"name": "logits", "data_type": "TYPE_FP32", "dims": [10]}],
                "dynamic_batching": {}}  # max_queue_delay_microseconds 0: left out by protobuf
    plain = {"name": "pair", "platform": "pytorch", "backend": "modelwarden", "max_batch_size": 0,
             "input": [{"name": "a", "data_type": "TYPE_FP32", "dims": [-1, 8]},
                       {"name": "b", "data_type": "TYPE_FP32", "dims": [-1, 1]}],
             "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [-1, 8]},
                        {"name": "z", "data_type": "TYPE_FP32", "dims": [-1, 1]}]}
    rest = http_client.get_model_config("mlp")
    assert rest == {**batching, "dynamic_batching": {"max_queue_delay_microseconds": 0}}
    assert http_client.get_model_config("pair") == plain
    assert _grpc_config(grpc_client.get_model_config("mlp", as_json=True)["config"]) == batching
    assert _grpc_config(grpc_client.get_model_config("pair", as_json=True)["config"]) == plain
    assert "model_configuration" in http_client.get_server_metadata()["extensions"]
    assert _get(gateway_row(daemon)["http"], "/v2/models/nope/config")[0] == 404
    with pytest.raises(InferenceServerException) as raised:
        grpc_client.get_model_config("nope")
    assert raised.value.status() == "StatusCode.NOT_FOUND"


def test_a_model_declaring_no_outputs_lists_those_its_warm_up_learned():
    # No "outputs" in its configuration: REST and gRPC metadata, the model config and hello
    # list what the workers' last warm-up forward returned, named as an infer names them.
    learned = [{"name": "output__0", "datatype": "FP32", "shape": [-1, 10]}]
    with gateway_daemon([mlp_model("plain", workers=1, batching={"max_size": 4})]) as instance:
        instance.wait_ready()
        http_client, grpc_client = clients(instance).values()
        assert http_client.get_model_metadata("plain")["outputs"] == learned
        metadata = grpc_client.get_model_metadata("plain")
        assert [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}
                for t in metadata.outputs] == learned
        assert http_client.get_model_config("plain")["output"] == [
            {"name": "output__0", "data_type": "TYPE_FP32", "dims": [10]}]
        x = np.random.default_rng(2).standard_normal((3, 64), dtype=np.float32)
        result = infer(http_client, httpclient, "plain", {"x": x}, {"x": "FP32"}, outputs=["output__0"])
        np.testing.assert_allclose(result.as_numpy("output__0"), MLP(torch.from_numpy(x)).detach().numpy(),
                                   rtol=1e-5, atol=1e-6)
        with Client(instance.endpoint) as client:
            entry = next(m for m in client.hello()["models"] if m["name"] == "plain")
        assert entry["outputs"] == [{"name": "output__0", "dtype": "float32", "shape": [-1, 10]}]
    no_buffer_left()


def perf_analyzer_command() -> tuple[list[str], dict]:
    found = perf_analyzer()
    if isinstance(found, str):
        pytest.skip(found)
    return [str(found[0])], found[1]


def mlp_requests(daemon: Daemon) -> int:
    return sum(worker["requests"] for worker in daemon.workers("mlp"))


@pytest.mark.parametrize("kind", ["grpc", "http"])
def test_tritons_perf_analyzer_measures_the_gateway_unchanged(daemon, kind):
    command, env = perf_analyzer_command()
    before = mlp_requests(daemon)
    done = subprocess.run(command + ["-m", "mlp", "-i", kind, "-u", gateway_row(daemon)[kind],
                                     "--concurrency-range", "2", "--measurement-mode",
                                     "count_windows", "--measurement-request-count", "100",
                                     "--stability-percentage", "100", "--max-trials", "3"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    counted = sum(int(n) for n in re.findall(r"Request count: (\d+)", done.stdout))
    throughput = re.search(r"Concurrency: 2, throughput: ([0-9.]+) infer/sec", done.stdout)
    assert counted >= 100 and throughput and float(throughput.group(1)) > 0, done.stdout
    # The requests it counted reached the workers (warm-up and trials add more).
    assert mlp_requests(daemon) - before >= counted


def test_rest_health_endpoints_and_server_metadata(daemon):
    row = gateway_row(daemon)
    assert _get(row["http"], "/v2/health/live") == (200, {"live": True})
    assert _get(row["http"], "/v2/health/ready") == (200, {"ready": True})
    status, body = _get(row["http"], "/v2")
    assert status == 200 and body["name"] == "modelwarden"
    assert set(body["extensions"]) == {"binary_tensor_data", "model_configuration"}
    assert _get(row["http"], "/v2/models/nope/ready")[0] == 404
    status, body = _get(row["http"], "/v2/models/mlp/versions/bogus")
    assert status == 404 and body["error"].startswith("UNKNOWN_MODEL: model 'mlp' has no version 'bogus'")


def test_a_keep_alive_rest_call_does_not_wait_for_delayed_acks(daemon):
    # Without TCP_NODELAY on the gateway's connections each response waited out the client's
    # delayed ACK: 40 ms or more per call, whatever the load.
    import statistics
    import time

    connection = http.client.HTTPConnection(gateway_row(daemon)["http"], timeout=30)
    try:
        took = []
        for _ in range(21):
            started = time.perf_counter()
            connection.request("GET", "/v2/health/live")
            connection.getresponse().read()
            took.append(time.perf_counter() - started)
    finally:
        connection.close()
    assert statistics.median(took) < 0.035, took


# -- inference ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind,module,binary", TRANSPORTS, ids=TRANSPORT_IDS)
def test_float32_outputs_equal_the_in_process_model(daemon, kind, module, binary):
    client = clients(daemon)[kind]
    x = np.random.default_rng(1).standard_normal((5, 64), dtype=np.float32)
    result = infer(client, module, "mlp", {"x": x}, {"x": "FP32"}, binary, ["logits"],
                   request_id="req-7")
    with torch.no_grad():
        expected = MLP(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(result.as_numpy("logits"), expected, rtol=1e-5, atol=1e-6)
    response = result.get_response()
    assert (response["id"] if kind == "http" else response.id) == "req-7"


@pytest.mark.parametrize("kind,module,binary", TRANSPORTS, ids=TRANSPORT_IDS)
@pytest.mark.parametrize("datatype,array", [
    ("INT64", np.arange(-6, 6, dtype=np.int64).reshape(3, 4)),
    ("BOOL", np.array([[True, False, True], [False, False, True]])),
    ("FP16", np.linspace(-2, 2, 8, dtype=np.float16).reshape(2, 4)),
    ("INT8", np.array([-128, 0, 127], dtype=np.int8)),
    ("FP64", np.array([[1e300, -1.5]], dtype=np.float64)),
], ids=["int64", "bool", "fp16", "int8", "fp64"])
def test_datatypes_travel_both_ways_unchanged(daemon, kind, module, binary, datatype, array):
    client = clients(daemon)[kind]
    result = infer(client, module, "echo", {"in": array}, {"in": datatype}, binary)
    back = result.as_numpy("output__0")
    assert back.dtype == array.dtype and np.array_equal(back, array)


@pytest.mark.parametrize("kind,module", [("http", httpclient), ("grpc", grpcclient)])
def test_bf16_travels_as_raw_bytes(daemon, kind, module):
    # tritonclient takes BF16 as float32 arrays and truncates them to their upper half.
    client = clients(daemon)[kind]
    values = np.array([[1.0, -2.5, 0.15625, 3e38]], dtype=np.float32)
    result = infer(client, module, "echo", {"in": values}, {"in": "BF16"})
    truncated = (values.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    assert np.array_equal(result.as_numpy("output__0"), truncated)


@pytest.mark.parametrize("kind,module,binary", TRANSPORTS, ids=TRANSPORT_IDS)
def test_two_inputs_two_outputs_named_as_declared(daemon, kind, module, binary):
    client = clients(daemon)[kind]
    rng = np.random.default_rng(2)
    a = rng.standard_normal((3, 8), dtype=np.float32)
    b = rng.standard_normal((3, 1), dtype=np.float32)
    result = infer(client, module, "pair", {"b": b, "a": a}, {"a": "FP32", "b": "FP32"}, binary)
    y, z = pair_reference(torch.from_numpy(a), torch.from_numpy(b))
    np.testing.assert_allclose(result.as_numpy("y"), y.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(result.as_numpy("z"), z.numpy(), rtol=1e-5, atol=1e-6)
    only_z = infer(client, module, "pair", {"a": a, "b": b}, {"a": "FP32", "b": "FP32"}, binary, ["z"])
    assert only_z.as_numpy("y") is None
    np.testing.assert_allclose(only_z.as_numpy("z"), z.numpy(), rtol=1e-5, atol=1e-6)


def test_a_large_tensor_goes_through_shared_memory_and_back(daemon):
    client = clients(daemon)["grpc"]
    array = np.random.default_rng(3).standard_normal((1024, 1024), dtype=np.float32)  # 4 MiB
    result = infer(client, grpcclient, "echo", {"in": array}, {"in": "FP32"})
    assert np.array_equal(result.as_numpy("output__0"), array)
    # The gateway registered a buffer with the daemon, and the echo worker mapped it.
    assert daemon.status()["daemon"]["buffers"] >= 1
    echo_pid = daemon.workers("echo", "READY")[0]["pid"]
    assert "memfd:modelwarden" in Path(f"/proc/{echo_pid}/maps").read_text()


@pytest.mark.parametrize("kind,module,status", [("http", httpclient, "504"),
                                                ("grpc", grpcclient, "StatusCode.DEADLINE_EXCEEDED")])
def test_parameters_timeout_is_honoured(daemon, kind, module, status):
    client = clients(daemon)[kind]
    value = np.zeros((1, 1), dtype=np.float32)
    # tritonclient sends timeout= (microseconds) as parameters.timeout; echo takes 50 ms.
    with pytest.raises(InferenceServerException) as caught:
        infer(client, module, "echo", {"in": value}, {"in": "FP32"}, timeout=1000)
    assert caught.value.status() == status and caught.value.message().startswith("TIMEOUT: ")
    result = infer(client, module, "echo", {"in": value}, {"in": "FP32"}, timeout=10_000_000)
    assert np.array_equal(result.as_numpy("output__0"), value)


def test_the_readme_curl_example(daemon):
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("curl is not installed")
    readme = (ROOT / "README.md").read_text()
    command = next(line for line in readme.splitlines()
                   if line.startswith("curl ") and "/v2/models/mlp/infer" in line)
    command = command.replace("localhost:8000", gateway_row(daemon)["http"])
    done = subprocess.run(["bash", "-c", command + " -w '\\n%{http_code}'"], capture_output=True,
                          text=True, timeout=60)
    body, _, status = done.stdout.rpartition("\n")
    assert status == "200", done.stdout + done.stderr
    reply = json.loads(body)
    with torch.no_grad():
        expected = MLP(torch.arange(1, 65, dtype=torch.float32).reshape(1, 64))
    assert reply["outputs"][0]["name"] == "logits" and reply["outputs"][0]["shape"] == [1, 10]
    np.testing.assert_allclose(reply["outputs"][0]["data"], expected.reshape(-1).numpy(), rtol=1e-5)


# -- bad input ----------------------------------------------------------------------------------


def _get(address: str, path: str) -> tuple[int, dict]:
    connection = http.client.HTTPConnection(address, timeout=30)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, json.loads(response.read() or b"null")
    finally:
        connection.close()


def _post(address: str, path: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    connection = http.client.HTTPConnection(address, timeout=30)
    try:
        connection.request("POST", path, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def _declare_only(address: str, path: str, headers: dict) -> tuple[int, dict]:
    """Send headers that promise a body, never send it: the answer must come anyway."""
    connection = http.client.HTTPConnection(address, timeout=30)
    try:
        connection.putrequest("POST", path)
        for key, value in headers.items():
            connection.putheader(key, value)
        connection.endheaders()
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def test_bad_input_over_raw_http_gets_typed_errors_and_the_gateway_serves_on(daemon):
    row = gateway_row(daemon)
    address, path = row["http"], "/v2/models/mlp/infer"
    x = {"name": "x", "datatype": "FP32", "shape": [1, 64]}
    cases = [
        (_post(address, path, json.dumps({"inputs": [{**x, "datatype": "FLOAT", "data": [0] * 64}]}).encode()),
         400, "BAD_INPUT: input 'x': datatype 'FLOAT' is not supported"),
        (_post(address, path, json.dumps({"inputs": [{**x, "data": [0] * 63}]}).encode()),
         400, "BAD_INPUT: input 'x': 63 values"),
        (_post(address, path, json.dumps({"inputs": [{**x, "parameters": {"binary_data_size": 256}}]}).encode()
               + b"\0" * 200, {"Inference-Header-Content-Length": str(len(json.dumps(
                   {"inputs": [{**x, "parameters": {"binary_data_size": 256}}]})))}),
         400, "BAD_INPUT: input 'x': binary_data_size 256, but only 200 bytes"),
        (_post(address, path, b"{not json"), 400, "BAD_REQUEST: the request body is not valid JSON"),
        (_post(address, path, b"[" * 100_000 + b"]" * 100_000), 400,
         "BAD_REQUEST: the request body is not valid JSON: nested too deeply"),
        (_post(address, "/v2/models/nope/infer", json.dumps({"inputs": [{**x, "data": [0] * 64}]}).encode()),
         404, "UNKNOWN_MODEL"),
        (_post(address, path, json.dumps({"inputs": [{**x, "datatype": "INT64", "data": [0] * 64}]}).encode()),
         400, "BAD_INPUT: input 'x': dtype int64, model takes float32"),
        (_declare_only(address, path, {"Content-Length": "100",
                                       "Inference-Header-Content-Length": str(3 * 1024**3)}),
         400, "BAD_REQUEST: Inference-Header-Content-Length 3221225472 exceeds"),
        (_declare_only(address, path, {"Content-Length": str(3 * 1024**3)}),
         413, "BAD_REQUEST: the request body exceeds the gateway's max_message_bytes"),
    ]
    for (status, body), want_status, want_text in cases:
        assert status == want_status and body["error"].startswith(want_text), (status, body)
        assert "Traceback" not in body["error"] and str(ROOT) not in body["error"]
    assert _get(address, "/v2/health/live")[0] == 200
    assert gateway_row(daemon)["pid"] == row["pid"]  # the same process served all of it
    assert "RecursionError" not in daemon.log()  # a caller's error logs no traceback


def test_bad_input_through_tritonclient_gets_typed_errors(daemon):
    row = gateway_row(daemon)
    http_client, grpc_client = clients(daemon)["http"], clients(daemon)["grpc"]
    x = np.zeros((1, 64), dtype=np.int64)
    for client, module, unknown, invalid in ((http_client, httpclient, "404", "400"),
                                             (grpc_client, grpcclient, "StatusCode.NOT_FOUND",
                                              "StatusCode.INVALID_ARGUMENT")):
        with pytest.raises(InferenceServerException) as caught:
            infer(client, module, "mlp", {"x": x}, {"x": "INT64"})
        assert caught.value.status() == invalid and "BAD_INPUT" in caught.value.message()
        with pytest.raises(InferenceServerException) as caught:
            infer(client, module, "nope", {"x": x}, {"x": "INT64"})
        assert caught.value.status() == unknown and "UNKNOWN_MODEL" in caught.value.message()
    # Raw contents shorter than the shape says, through tritonclient's own gRPC stubs (its
    # InferInput checks sizes on the client side).
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    request = service_pb2.ModelInferRequest(model_name="mlp", raw_input_contents=[b"\0" * 100])
    request.inputs.add(name="x", datatype="FP32", shape=[1, 64])
    with grpc.insecure_channel(row["grpc"]) as channel:
        with pytest.raises(grpc.RpcError) as caught:
            service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == "BAD_INPUT: input 'x': 100 bytes of data, but FP32 [1, 64] needs 256"
    # Bytes that are no protobuf message at all.
    with grpc.insecure_channel(row["grpc"]) as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        with pytest.raises(grpc.RpcError) as caught:
            call(b"\xff\xff\xff\x0f", timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith("BAD_REQUEST: the message is not a valid")
    assert "Traceback" not in daemon.log()
    assert gateway_row(daemon)["pid"] == row["pid"]
    assert http_client.is_server_live()


# -- supervision --------------------------------------------------------------------------------


def test_status_shows_the_gateway(daemon):
    done = subprocess.run([sys.executable, "-m", "modelwarden", "status", "--config",
                           str(daemon.config_path)], capture_output=True, text=True, timeout=60)
    row = gateway_row(daemon)
    assert re.search(rf"gateway READY\s+pid {row['pid']}\s+http {re.escape(row['http'])}, grpc "
                     rf"{re.escape(row['grpc'])}\s+access none\s", done.stdout), done.stdout
    assert row["access"] == ["none"]


def test_a_killed_gateway_is_restarted_and_native_clients_never_notice(daemon):
    row = gateway_row(daemon)
    failures, served, stop = [], [], threading.Event()

    def native_traffic():
        with Client(daemon.endpoint, timeout=30) as client:
            while not stop.is_set():
                try:
                    client.infer("mlp", torch.zeros(1, 64))
                    served.append(1)
                except Exception as exc:
                    failures.append(exc)

    thread = threading.Thread(target=native_traffic, name="native traffic")
    thread.start()
    try:
        poll_until(lambda: len(served) > 5, 60, message="native traffic flowing")
        os.kill(row["pid"], signal.SIGKILL)
        before = len(served)
        new = gateway_row(daemon, pid_not=row["pid"])
        poll_until(lambda: len(served) > before + 5, 60, message="native traffic after the kill")
    finally:
        stop.set()
        join_within(thread)
    assert not failures
    assert new["restarts"] == row["restarts"] + 1 and new["last_exit"] == "SIGKILL"
    assert not alive(row["pid"])
    assert httpclient.InferenceServerClient(new["http"]).is_server_ready()
    assert grpcclient.InferenceServerClient(new["grpc"]).is_server_ready()


def test_a_killed_worker_under_gateway_load_loses_no_request(daemon):
    row = gateway_row(daemon)
    errors, answers = [], []
    x = np.random.default_rng(4).standard_normal((2, 64), dtype=np.float32)
    with torch.no_grad():
        expected = MLP(torch.from_numpy(x)).numpy()

    def load(kind: str):
        client = (httpclient.InferenceServerClient(row["http"]) if kind == "http"
                  else grpcclient.InferenceServerClient(row["grpc"]))
        module = httpclient if kind == "http" else grpcclient
        for _ in range(40):
            try:
                answers.append(infer(client, module, "mlp", {"x": x}, {"x": "FP32"}).as_numpy("logits"))
            except Exception as exc:
                errors.append(exc)

    threads = [threading.Thread(target=load, args=(kind,)) for kind in ("http", "grpc") * 2]
    for thread in threads:
        thread.start()
    poll_until(lambda: len(answers) > 10, 60, message="gateway traffic flowing")
    victim = daemon.workers("mlp", "READY")[0]
    os.kill(victim["pid"], signal.SIGKILL)
    for thread in threads:
        join_within(thread)
    assert not errors
    assert len(answers) == 160 and all(np.allclose(a, expected, rtol=1e-5, atol=1e-6) for a in answers)
    poll_until(lambda: any(w["id"] == victim["id"] and w["restarts"] >= 1 for w in daemon.workers("mlp")),
               60, message="the killed worker's slot restarted")


def test_the_gateway_stops_after_the_last_worker():
    with gateway_daemon([mlp_model("mlp", workers=1)], {"http": "127.0.0.1:0"}) as instance:
        instance.wait_ready()
        row = gateway_row(instance)
        assert row["grpc"] is None
        assert instance.stop() == 0
        assert not alive(row["pid"])
        log = instance.log()
        worker_stopped = log.index("DRAINING -> STOPPED")
        assert log.index("gateway pid", worker_stopped) > worker_stopped
        assert re.search(r"gateway pid \d+: STOPPING -> STOPPED \(exit 0", log)
    no_buffer_left()


def test_a_gateway_that_cannot_bind_backs_off_and_the_daemon_serves_on():
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    address = f"127.0.0.1:{taken.getsockname()[1]}"
    try:
        with gateway_daemon([mlp_model("mlp", workers=1)], {"http": address}) as instance:
            instance.wait_ready()
            row = poll_until(lambda: (lambda g: g if g["restarts"] >= 2 else None)(instance.status()["gateway"]),
                             90, message="two failed gateway starts")
            assert row["last_exit"] == "exit 3 (boot error)" and row["state"] in ("BACKOFF", "STARTING")
            assert "cannot listen on " + address in instance.log()
            delays = [float(d) for d in re.findall(r"gateway exited \(exit 3 \(boot error\)\); "
                                                   r"restarting in ([0-9.]+)s", instance.log())]
            assert delays[:2] == [0.5, 1.0]
            with Client(instance.endpoint, timeout=30) as client:
                assert client.infer("mlp", torch.zeros(1, 64)).shape == (1, 10)
    finally:
        taken.close()
    no_buffer_left()


def test_a_gateway_without_an_ipc_frontend_is_refused_at_start():
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    instance = gateway_daemon([mlp_model("mlp", workers=1)], frontend=[f"tcp://127.0.0.1:{port}"])
    with instance:
        code = instance.process.wait(60)
        assert code == 1
        assert "[gateway] needs an ipc:// frontend" in instance.log()


def test_readiness_follows_the_workers():
    with gateway_daemon([mlp_model("mlp", workers=1)]) as instance:
        instance.wait_ready()
        row = gateway_row(instance)
        grpc_client = grpcclient.InferenceServerClient(row["grpc"])
        assert _get(row["http"], "/v2/health/ready")[0] == 200 and grpc_client.is_server_ready()
        instance.command("stop", target="mlp")
        poll_until(lambda: _get(row["http"], "/v2/health/ready") == (503, {"ready": False}), 60,
                   message="the gateway not ready once the model has no READY worker")
        assert _get(row["http"], "/v2/models/mlp/ready") == (503, {"name": "mlp", "ready": False})
        assert not grpc_client.is_server_ready() and not grpc_client.is_model_ready("mlp")
        assert _get(row["http"], "/v2/health/live")[0] == 200
        # A slot still draining is not restarted: wait until it has stopped.
        poll_until(lambda: [w["state"] for w in instance.workers("mlp")] == ["STOPPED"], 60,
                   message="mlp#0 STOPPED")
        instance.command("restart", target="mlp")
        poll_until(lambda: _get(row["http"], "/v2/health/ready")[0] == 200, 90,
                   message="the gateway ready again")
    no_buffer_left()


def test_a_daemon_configured_with_a_gateway_it_cannot_run_refuses_to_start(tmp_path):
    # An interpreter where uvicorn is not installed, as importlib sees it: a None entry in
    # sys.modules is the import system's own "no such module" (find_spec returns None, import
    # raises ModuleNotFoundError), set here before the daemon's code runs.
    shim = tmp_path / "no-uvicorn"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text("import sys\nsys.modules['uvicorn'] = None\n")
    path = os.pathsep.join(filter(None, [str(shim), os.environ.get("PYTHONPATH")]))
    with gateway_daemon([mlp_model("mlp", workers=1)], env={"PYTHONPATH": path}) as instance:
        code = instance.process.wait(60)
        log = instance.log()
    assert code == 1, log
    assert ("[gateway] is configured but uvicorn is not installed: pip install "
            "'modelwarden[gateway]' (or remove the [gateway] section)") in log
    assert "READY" not in log  # refused before any worker was spawned


def test_readiness_is_503_while_the_daemon_drains_and_the_request_in_flight_completes(tmp_path):
    gate = tmp_path / "gate"
    model = {"name": "pair", "source": "python:tests.faulty:make_pair",
             "kwargs": {"gate": str(gate)}, "workers": 1, "cores_per_worker": 1, "threads": 1,
             "warmup": 0, "probe": {"interval": 0},
             "inputs": [{"name": "a", "dtype": "float32", "shape": [-1, 8]},
                        {"name": "b", "dtype": "float32", "shape": [-1, 1]}]}
    a = np.zeros((1, 8), dtype=np.float32)
    a[0, 0] = GATE
    b = np.ones((1, 1), dtype=np.float32)
    with gateway_daemon([model]) as instance:
        instance.wait_ready()
        row = gateway_row(instance)
        grpc_client = grpcclient.InferenceServerClient(row["grpc"])
        gate.touch()
        answers = []
        held = threading.Thread(target=lambda: answers.append(infer(
            grpcclient.InferenceServerClient(row["grpc"]), grpcclient, "pair", {"a": a, "b": b},
            {"a": "FP32", "b": "FP32"})), name="held request")
        held.start()
        try:
            poll_until(lambda: instance.workers("pair")[0]["inflight"] == 1, 60,
                       message="the worker busy with the gated request")
            instance.process.send_signal(signal.SIGTERM)
            poll_until(lambda: _get(row["http"], "/v2/health/ready") == (503, {"ready": False}), 30,
                       message="readiness 503 while the daemon drains")
            assert not grpc_client.is_server_ready()
            assert _get(row["http"], "/v2/health/live") == (200, {"live": True})
            assert instance.process.poll() is None  # still draining: the request is held
            status, body = _post(row["http"], "/v2/models/pair/infer", json.dumps(
                {"inputs": [{"name": "a", "datatype": "FP32", "shape": [1, 8], "data": [0.0] * 8},
                            {"name": "b", "datatype": "FP32", "shape": [1, 1], "data": [1.0]}]}).encode())
            assert status == 503 and body["error"].startswith("SHUTTING_DOWN: "), body
        finally:
            gate.unlink(missing_ok=True)
            join_within(held)
        assert instance.process.wait(60) == 0
    y, z = pair_reference(torch.from_numpy(a), torch.from_numpy(b))
    np.testing.assert_allclose(answers[0].as_numpy("output__0"), y.numpy(), rtol=1e-6)
    np.testing.assert_allclose(answers[0].as_numpy("output__1"), z.numpy(), rtol=1e-6)
    assert not alive(row["pid"])
    no_buffer_left()


def test_a_message_over_max_message_bytes_is_refused_on_both_transports():
    limit = 1024 * 1024
    with gateway_daemon([mlp_model("mlp", workers=1)],
                        {"http": "127.0.0.1:0", "grpc": "127.0.0.1:0", "max_message_bytes": limit}) as instance:
        instance.wait_ready()
        row = gateway_row(instance)
        big = np.zeros((1, limit // 4 + 1024), dtype=np.float32)  # 4 KiB over the limit
        grpc_client = grpcclient.InferenceServerClient(row["grpc"])
        with pytest.raises(InferenceServerException) as raised:
            infer(grpc_client, grpcclient, "mlp", {"x": big}, {"x": "FP32"})
        assert raised.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
        with pytest.raises(InferenceServerException) as raised:
            infer(httpclient.InferenceServerClient(row["http"]), httpclient, "mlp", {"x": big},
                  {"x": "FP32"})
        assert raised.value.status() == "413"
        # Refused, not fatal: the same gateway serves a request under the limit.
        x = np.ones((2, 64), dtype=np.float32)
        with torch.no_grad():
            expected = MLP(torch.from_numpy(x)).numpy()
        np.testing.assert_allclose(infer(grpc_client, grpcclient, "mlp", {"x": x}, {"x": "FP32"})
                                   .as_numpy("output__0"), expected, rtol=1e-5, atol=1e-6)
        assert gateway_row(instance)["pid"] == row["pid"]
    no_buffer_left()


# -- what one call may cost the gateway ------------------------------------------------------------


JSON_BODY_BYTES = 48 * 1024 * 1024
JSON_RSS_BOUND = 64 * 1024 * 1024
LIVE_WITHIN_S = 0.5


def _json_body(nbytes: int) -> bytes:
    values = b"0.123456789," * (nbytes // 12)
    return b'{"inputs":[{"name":"in","datatype":"FP32","shape":[%d],"data":[%s0]}]}' % (
        nbytes // 12 + 1, values)


def _send_body(address: str, body: bytes, chunked: bool) -> tuple[int, dict]:
    """POST ``body`` from a raw socket, chunked or with its Content-Length; the answer may come
    before the body is all sent (then the rest is not)."""
    import socket as socket_module

    host, port = address.rsplit(":", 1)
    sock = socket_module.create_connection((host, int(port)), timeout=30)
    head = (b"POST /v2/models/echo/infer HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
            + (b"Transfer-Encoding: chunked\r\n" if chunked else b"Content-Length: %d\r\n" % len(body))
            + b"\r\n")
    sent = threading.Thread(target=_send_quietly, args=(sock, head, body, chunked), daemon=True)
    sent.start()
    reply = b""
    try:
        while b"\r\n\r\n" not in reply or len(reply.partition(b"\r\n\r\n")[2]) < _length(reply):
            data = sock.recv(65536)
            if not data:
                break
            reply += data
    finally:
        sock.close()
        join_within(sent)
    status = int(reply.split(b" ", 2)[1])
    return status, json.loads(reply.partition(b"\r\n\r\n")[2])


def _length(reply: bytes) -> int:
    match = re.search(rb"(?i)content-length: *(\d+)", reply.partition(b"\r\n\r\n")[0])
    return int(match.group(1)) if match else 0


def _send_quietly(sock, head: bytes, body: bytes, chunked: bool) -> None:
    try:
        sock.sendall(head)
        step = 1024 * 1024
        for start in range(0, len(body), step):
            piece = body[start:start + step]
            sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
        if chunked:
            sock.sendall(b"0\r\n\r\n")
    except OSError:  # the gateway answered and closed: the rest is not wanted
        pass


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_48_mib_json_body_is_refused_cheaply_and_health_answers_meanwhile(daemon, chunked):
    """48 MiB of JSON numbers once cost the gateway 670 MiB and stalled it 4 s: now over
    max_json_bytes (8 MiB), refused with a 413 that points to the binary extension."""
    row = gateway_row(daemon)
    body = _json_body(JSON_BODY_BYTES)
    latencies, stop = [], threading.Event()

    def probe_live():
        while not stop.is_set():
            started = time.monotonic()
            assert _get(row["http"], "/v2/health/live")[0] == 200
            latencies.append(time.monotonic() - started)

    before = rss_bytes(row["pid"])
    peak_rss_reset(row["pid"])
    prober = threading.Thread(target=probe_live, daemon=True)
    prober.start()
    try:
        status, reply = _send_body(row["http"], body, chunked)
    finally:
        stop.set()
        join_within(prober)
    peak = peak_rss(row["pid"])
    print(f"gateway RSS {before / 2**20:.0f} MiB, peak {peak / 2**20:.0f} MiB; /v2/health/live "
          f"slowest {max(latencies) * 1000:.0f} ms of {len(latencies)}")
    assert status == 413 and "max_json_bytes (8388608)" in reply["error"], reply
    assert "binary tensor data extension" in reply["error"]
    assert peak - before < JSON_RSS_BOUND, (before, peak)
    assert latencies and max(latencies) < LIVE_WITHIN_S, latencies


def test_a_json_body_within_max_json_bytes_is_served(daemon):
    row = gateway_row(daemon)
    status, reply = _send_body(row["http"], _json_body(2 * 1024 * 1024), chunked=False)
    assert status == 200 and reply["outputs"][0]["shape"] == [2 * 1024 * 1024 // 12 + 1], reply


# within one caller's share of the gateway's bytes in flight (a quarter of 4 x 256 MiB)
BURST_CALLS, BURST_BYTES = 7, 32 * 1024 * 1024


def test_an_idle_gateway_gives_back_its_shared_memory_after_a_burst(daemon):
    """A burst of large gRPC calls (each tensor through the gateway's shared memory, in and
    out), then nothing: the gateway returns to within twice its start RSS, and the daemon holds
    no more of its buffers than a few."""
    row = gateway_row(daemon)
    start_rss = rss_bytes(row["pid"])
    array = np.ones((BURST_BYTES // 4,), dtype=np.float32)

    def one_call(_):
        client = grpcclient.InferenceServerClient(row["grpc"])
        try:
            result = infer(client, grpcclient, "echo", {"in": array}, {"in": "FP32"})
            return bool(np.array_equal(result.as_numpy("output__0"), array))
        finally:
            client.close()

    # One call first: the gateway's client sizes a request's out region by the model's last
    # reply (client/session.py), and an earlier test's small echo would send the burst's 32 MiB
    # outputs inline, past the buffers this test is about.
    assert one_call(0)
    # The most buffers the burst held at once, sampled while it runs: its calls finish about as
    # fast as they come, so a count taken after it may already be lower.
    peak, bursting = [0], threading.Event()

    def sample() -> None:
        while not bursting.is_set():
            peak[0] = max(peak[0], daemon.status()["daemon"]["buffers"])
            bursting.wait(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        with concurrent.futures.ThreadPoolExecutor(BURST_CALLS) as pool:
            assert all(pool.map(one_call, range(BURST_CALLS)))
    finally:
        bursting.set()
        sampler.join(30)
    burst_rss = rss_bytes(row["pid"])
    burst_buffers = max(peak[0], daemon.status()["daemon"]["buffers"])
    if burst_buffers <= 4:  # the calls did not overlap: nothing beyond what an idle gateway keeps
        pytest.skip(f"the burst held at most {burst_buffers} buffers at once: its calls ran "
                    "one or two at a time, and there was nothing to give back")
    settled = poll_until(lambda: (rss_bytes(row["pid"]), daemon.status()["daemon"]["buffers"])
                         if rss_bytes(row["pid"]) < 2 * start_rss
                         and daemon.status()["daemon"]["buffers"] <= 4 else None,
                         timeout=30, message="the gateway's buffers given back")
    print(f"gateway RSS {start_rss / 2**20:.0f} MiB at start, {burst_rss / 2**20:.0f} MiB after "
          f"the burst ({burst_buffers} buffers), {settled[0] / 2**20:.0f} MiB idle "
          f"({settled[1]} buffers)")
    assert gateway_row(daemon)["pid"] == row["pid"]


REPLY_ROWS = 32 * 1024  # a: 1 MiB, so y: 1 MiB


def test_the_gateways_connection_is_held_to_the_daemons_reply_cap_alone(tmp_path):
    """Four 1 MiB replies, batched together, go to the gateway's one connection back to back,
    past a per-connection cap of 64 KiB (inline: shared memory is off). The gateway answers
    many callers over that connection and bounds each of them itself, so the daemon holds it to
    its daemon-wide cap alone: every call is served. A client of the same user is not the
    gateway, and keeps the connection's cap (tests/test_abuse.py)."""
    gate = tmp_path / "gate"
    model = {"name": "pair", "source": "python:tests.faulty:make_pair",
             "kwargs": {"gate": str(gate)}, "workers": 1, "cores_per_worker": 1, "threads": 1,
             "warmup": 0, "probe": {"interval": 0}, "batching": {"max_size": 8},
             "inputs": [{"name": "a", "dtype": "float32", "shape": [-1, 8]},
                        {"name": "b", "dtype": "float32", "shape": [-1, 1]}]}
    calls = 4
    with gateway_daemon([model], shm=False, max_unread_bytes_per_connection=64 * 1024) as instance:
        instance.wait_ready()
        row = gateway_row(instance)
        rng = np.random.default_rng(7)
        arrays = [{"a": rng.standard_normal((REPLY_ROWS, 8), dtype=np.float32),
                   "b": rng.standard_normal((REPLY_ROWS, 1), dtype=np.float32)}
                  for _ in range(calls)]

        def one_call(arrays: dict) -> np.ndarray:
            client = grpcclient.InferenceServerClient(row["grpc"])
            try:
                result = infer(client, grpcclient, "pair", arrays, {"a": "FP32", "b": "FP32"})
                return result.as_numpy("output__0")
            finally:
                client.close()

        held = torch.zeros(1, 8)
        held[0, 0] = GATE
        with Client(instance.endpoint, timeout=60) as client:
            with Gate(instance, client, "pair", (held, torch.zeros(1, 1)), gate) as waiting:
                with concurrent.futures.ThreadPoolExecutor(calls) as pool:
                    futures = [pool.submit(one_call, each) for each in arrays]
                    waiting.queue(calls)
                    waiting.path.unlink()  # one batch of four, answered back to back
                    results = [future.result(60) for future in futures]
        for arrays_in, got in zip(arrays, results):
            expected = pair_reference(torch.from_numpy(arrays_in["a"]),
                                      torch.from_numpy(arrays_in["b"]))[0]
            assert torch.allclose(torch.from_numpy(got), expected, atol=1e-4)
        batching = instance.status()["models"][0]["batching"]
        assert batching["batches"] < batching["requests"], batching  # the four came as one
        assert "not reading its replies" not in instance.log()
