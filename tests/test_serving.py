"""End to end: the real daemon, real spawn-mode workers, real ZeroMQ sockets.

One daemon serves three models, one per source kind; a second one (below) has a model that
cannot load."""

import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
import zmq

from examples.models import make_mlp
from modelwarden.shared import protocol
from modelwarden.client.client import BadInput, BadRequest, Client, UnknownModel
from modelwarden.shared.cpulist import format_cores
from modelwarden.shared.errors import NoDaemon
from tests.helpers import (ROOT, Daemon, alive, cmdline, cpus_allowed, header_frame,
                           join_within, mlp_model, poll_until, raw_request)

REFERENCE = make_mlp(hidden=32).requires_grad_(False)


def export_models(directory):
    linear = torch.nn.Linear(64, 5)
    torch.manual_seed(0)
    torch.nn.init.normal_(linear.weight)
    torch.jit.script(linear).save(str(directory / "linear.ts"))
    batch = torch.export.Dim("batch")
    program = torch.export.export(linear, (torch.randn(2, 64),), dynamic_shapes={"input": {0: batch}})
    torch.export.save(program, str(directory / "linear.pt2"))
    return linear


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    directory = tmp_path_factory.mktemp("models")
    linear = export_models(directory)
    spec = [{"name": "x", "dtype": "float32", "shape": [-1, 64]}]
    models = [
        mlp_model(),
        {"name": "ts", "source": f"torchscript:{directory / 'linear.ts'}", "workers": 1,
         "warmup": 2, "inputs": spec},
        {"name": "ex", "source": f"export:{directory / 'linear.pt2'}", "workers": 1,
         "warmup": 2, "inputs": spec},
    ]
    with Daemon(models) as running:
        running.wait_ready()
        running.linear = linear
        yield running


def test_concurrent_clients_get_the_models_answers_from_both_workers(daemon):
    errors = []

    def client_thread(seed):
        generator = torch.Generator().manual_seed(seed)
        try:
            with Client(daemon.endpoint) as client:
                for _ in range(100):
                    x = torch.randn(int(torch.randint(1, 9, (1,), generator=generator)), 64,
                                    generator=generator)
                    torch.testing.assert_close(client.infer("mlp", x), REFERENCE(x))
        except Exception as exc:  # reported below: a thread cannot fail the test by itself
            errors.append(exc)

    before = {w["id"]: w["requests"] for w in daemon.workers("mlp")}
    threads = [threading.Thread(target=client_thread, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        join_within(thread)
    assert not errors, errors
    served = {w["id"]: w["requests"] - before[w["id"]] for w in daemon.workers("mlp")}
    assert sum(served.values()) == 400
    assert all(count > 0 for count in served.values()), served


def test_one_client_shared_by_threads_and_futures(daemon):
    inputs = [torch.randn(3, 64) for _ in range(40)]
    with Client(daemon.endpoint) as client:
        futures = [client.submit("mlp", x) for x in inputs]
        results = [future.result(timeout=30) for future in futures]
        threaded = [None] * len(inputs)

        def call(index):
            threaded[index] = client.infer("mlp", inputs[index])

        threads = [threading.Thread(target=call, args=(i,)) for i in range(len(inputs))]
        for thread in threads:
            thread.start()
        for thread in threads:
            join_within(thread)
    for x, y, z in zip(inputs, results, threaded):
        torch.testing.assert_close(y, REFERENCE(x))
        torch.testing.assert_close(z, REFERENCE(x))


def test_async_client(daemon):
    import asyncio

    from modelwarden.client.client import AsyncClient

    async def main():
        async with AsyncClient(daemon.endpoint) as client:
            inputs = [torch.randn(2, 64) for _ in range(20)]
            outputs = await asyncio.gather(*(client.infer("mlp", x) for x in inputs))
            return inputs, outputs

    inputs, outputs = asyncio.run(main())
    for x, y in zip(inputs, outputs):
        torch.testing.assert_close(y, REFERENCE(x))


def test_async_client_keeps_64_in_flight_from_one_loop_then_another(daemon):
    """Replies resolve their requests from the loop's reader callback. ZeroMQ's descriptor is
    edge-triggered: a reply whose edge a send consumed would wait until the client's timer
    (3 s here, and the test fails with Timeout). A client used from a second loop
    (``asyncio.run`` again) moves its reader there."""
    import asyncio

    from modelwarden.client.client import AsyncClient

    inputs = [torch.randn(1, 64) for _ in range(64)]

    async def rounds(client):
        outputs = []
        for _ in range(15):
            outputs = await asyncio.gather(*(client.infer("mlp", x, timeout=2) for x in inputs))
        return outputs

    client = AsyncClient(daemon.endpoint)
    try:
        for _ in range(2):  # each asyncio.run is a new event loop
            for x, y in zip(inputs, asyncio.run(rounds(client))):
                torch.testing.assert_close(y, REFERENCE(x))
    finally:
        asyncio.run(client.close())


def test_async_client_gives_up_on_a_silent_daemon_and_close_ends_what_still_waits():
    import asyncio
    import signal
    import time

    from modelwarden.client.client import GRACE_S, AsyncClient, Timeout

    with Daemon([mlp_model()]) as daemon:
        daemon.wait_ready()
        x = torch.randn(2, 64)

        async def main():
            client = AsyncClient(daemon.endpoint)
            await client.hello()
            daemon.process.send_signal(signal.SIGSTOP)
            try:
                # A long deadline first: the client's one timer is armed for it, and a shorter
                # one sent after it must take the timer over.
                held = asyncio.ensure_future(client.infer("mlp", x, timeout=60))
                while not client._waiting:  # sent, and waiting for its reply
                    await asyncio.sleep(0)
                started = time.monotonic()
                with pytest.raises(Timeout):
                    await asyncio.wait_for(client.infer("mlp", x, timeout=0.5), 10)
                assert 0.5 + GRACE_S <= time.monotonic() - started < 10
                assert not held.done()
                await client.close()
                with pytest.raises(RuntimeError, match="the client is closed"):
                    await asyncio.wait_for(held, 5)
                with pytest.raises(RuntimeError, match="the client is closed"):
                    await client.infer("mlp", x)
            finally:
                daemon.process.send_signal(signal.SIGCONT)

        asyncio.run(main())


def test_an_async_clients_answered_requests_leave_no_deadline_entries_behind(daemon):
    """AsyncClient keeps its requests' deadlines under one timer (client/client.py,
    ``_Deadlines``): what answered requests leave behind is swept, so the entries stay within
    twice the pending requests plus a constant, however many requests went before."""
    import asyncio

    from modelwarden.client.client import AsyncClient, _Deadlines

    x = torch.randn(1, 64)

    async def main():
        async with AsyncClient(daemon.endpoint) as client:
            for _ in range(50):
                await asyncio.gather(*(client.infer("mlp", x) for _ in range(64)))
            return len(client._deadlines.heap)

    assert asyncio.run(main()) <= 2 * 64 + _Deadlines.SLACK


def test_each_source_kind_loads_and_serves(daemon):
    x = torch.randn(4, 64)
    with Client(daemon.endpoint) as client:
        torch.testing.assert_close(client.infer("ts", x), daemon.linear(x))
        torch.testing.assert_close(client.infer("ex", x), daemon.linear(x))
        torch.testing.assert_close(client.infer("mlp", x), REFERENCE(x))


def test_numpy_in_numpy_out(daemon):
    x = np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32)
    with Client(daemon.endpoint) as client:
        y = client.infer("mlp", x)
    assert isinstance(y, np.ndarray)
    np.testing.assert_allclose(y, REFERENCE(torch.from_numpy(x)).numpy(), rtol=1e-5, atol=1e-6)


def test_workers_are_pinned_to_disjoint_cores_with_their_thread_count(daemon):
    status = daemon.status()
    workers = [w for w in status["workers"] if w["model"] == "mlp"]
    sets = []
    for worker in workers:
        assert cpus_allowed(worker["pid"]) == format_cores(worker["cores"])
        assert worker["threads"] == 1 and worker["interop_threads"] == 1
        sets.append(set(worker["cores"]))
    assert not sets[0] & sets[1], sets
    assert "modelwarden: worker mlp#0 cpu[" in cmdline(workers[0]["pid"])
    assert "modelwarden: supervisor" in cmdline(daemon.process.pid)


def test_the_supervisor_never_loads_torch(daemon):
    # torch lives in the workers only: the supervisor stays small, starts fast and never runs a
    # CUDA initialiser (the client API in modelwarden/__init__ is imported lazily for this).
    with open(f"/proc/{daemon.process.pid}/maps") as maps:
        mapped = maps.read()
    assert "libtorch" not in mapped and "libc10" not in mapped
    worker = daemon.worker_pids()[0]
    with open(f"/proc/{worker}/maps") as maps:
        assert "libtorch" in maps.read()  # the check above can see torch where it is


def test_status_json_shape_and_exit_code(daemon):
    result = subprocess.run([sys.executable, "-m", "modelwarden", "status", "--json",
                             "--control", daemon.control], capture_output=True, text=True,
                            cwd=ROOT, timeout=30)
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    assert set(status) == {"daemon", "models", "workers"}
    assert {"pid", "version", "uptime_s", "endpoints"} <= set(status["daemon"])
    expected = {"id", "model", "state", "pid", "device", "cores", "threads", "uptime_s",
                "requests", "errors", "restarts", "last_exit", "rss_bytes", "latency_p50_us"}
    for worker in status["workers"]:
        assert expected <= set(worker), expected - set(worker)
        assert worker["state"] == "READY" and worker["rss_bytes"] > 0
    table = subprocess.run([sys.executable, "-m", "modelwarden", "status", "--control",
                            daemon.control], capture_output=True, text=True, cwd=ROOT, timeout=30)
    assert table.returncode == 0 and "mlp#1" in table.stdout and "READY" in table.stdout


def test_infer_command(daemon, tmp_path):
    x = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    result = subprocess.run([sys.executable, "-m", "modelwarden", "infer", "mlp", "--input",
                             str(tmp_path / "x.npy"), "--output", str(tmp_path / "y.npy"),
                             "--endpoint", daemon.endpoint], capture_output=True, text=True,
                            cwd=ROOT, timeout=60)
    assert result.returncode == 0, result.stderr
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"),
                               REFERENCE(torch.from_numpy(x)).numpy(), rtol=1e-5, atol=1e-6)


def frames_for(header, *payload):
    return [protocol.SIGNATURE, header_frame(header), *payload]


def infer_header(**overrides):
    header = {"type": "infer", "id": 1, "model": "mlp", "inputs": 0,
              "tensors": [{"dtype": "float32", "shape": [1, 64], "frame": 0}]}
    header.update(overrides)
    return header


BAD_MESSAGES = {
    "garbage frames": ([b"\xff\x00garbage", b"more"], protocol.BAD_REQUEST),
    "bad signature": ([b"XXXX", b"\x80"], protocol.BAD_REQUEST),
    "header not msgpack": ([protocol.SIGNATURE, b"\xc1\xc1"], protocol.BAD_REQUEST),
    "header not a map": ([protocol.SIGNATURE, header_frame([1, 2])], protocol.BAD_REQUEST),
    "unknown type": (frames_for({"type": "nope", "id": 3}), protocol.BAD_REQUEST),
    "unknown model": (frames_for(infer_header(model="nosuch"), bytes(256)), protocol.UNKNOWN_MODEL),
    "missing frame": (frames_for(infer_header()), protocol.BAD_REQUEST),
    "extra frame": (frames_for(infer_header(), bytes(256), bytes(4)), protocol.BAD_REQUEST),
    "frame length disagrees": (frames_for(infer_header(), bytes(255)), protocol.BAD_REQUEST),
    "unknown dtype": (frames_for(infer_header(tensors=[{"dtype": "float8", "shape": [1],
                                                       "frame": 0}]), bytes(1)), protocol.BAD_REQUEST),
    "negative dim": (frames_for(infer_header(tensors=[{"dtype": "float32", "shape": [-1, 64],
                                                      "frame": 0}]), bytes(256)), protocol.BAD_REQUEST),
    "huge dims": (frames_for(infer_header(tensors=[{"dtype": "float32", "shape": [2**62, 2**62],
                                                   "frame": 0}]), bytes(4)), protocol.BAD_REQUEST),
    "zero-size with huge dims": (frames_for(infer_header(tensors=[{"dtype": "float32", "shape": [0, 2**48, 2**48],
                                                              "frame": 0}]), b""), protocol.BAD_REQUEST),
    "bin map keys": (frames_for({b"type": "infer", "id": 1, "model": "mlp", "inputs": 0,
                                 "tensors": [{"dtype": "float32", "shape": [1, 64], "frame": 0}]},
                                bytes(256)), protocol.BAD_REQUEST),
    "duplicate map keys": ([protocol.SIGNATURE, b"\x86" + b"".join(protocol.pack(item) for item in (
        "type", "infer", "id", 1, "model", "nosuch", "inputs", 0, "model", "mlp",
        "tensors", [{"dtype": "float32", "shape": [1, 64], "frame": 0}])), bytes(256)], protocol.BAD_REQUEST),
    "tree reuses a tensor": (frames_for(infer_header(inputs=[0, 0]), bytes(256)), protocol.BAD_REQUEST),
    "bool id": (frames_for(infer_header(id=True), bytes(256)), protocol.BAD_REQUEST),
    "wrong declared shape": (frames_for(infer_header(tensors=[{"dtype": "float32", "shape": [1, 63],
                                                              "frame": 0}]), bytes(252)), protocol.BAD_INPUT),
    "wrong declared dtype": (frames_for(infer_header(tensors=[{"dtype": "float64", "shape": [1, 64],
                                                              "frame": 0}]), bytes(512)), protocol.BAD_INPUT),
}


@pytest.mark.parametrize("case", sorted(BAD_MESSAGES))
def test_malformed_messages_get_typed_errors_and_the_daemon_serves_on(daemon, case):
    frames, code = BAD_MESSAGES[case]
    reply = raw_request(daemon.endpoint, frames)
    assert reply["ok"] is False
    assert reply["error"]["code"] == code, reply
    x = torch.randn(1, 64)
    with Client(daemon.endpoint) as client:
        torch.testing.assert_close(client.infer("mlp", x), REFERENCE(x))


def test_req_socket_clients_work_too(daemon):
    context = zmq.Context.instance()
    sock = context.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(daemon.endpoint)
    x = torch.randn(1, 64)
    sock.send_multipart(frames_for(infer_header(id="req-1"), x.numpy().tobytes()))
    assert sock.poll(10_000)
    reply = sock.recv_multipart()
    header = protocol.unpack_header(reply[1])
    assert header["id"] == "req-1" and header["ok"], header
    y = torch.from_numpy(np.frombuffer(reply[2], dtype=np.float32).reshape(1, 10).copy())
    torch.testing.assert_close(y, REFERENCE(x))
    sock.close()


def test_client_errors_are_typed(daemon):
    with Client(daemon.endpoint) as client:
        with pytest.raises(UnknownModel) as info:
            client.infer("nosuch", torch.randn(1, 64))
        assert info.value.code == "UNKNOWN_MODEL"
        with pytest.raises(BadInput):
            client.infer("mlp", torch.randn(1, 32))
        with pytest.raises(BadInput):
            client.infer("mlp", {"y": torch.randn(1, 64)})
        with pytest.raises(TypeError):
            client.infer("mlp", object())
        with pytest.raises(BadInput, match="dtype str, model takes float32"):
            client.infer("mlp", "a str travels, as a str")  # docs/PROTOCOL.md 5.8
        with pytest.raises(BadRequest) as info:  # the daemon's own verdict, carried by the type
            client.infer("mlp", torch.zeros(0, 2**25, 2**25, dtype=torch.uint8))
        assert info.value.code == "BAD_REQUEST" and "exceeds" in info.value.message


def test_sigkill_of_a_worker_is_replaced_on_the_same_cores(daemon):
    victim = daemon.workers("mlp")[0]
    os.kill(victim["pid"], 9)

    def replaced():
        worker = next(w for w in daemon.workers("mlp") if w["id"] == victim["id"])
        return worker if worker["state"] == "READY" and worker["pid"] != victim["pid"] else None

    worker = poll_until(replaced, 60, message="a new READY worker")
    assert worker["cores"] == victim["cores"]
    assert cpus_allowed(worker["pid"]) == format_cores(victim["cores"])
    assert worker["restarts"] == victim["restarts"] + 1
    assert worker["last_exit"] == "SIGKILL"
    x = torch.randn(2, 64)
    with Client(daemon.endpoint) as client:
        torch.testing.assert_close(client.infer("mlp", x), REFERENCE(x))


def test_sigterm_stops_every_worker_and_exits_zero(tmp_path):
    import socket as pysocket

    notify_path = str(tmp_path / "notify.sock")
    notify = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_DGRAM)
    notify.bind(notify_path)
    notify.settimeout(60)
    with Daemon([mlp_model()], env={"NOTIFY_SOCKET": notify_path}) as running:
        running.wait_ready()
        messages = [notify.recv(4096).decode()]
        while "READY=1" not in messages[-1]:  # STATUS= lines come first, while workers load
            messages.append(notify.recv(4096).decode())
        assert f"MAINPID={running.process.pid}" in messages[-1]
        pids = running.worker_pids()
        assert running.stop() == 0
        for pid in pids:
            poll_until(lambda: not alive(pid), 10, message=f"worker {pid} gone")
        unreachable = subprocess.run([sys.executable, "-m", "modelwarden", "status", "--control",
                                      running.control, "--timeout", "1"], capture_output=True,
                                     text=True, cwd=ROOT, timeout=30)
        assert unreachable.returncode == 3, unreachable.stderr
        notify.settimeout(0.5)
        try:
            while True:
                messages.append(notify.recv(4096).decode())
        except TimeoutError:
            pass
    notify.close()
    assert any("STATUS=2/2 workers ready" in message for message in messages), messages
    assert any("STOPPING=1" in message for message in messages), messages


def test_a_second_daemon_on_the_same_runtime_dir_refuses_to_start(daemon):
    result = subprocess.run([sys.executable, "-m", "modelwarden", "serve", "--config",
                             str(daemon.config_path)], capture_output=True, text=True, cwd=ROOT,
                            timeout=60)
    assert result.returncode == 1
    assert f"another modelwarden daemon (pid {daemon.process.pid})" in result.stderr
    x = torch.randn(2, 64)
    with Client(daemon.endpoint) as client:  # the first one still owns its sockets
        torch.testing.assert_close(client.infer("mlp", x), REFERENCE(x))


def test_a_client_without_a_daemon_says_so(tmp_path):
    with Client(f"ipc://{tmp_path}/nothing.sock", timeout=0.5) as client:
        with pytest.raises(NoDaemon, match="no daemon listening at"):
            client.infer("mlp", torch.randn(1, 64))


def test_a_threads_socket_goes_with_the_thread(daemon):
    import gc

    with Client(daemon.endpoint) as client:
        def use():
            client.infer("mlp", torch.randn(1, 64))

        for _ in range(5):
            thread = threading.Thread(target=use)
            thread.start()
            join_within(thread)
        gc.collect()
        assert len(client._connections) == 0  # five threads came and went: no socket left


def test_submit_then_close_resolves_every_future(daemon):
    client = Client(daemon.endpoint)
    inputs = [torch.randn(2, 64) for _ in range(50)]
    futures = [client.submit("mlp", x) for x in inputs]
    client.close()
    assert all(future.done() for future in futures)  # close() resolved every one, none left waiting
    for x, future in zip(inputs, futures):  # each is a right answer or says the client closed
        error = future.exception(timeout=0)
        if error is None:
            torch.testing.assert_close(future.result(timeout=0), REFERENCE(x))
        else:
            assert isinstance(error, RuntimeError) and "closed" in str(error), error
