"""Serving benchmark: modelwarden under closed-loop load, against in-process schemes and the model
servers users would pick instead (issue 9), in one run on this machine.

    make bench-serving                      # = .venv/bin/python bench/serving.py
    python bench/serving.py [--quick] [--only SYSTEMS] [--workloads W1,W2,W3]
                            [--concurrency 1,8,64] [--no-peers] [--json PATH]

Workloads (bench/models.py; the same weights everywhere):
  W1  small: MLP 64 -> 256 -> 10, float32 input [1, 64]
  W2  busy:  a chain of 512 x 512 layers whose depth is calibrated at start-up so that one
             in-process forward (batch 1, one thread) takes ~4 ms; the measured p50 is reported
  W3  big:   identity on a 4 MiB float32 tensor [1, 1024, 1024] (shared memory for modelwarden)

Systems (--only takes these names, comma-separated):
  modelwarden  the daemon over ipc:// (ZeroMQ), 2 workers x 1 thread: batching off, and on with
               max_size 16 and max_delay_us 0 and 1000 (skipped, saying why, when the installed
               modelwarden has no [models.batching]); plus one worker, batching off, on W2.
               Client: modelwarden.Client at 1 in flight, AsyncClient with N tasks above.
               Each 2-worker point is measured again on the same daemon's local frontend
               (unix://, what a client on the daemon's host takes by default): the rows of
               "modelwarden-local".
  gateway      the daemon's KServe v2 gateway ([gateway], issue 11), same 2 workers x 1 thread,
               batching off and on (max 16, delay 1000us), on W1 and W3: REST JSON (W1 only: a
               4 MiB tensor as JSON numbers is not a use), REST binary (the binary tensor data
               extension, what tritonclient's HTTP client sends; one http.client keep-alive
               connection per thread, N threads), gRPC (tritonclient.grpc at 1 in flight,
               tritonclient.grpc.aio with N tasks on one loop above; the gateway-test extra),
               gRPC through Triton's perf_analyzer (its C++ client; skipped, saying why, where
               its binary cannot load) and, on W1, an empty gRPC call (ServerLive, answered by
               the gateway alone): the floor of any gRPC request; and perf_analyzer against
               bench/grpc_floor.cc, Google's C++ gRPC server answering with the gateway's own
               canned answers (built under bench/.build where g++ and libgrpc++-dev are; skipped,
               saying why, elsewhere): the floor of a gateway whose gRPC front were compiled.
               Skipped, saying why, without the extras.
  inprocess    the background article's alternatives in this process, N client threads: one
               shared model behind a lock, and a queue served by one worker thread (W1, W2).
  mosec, litserve, ray, pytriton
               peers, each installed by this script into its own virtualenv under
               bench/.peers/NAME (torch==2.13.0 CPU, never a dependency of the project), server
               script bench/peers/NAME_server.py, 2 workers/replicas x 1 thread, batching off
               and on (max 16, wait 1 ms; W1 and W2), loaded over HTTP/1.1 keep-alive by httpx,
               one thread and connection per request in flight (bench/peers/httpload.py),
               running in the peer's virtualenv.

Every point is a closed loop at 1, 8 and 64 requests in flight (--concurrency): a warm-up, then a
fixed measuring window (1 s + 4 s; --quick: 0.3 s + 1.2 s). Per point: requests/s, p50, p99,
errors (a sample of answers is compared with the in-process model: a mismatch is an error) and,
for modelwarden, the supervisor's CPU time (utime + stime from /proc/PID/stat) per request, and
how much of it was the kernel's (stime: system calls, which instruction counts do not see).
With W1 at 64 in flight, the same run measures the floor: a C zmq.proxy broker's CPU per 1 KiB
request at 1 and 8 in flight (bench/payloads.py), for issue 24's ratios of the supervisor's.
After the table: each target of issues 9 and 24 as a ratio of numbers measured in this run,
PASS/MISS.
Everything is also written as JSON (default bench/results/serving.json).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import http.client
import json
import multiprocessing
import os
import queue
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.loadgen import Window, run_async, run_threads  # noqa: E402
from bench.models import BUSY_WIDTH, FACTORIES  # noqa: E402
from bench.machine import command, machine  # noqa: E402
from bench.payloads import bench_proxy_cpu, cpu_times  # noqa: E402

PEERS_DIR = ROOT / "bench" / ".peers"
TORCH = "torch==2.13.0"  # unpinned, pip pulls a multi-GB CUDA build
BUSY_TARGET_MS = 4.0
BATCH_MAX = 16
PEER_WAIT_MS = 1
SAMPLE_INPUTS = 8
SYSTEMS = ("modelwarden", "gateway", "inprocess", "mosec", "litserve", "ray", "pytriton")
LOCAL_SYSTEM = "modelwarden-local"  # the rows of modelwarden's points on its local frontend
LOCAL_WITHIN = 1.1  # unix:// over ipc://, at most: the same loop, another framing


# -- workloads --------------------------------------------------------------------------------


@dataclass
class Workload:
    name: str
    title: str
    kind: str
    kwargs: dict
    input_shape: list[int]
    batchable: bool  # peers and in-process schemes run it with batching on too
    model: torch.nn.Module | None = None
    inputs: list[torch.Tensor] = field(default_factory=list)
    expected: list[torch.Tensor] = field(default_factory=list)
    forward_p50_ms: float | None = None
    batch_p50_ms: float | None = None  # one forward of BATCH_MAX requests


def make_workloads(names: list[str]) -> dict[str, Workload]:
    catalogue = {
        "W1": Workload("W1", "MLP 64->256->10, [1,64]", "mlp", {}, [1, 64], True),
        "W2": Workload("W2", "busy matmul chain, [1,512]", "busy", {}, [1, 512], True),
        "W3": Workload("W3", "identity, 4 MiB", "identity", {}, [1, 1024, 1024], False),
    }
    workloads = {name: catalogue[name] for name in names}
    torch.set_num_threads(1)
    if "W2" in workloads:
        workloads["W2"].kwargs = {"depth": calibrate_busy_depth()}
    for workload in workloads.values():
        prepare(workload)
    return workloads


def forward_p50_ms(model, x: torch.Tensor, seconds: float = 0.5) -> float:
    samples = []
    with torch.inference_mode():
        model(x)
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline or len(samples) < 5:
            started = time.perf_counter()
            model(x)
            samples.append(time.perf_counter() - started)
    return statistics.median(samples) * 1000


def calibrate_busy_depth(rounds: int = 4) -> int:
    """The depth whose batch-1 forward on one thread takes ~BUSY_TARGET_MS on this machine.
    Rescaled a few times: the time per layer grows once the weights no longer fit in cache."""
    x, depth = torch.randn(1, BUSY_WIDTH), 16
    for _ in range(rounds):
        took = forward_p50_ms(FACTORIES["busy"](depth=depth), x, seconds=0.3)
        if abs(took - BUSY_TARGET_MS) < 0.1 * BUSY_TARGET_MS:
            break
        depth = max(1, round(depth * BUSY_TARGET_MS / took))
    return depth


def prepare(workload: Workload) -> None:
    generator = torch.Generator().manual_seed(1)
    workload.model = FACTORIES[workload.kind](**workload.kwargs)
    workload.inputs = [torch.randn(workload.input_shape, generator=generator)
                       for _ in range(SAMPLE_INPUTS)]
    with torch.inference_mode():
        workload.expected = [workload.model(x).clone() for x in workload.inputs]
    workload.forward_p50_ms = round(forward_p50_ms(workload.model, workload.inputs[0]), 3)
    if workload.batchable:
        batch = torch.cat([workload.inputs[n % SAMPLE_INPUTS] for n in range(BATCH_MAX)])
        workload.batch_p50_ms = round(forward_p50_ms(workload.model, batch), 3)


def matches(workload: Workload, index: int, output) -> bool:
    return torch.allclose(output, workload.expected[index], atol=1e-5, rtol=1e-4)


# -- points -----------------------------------------------------------------------------------


@dataclass
class Timing:
    warmup_s: float
    duration_s: float


def point(system: str, transport: str, config: str, workload: Workload, concurrency: int,
          result: dict, **extra) -> dict:
    row = {"system": system, "transport": transport, "config": config,
           "workload": workload.name, "concurrency": concurrency, **result, **extra}
    print(f"  {workload.name} @{concurrency:<3d} {system:12s} {config:22s} "
          f"{row.get('rps') or 0:9.1f} req/s  p50 {fmt_ms(row.get('p50_ms'))}  "
          f"p99 {fmt_ms(row.get('p99_ms'))}  errors {row.get('errors')}", flush=True)
    if row.get("first_error"):
        print(f"      first error: {row['first_error']}", flush=True)
    return row


def fmt_ms(value) -> str:
    return f"{value:8.2f}ms" if value is not None else "       -  "


# -- in-process alternatives ------------------------------------------------------------------


def bench_inprocess(workloads: dict[str, Workload], levels: list[int], timing: Timing) -> list[dict]:
    """The background article's schemes, with torch on every core (what one process gets)."""
    rows = []
    torch.set_num_threads(os.cpu_count() or 1)
    threads = torch.get_num_threads()
    try:
        for workload in workloads.values():
            if not workload.batchable:
                continue  # an in-process identity moves no bytes: nothing to compare
            for concurrency in levels:
                for scheme, call, stop in (locked(workload), queued(workload)):
                    window = Window(timing.warmup_s, timing.duration_s)
                    result = run_threads(call, concurrency, window, SAMPLE_INPUTS,
                                         lambda i, y, w=workload: matches(w, i, y))
                    stop()
                    rows.append(point("in-process", "threads", f"{scheme}, {threads} threads",
                                      workload, concurrency, result))
    finally:
        torch.set_num_threads(1)
    return rows


def locked(workload: Workload):
    lock = threading.Lock()

    def call(index: int):
        with lock, torch.inference_mode():
            return workload.model(workload.inputs[index])

    return "lock", call, lambda: None


def queued(workload: Workload):
    inbox: queue.Queue = queue.Queue()

    def serve() -> None:
        with torch.inference_mode():
            while (item := inbox.get()) is not None:
                index, future = item
                future.set_result(workload.model(workload.inputs[index]))

    worker = threading.Thread(target=serve, daemon=True)
    worker.start()

    def call(index: int):
        future: Future = Future()
        inbox.put((index, future))
        return future.result()

    def stop() -> None:
        inbox.put(None)
        worker.join()

    return "queue, 1 worker", call, stop


# -- modelwarden ------------------------------------------------------------------------------


def batching_supported() -> bool:
    from modelwarden.shared.config import ModelConfig

    return "batching" in ModelConfig.model_fields


def mw_configs() -> list[tuple[str, dict | None]]:
    """(label, [models.batching] table or None)."""
    return [("batching off", None),
            ("batch 16, delay 0us", {"max_size": BATCH_MAX, "max_delay_us": 0}),
            ("batch 16, delay 1000us", {"max_size": BATCH_MAX, "max_delay_us": 1000})]


def mw_config_text(runtime: Path, workloads: dict[str, Workload], batching: dict | None) -> str:
    lines = ["[daemon]", f'runtime_dir = "{runtime}"', "heartbeat_interval = 1.0",
             'log_level = "WARNING"', "allow_oversubscription = true",
             f'python_path = ["{ROOT}"]', ""]
    models = [(workload.name.lower(), workload, 2) for workload in workloads.values()]
    if batching is None and "W2" in workloads:
        models.append(("w2_one", workloads["W2"], 1))
    for name, workload, workers in models:
        kwargs = ", ".join(f"{key} = {value}" for key, value in workload.kwargs.items())
        lines += ["[[models]]", f'name = "{name}"',
                  f'source = "python:bench.models:make_{workload.kind}"',
                  f"kwargs = {{ {kwargs} }}", f"workers = {workers}", "threads = 1",
                  "cores_per_worker = 1", "warmup = 0", "max_queue = 4096", "[models.probe]",
                  "interval = 0.0"]
        if batching is not None:
            lines += ["[models.batching]"] + [f"{key} = {value}" for key, value in batching.items()]
        lines.append("")
    return "\n".join(lines)


def with_local_frontend(text: str, runtime: Path) -> tuple[str, str]:
    """``text`` (mw_config_text's, for ``runtime``) also serving the local frontend, and that
    frontend's ``unix://`` endpoint (supervisor/routing/localfront.py: no ZeroMQ between the
    client and the supervisor's loop)."""
    unix = f"unix://{runtime}/local.sock"
    return text.replace("[daemon]\n", f'[daemon]\nfrontend = ["ipc://{runtime}/frontend.sock", '
                        f'"{unix}"]\n', 1), unix


# ``python -c`` this, then the daemon's arguments: the daemon, its workers spawned with the
# executable argv[1] names (multiprocessing.set_executable) instead of this interpreter.
SPAWN_WITH = ("import multiprocessing, runpy, sys; multiprocessing.set_executable(sys.argv.pop(1)); "
              "runpy.run_module('modelwarden', run_name='__main__', alter_sys=True)")


def start_daemon(workdir: Path, label: str, text: str, models: dict[str, Workload],
                 wrapper: tuple[str, ...] = (), tree: Path = ROOT, ready_s: float = 120,
                 spawn_with: Path | None = None):
    """The daemon of config ``text``, once it serves every model; (process, endpoint).
    ``wrapper`` runs it under another command (bench/instructions.py: valgrind), from the
    checkout ``tree`` (its modules first on PYTHONPATH); ``spawn_with``, an executable its
    workers are spawned with in place of the interpreter (bench/instructions.py: a script that
    runs the interpreter under valgrind)."""
    from modelwarden.client.client import Client

    slug = label.replace(" ", "_").replace(",", "")
    config = workdir / f"{slug}.toml"
    config.write_text(text)
    log = open(workdir / f"{slug}.log", "wb")
    main = ["-m", "modelwarden"] if spawn_with is None else ["-c", SPAWN_WITH, str(spawn_with)]
    daemon = subprocess.Popen([*wrapper, sys.executable, *main, "serve", "--config",
                               str(config)], cwd=tree, stdout=log, stderr=subprocess.STDOUT,
                              env={**os.environ, "PYTHONPATH": str(tree)} if tree != ROOT else None)
    endpoint = f"ipc://{workdir}/run/frontend.sock"
    deadline = time.monotonic() + ready_s
    with Client(endpoint, timeout=2) as client:
        for name, workload in models.items():
            while True:
                try:
                    client.infer(name, workload.inputs[0], timeout=5)
                    break
                except Exception as exc:
                    if time.monotonic() > deadline or daemon.poll() is not None:
                        stop_process(daemon)
                        tail = (workdir / f"{slug}.log").read_text(errors="replace")[-2000:]
                        raise RuntimeError(f"the daemon ({label}) did not serve {name}: {exc!r}\n{tail}")
    return daemon, endpoint


def stop_process(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def bench_modelwarden(workdir: Path, workloads: dict[str, Workload], levels: list[int],
                      timing: Timing, notes: list[str]) -> list[dict]:
    rows = []
    configs = mw_configs()
    if not batching_supported():
        notes.append("modelwarden batching on: skipped, the installed modelwarden has no "
                     "[models.batching] (ModelConfig.batching)")
        print(f"note: {notes[-1]}", flush=True)
        configs = configs[:1]
    for label, batching in configs:
        models = {workload.name.lower(): workload for workload in workloads.values()}
        if batching is None and "W2" in workloads:
            models["w2_one"] = workloads["W2"]
        text, local = with_local_frontend(mw_config_text(workdir / "run", workloads, batching),
                                          workdir / "run")
        daemon, endpoint = start_daemon(workdir, label, text, models)
        try:
            for name, workload in models.items():
                one = name == "w2_one"
                for concurrency in levels:
                    result = mw_point(endpoint, name, workload, concurrency, timing, daemon.pid)
                    rows.append(point("modelwarden", "ZeroMQ ipc", label + (", 1 worker" if one else ""),
                                      workload, concurrency, result, workers=1 if one else 2,
                                      batching=batching))
                    if not one:
                        result = mw_point(local, name, workload, concurrency, timing, daemon.pid)
                        rows.append(point(LOCAL_SYSTEM, "unix (local frontend)", label, workload,
                                          concurrency, result, workers=2, batching=batching))
        finally:
            stop_process(daemon)
    return rows


def split_cpu(supervisor: int) -> tuple[float, float]:
    """(this process's CPU seconds so far, every thread; the sum of the supervisor's children's:
    its workers, and spawn's resource tracker, which idles)."""
    times = os.times()
    children = set()
    for task in Path(f"/proc/{supervisor}/task").iterdir():
        try:
            children.update((task / "children").read_text().split())
        except OSError:
            continue
    workers = 0.0
    for pid in children:
        try:
            workers += sum(cpu_times(int(pid)))
        except OSError:  # it exited between the listing and the read
            continue
    return times.user + times.system, workers


def mw_point(endpoint: str, model: str, workload: Workload, concurrency: int, timing: Timing,
             supervisor: int, split: bool = False) -> dict:
    """One point against a running daemon. ``split``: also the CPU per request of this process
    (the load generator and its client) and of the supervisor's children (the workers)."""
    from modelwarden import AsyncClient, Client

    window = Window(timing.warmup_s, timing.duration_s,
                    lambda: (cpu_times(supervisor), split_cpu(supervisor) if split else None))

    def check(index, output):
        return matches(workload, index, output)

    if concurrency == 1:
        with Client(endpoint) as client:
            result = run_threads(lambda i: client.infer(model, workload.inputs[i]), 1, window,
                                 SAMPLE_INPUTS, check)
    else:
        async def load() -> dict:
            async with AsyncClient(endpoint) as client:
                return await run_async(lambda i: client.infer(model, workload.inputs[i]),
                                       concurrency, window, SAMPLE_INPUTS, check)

        result = asyncio.run(load())
    answered = result["ok"] + result["errors"]
    if len(window.probes) == 2 and answered:
        ((user0, system0), split0), ((user1, system1), split1) = window.probes
        result["supervisor_cpu_us"] = round((user1 + system1 - user0 - system0) / answered * 1e6, 1)
        if split:
            result["client_cpu_us"] = round((split1[0] - split0[0]) / answered * 1e6, 1)
            result["workers_cpu_us"] = round((split1[1] - split0[1]) / answered * 1e6, 1)
        # The kernel's share: system calls (libzmq's I/O thread and mailboxes, the loop's poll),
        # which bench/instructions.py's callgrind counts do not see.
        result["supervisor_sys_us"] = round((system1 - system0) / answered * 1e6, 1)
    return result


# -- the KServe v2 gateway ---------------------------------------------------------------------

GATEWAY_WORKLOADS = ("W1", "W3")


def gateway_missing() -> str | None:
    """Why the gateway cannot be benchmarked here, or None."""
    import importlib.util

    for name in ("uvicorn", "grpc", "tritonclient"):
        if importlib.util.find_spec(name) is None:
            return f"gateway: skipped, {name} is not installed (pip install '.[gateway,gateway-test]')"
    return None


def gw_config_text(runtime: Path, workloads: dict[str, Workload], batching: dict | None,
                   http: str, grpc: str) -> str:
    """The modelwarden configuration plus [gateway], with each model's input and output named
    (x and y) as a KServe client addresses them."""
    text = mw_config_text(runtime, workloads, batching)
    for workload in workloads.values():
        shape = [-1, *workload.input_shape[1:]]
        out = [-1, *workload.expected[0].shape[1:]]
        text = text.replace(f'name = "{workload.name.lower()}"\n',
                            f'name = "{workload.name.lower()}"\n'
                            f'inputs = [{{ name = "x", dtype = "float32", shape = {shape} }}]\n'
                            f'outputs = [{{ name = "y", dtype = "float32", shape = {out} }}]\n', 1)
    return text + f'\n[gateway]\nhttp = "{http}"\ngrpc = "{grpc}"\n'


def wait_gateway(http: str, daemon: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"http://{http}/v2/health/ready", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        if daemon.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the gateway did not become ready")
        time.sleep(0.2)


def bench_gateway(workdir: Path, workloads: dict[str, Workload], levels: list[int],
                  timing: Timing, notes: list[str]) -> list[dict]:
    missing = gateway_missing()
    if missing:
        notes.append(missing)
        print(f"note: {missing}", flush=True)
        return []
    chosen = {name: workload for name, workload in workloads.items() if name in GATEWAY_WORKLOADS}
    analyzer = find_perf_analyzer(notes)
    floor = build_compiled_floor(notes) if analyzer and "W1" in chosen else None
    transports = ("REST JSON", "REST binary", "gRPC") + ((PERF_ANALYZER,) if analyzer else ())
    rows = []
    for label, batching in (mw_configs()[0], mw_configs()[2]):
        http, grpc = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        models = {workload.name.lower(): workload for workload in chosen.values()}
        daemon, endpoint = start_daemon(workdir, "gateway " + label, gw_config_text(
            workdir / "run", chosen, batching, http, grpc), models)
        try:
            wait_gateway(http, daemon)
            for name, workload in models.items():
                for transport in transports:
                    if transport == "REST JSON" and workload.name == "W3":
                        continue
                    for concurrency in levels:
                        if transport == PERF_ANALYZER:
                            result = perf_analyzer_point(analyzer, grpc, name, workload, concurrency,
                                                         timing)
                        else:
                            result = gw_point(transport, http, grpc, name, workload, concurrency,
                                              timing)
                        rows.append(point("gateway", transport, label, workload, concurrency,
                                          result, workers=2, batching=batching))
                if workload.name == "W1" and batching is None:
                    rows.append(point("gateway", EMPTY_CALL, label, workload, 1,
                                      empty_grpc_call(grpc, timing), workers=2, batching=batching))
                    if analyzer and floor:
                        rows.append(point("gateway", COMPILED_FLOOR, label, workload, 1,
                                          compiled_floor_point(floor, analyzer, grpc, name,
                                                               workload, timing),
                                          workers=2, batching=batching))
        finally:
            stop_process(daemon)
    return rows


def gw_point(transport: str, rest_address: str, grpc_address: str, model: str,
             workload: Workload, concurrency: int, timing: Timing) -> dict:
    window = Window(timing.warmup_s, timing.duration_s)

    def check(index, output):
        return matches(workload, index, output)

    if transport == "gRPC" and concurrency == 1:  # a blocking client, as the native one at 1
        return _grpc_sync(grpc_address, model, workload, window, check)
    if transport == "gRPC":
        return asyncio.run(_grpc_load(grpc_address, model, workload, concurrency, window, check))
    binary = transport == "REST binary"
    bodies = [rest_body(x, binary) for x in workload.inputs]
    shape = tuple(workload.expected[0].shape)
    local = threading.local()

    def call(index: int):
        connection = getattr(local, "connection", None)
        if connection is None:  # one keep-alive connection per client thread
            connection = local.connection = http.client.HTTPConnection(rest_address, timeout=30)
        body, headers = bodies[index]
        connection.request("POST", f"/v2/models/{model}/infer", body=body, headers=headers)
        response = connection.getresponse()
        content = response.read()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {content[:200]!r}")
        return rest_output(response, content, shape)

    return run_threads(call, concurrency, window, SAMPLE_INPUTS, check)


def rest_body(x: torch.Tensor, binary: bool) -> tuple[bytes, dict]:
    if not binary:
        body = {"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32",
                            "data": x.flatten().tolist()}], "outputs": [{"name": "y"}]}
        return json.dumps(body).encode(), {"Content-Type": "application/json"}
    raw = x.contiguous().numpy().tobytes()
    header = json.dumps({"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32",
                                     "parameters": {"binary_data_size": len(raw)}}],
                         "outputs": [{"name": "y", "parameters": {"binary_data": True}}]}).encode()
    return header + raw, {"Content-Type": "application/octet-stream",
                          "Inference-Header-Content-Length": str(len(header))}


def rest_output(response, content: bytes, shape: tuple) -> torch.Tensor:
    length = response.getheader("Inference-Header-Content-Length")
    if length is None:
        return torch.tensor(json.loads(content)["outputs"][0]["data"]).reshape(shape)
    return torch.frombuffer(bytearray(content[int(length):]), dtype=torch.float32).reshape(shape)


def _grpc_sync(address: str, model: str, workload: Workload, window: Window, check) -> dict:
    import tritonclient.grpc as triton

    arrays = [x.numpy() for x in workload.inputs]
    client = triton.InferenceServerClient(address)

    def call(index: int):
        item = triton.InferInput("x", list(arrays[index].shape), "FP32")
        item.set_data_from_numpy(arrays[index])
        return torch.from_numpy(client.infer(model, [item]).as_numpy("y"))

    try:
        return run_threads(call, 1, window, SAMPLE_INPUTS, check)
    finally:
        client.close()


EMPTY_CALL = "gRPC empty call"
PERF_ANALYZER = "gRPC perf_analyzer"
COMPILED_FLOOR = "gRPC C++ empty server"
BUILD_DIR = ROOT / "bench" / ".build"


def build_compiled_floor(notes: list[str]) -> Path | None:
    """bench/grpc_floor.cc built against Debian's libgrpc++ (once; kept under bench/.build), or
    None with a note saying why."""
    binary = BUILD_DIR / "grpc_floor"
    source = ROOT / "bench" / "grpc_floor.cc"
    proto = ROOT / "gateway" / "proto" / "grpc_predict_v2.proto"
    if binary.exists() and binary.stat().st_mtime >= max(source.stat().st_mtime, proto.stat().st_mtime):
        return binary
    tools = [shutil.which(name) for name in ("g++", "protoc", "grpc_cpp_plugin", "pkg-config")]
    flags = subprocess.run(["pkg-config", "--cflags", "--libs", "grpc++", "protobuf"],
                           capture_output=True, text=True) if all(tools) else None
    if flags is None or flags.returncode != 0:
        notes.append("gateway: gRPC C++ empty server skipped: it needs g++, protoc, grpc_cpp_plugin "
                     "and libgrpc++ (Debian: apt install g++ pkg-config libgrpc++-dev "
                     "protobuf-compiler-grpc)")
        print(f"note: {notes[-1]}", flush=True)
        return None
    BUILD_DIR.mkdir(exist_ok=True)
    shutil.copy(proto, BUILD_DIR / proto.name)
    steps = [[tools[1], "-I.", "--cpp_out=.", "--grpc_out=.", f"--plugin=protoc-gen-grpc={tools[2]}",
              proto.name],
             [tools[0], "-O2", "-std=c++17", str(source), "grpc_predict_v2.pb.cc",
              "grpc_predict_v2.grpc.pb.cc", "-I.", "-o", binary.name, *flags.stdout.split()]]
    for step in steps:
        done = subprocess.run(step, cwd=BUILD_DIR, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            notes.append(f"gateway: gRPC C++ empty server skipped: its build failed: "
                         f"{done.stderr.strip()[-300:]}")
            print(f"note: {notes[-1]}", flush=True)
            return None
    return binary


def compiled_floor_point(binary: Path, analyzer: tuple[Path, dict], gateway: str, model: str,
                         workload: Workload, timing: Timing) -> dict:
    """perf_analyzer against bench/grpc_floor.cc, which answers with what the real gateway
    answered for ``model`` (so perf_analyzer sees the same metadata, config and outputs)."""
    import grpc
    # Triton's stubs of the same service: this process has tritonclient's protos loaded, and a
    # second copy of the package "inference" cannot join protobuf's pool.
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc as pb_grpc

    workdir = Path(tempfile.mkdtemp(prefix="grpc-floor-"))
    with grpc.insecure_channel(gateway) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        request = pb.ModelInferRequest(model_name=model, inputs=[pb.ModelInferRequest.InferInputTensor(
            name="x", datatype="FP32", shape=workload.input_shape)],
            raw_input_contents=[workload.inputs[0].numpy().tobytes()])
        answers = {"md.bin": stub.ModelMetadata(pb.ModelMetadataRequest(name=model), timeout=10),
                   "cfg.bin": stub.ModelConfig(pb.ModelConfigRequest(name=model), timeout=10),
                   "sm.bin": stub.ServerMetadata(pb.ServerMetadataRequest(), timeout=10),
                   "inf.bin": stub.ModelInfer(request, timeout=10)}
    for name, message in answers.items():
        (workdir / name).write_bytes(message.SerializeToString())
    address = f"127.0.0.1:{free_port()}"
    server = subprocess.Popen([str(binary), address], cwd=workdir, stdout=subprocess.PIPE, text=True)
    try:
        if server.stdout.readline().strip() != "listening":
            raise RuntimeError("bench/grpc_floor.cc did not start")
        return perf_analyzer_point(analyzer, address, model, workload, 1, timing)
    finally:
        stop_process(server)
        shutil.rmtree(workdir, ignore_errors=True)


def empty_grpc_call(address: str, timing: Timing) -> dict:
    """p50 of ServerLive, which the gateway answers without the daemon: what one gRPC round
    trip costs here (tritonclient's Python client and the gateway's grpc.aio server) before
    any inference. The floor of the gRPC target: a gateway that cost nothing itself would
    still add this to the native round trip it makes for each request."""
    import tritonclient.grpc as triton

    client = triton.InferenceServerClient(address)
    try:
        return run_threads(lambda index: client.is_server_live(), 1,
                           Window(timing.warmup_s, timing.duration_s), SAMPLE_INPUTS,
                           lambda index, output: output is True)
    finally:
        client.close()


def find_perf_analyzer(notes: list[str]) -> tuple[Path, dict] | None:
    """perf_analyzer's binary and environment, or None with a note saying why."""
    from modelwarden.testing import perf_analyzer

    found = perf_analyzer()
    if isinstance(found, str):
        notes.append(f"gateway: {found}")
        print(f"note: gateway: {found}", flush=True)
        return None
    return found


def perf_analyzer_point(analyzer: tuple[Path, dict], address: str, model: str,
                        workload: Workload, concurrency: int, timing: Timing) -> dict:
    """perf_analyzer's own closed loop over gRPC at ``concurrency`` (it does not check answers;
    a failed request fails the run)."""
    binary, env = analyzer
    # Windows of half the duration until the last 3 agree within 2x (its stability rule); on two
    # shared cores a batching delay can make 3 windows in a row disagree, so it may try 10 (its
    # default) before it gives up and fails the point.
    window_ms = int(timing.duration_s * 1000 / 2)
    done = subprocess.run(
        [str(binary), "-m", model, "-i", "grpc", "-u", address, "--concurrency-range",
         str(concurrency), "-p", str(window_ms), "--stability-percentage", "100", "--max-trials", "10",
         "--percentile", "50", "--shape", "x:" + ",".join(map(str, workload.input_shape))]
        + (["--async"] if concurrency > 1 else []),
        capture_output=True, text=True, env=env, timeout=120 + 10 * timing.duration_s)
    failed = {"rps": None, "p50_ms": None, "p99_ms": None, "ok": 0, "errors": 1,
              "first_error": (done.stdout + done.stderr).strip()[-300:]}
    if done.returncode != 0:
        return failed

    def number(pattern: str) -> float:
        return float(re.findall(pattern, done.stdout)[-1])

    try:
        return {"rps": round(number(r"Throughput: ([0-9.]+) infer/sec"), 1),
                "p50_ms": round(number(r"p50 latency: (\d+) usec") / 1000, 3),
                "p99_ms": round(number(r"p99 latency: (\d+) usec") / 1000, 3),
                "ok": int(number(r"Request count: (\d+)")), "errors": 0, "mismatches": 0,
                "checked": 0}
    except (IndexError, ValueError):  # a report this code does not know how to read
        return failed


async def _grpc_load(address: str, model: str, workload: Workload, concurrency: int,
                     window: Window, check) -> dict:
    import tritonclient.grpc.aio as triton

    arrays = [x.numpy() for x in workload.inputs]
    client = triton.InferenceServerClient(address)
    try:
        async def call(index: int):
            item = triton.InferInput("x", list(arrays[index].shape), "FP32")
            item.set_data_from_numpy(arrays[index])
            result = await client.infer(model, [item])
            return torch.from_numpy(result.as_numpy("y"))

        return await run_async(call, concurrency, window, SAMPLE_INPUTS, check)
    finally:
        await client.close()


# -- peers ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Peer:
    name: str
    requirements: tuple[str, ...]
    path: str  # the inference route
    body: str  # "bytes", "json-b64" or "triton" (bench/peers/httpload.py)
    transport: str
    start_timeout_s: float = 120.0


PEERS = {
    "mosec": Peer("mosec", ("mosec==0.9.8",), "/inference", "bytes", "HTTP/1.1 (Rust)"),
    "litserve": Peer("litserve", ("litserve==0.2.19",), "/predict", "json-b64",
                     "HTTP/1.1 (uvicorn)"),
    "ray": Peer("ray", ("ray[serve]==2.60.0",), "/", "bytes", "HTTP/1.1 (Ray proxy)", 240.0),
    "pytriton": Peer("pytriton", ("nvidia-pytriton==0.7.0",), "/v2/models/bench/infer", "triton",
                     "HTTP/1.1 (Triton)", 240.0),
}
PEER_COMMON = (TORCH, "numpy", "httpx==0.28.1")


def peer_python(peer: Peer) -> Path:
    return PEERS_DIR / peer.name / "bin" / "python"


def install_peer(peer: Peer, extra: tuple[str, ...] = ()) -> str | None:
    """Its own virtualenv with its pinned requirements (and ``extra``: bench/text.py adds the
    tokenizer); None, or why it could not be installed. The stamp lists what was installed, so
    a benchmark that needs less than another installed does not install again."""
    venv = PEERS_DIR / peer.name
    wanted = list(PEER_COMMON + peer.requirements + extra)
    stamp = venv / ".bench-requirements"
    have = stamp.read_text().splitlines() if stamp.exists() else []
    if set(wanted) <= set(have):
        return None
    print(f"setting up {peer.name} in {venv} ...", flush=True)
    started = time.monotonic()
    try:
        if not peer_python(peer).exists():
            subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True,
                           capture_output=True, timeout=300)
        done = subprocess.run([str(peer_python(peer)), "-m", "pip", "install", "--quiet",
                               "--disable-pip-version-check", *wanted],
                              capture_output=True, text=True, timeout=1200)
    except (subprocess.SubprocessError, OSError) as exc:
        return f"install failed: {exc}"
    if done.returncode != 0:
        errors = [line for line in done.stderr.splitlines() if line.startswith("ERROR")]
        return "install failed: " + (errors[-1] if errors else done.stderr.strip()[-300:])
    stamp.write_text("\n".join(dict.fromkeys(have + wanted)))
    print(f"  installed in {time.monotonic() - started:.0f} s", flush=True)
    return None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_peer_files(workdir: Path, workload: Workload) -> tuple[Path, Path]:
    """The spec (architecture + state dict file) a peer loads, and the inputs its client sends."""
    state = workdir / f"{workload.name}.state.pt"
    torch.save(workload.model.state_dict(), state)
    spec = workdir / f"{workload.name}.spec.json"
    spec.write_text(json.dumps({"kind": workload.kind, "kwargs": workload.kwargs,
                                "state": str(state), "input_shape": workload.input_shape}))
    data = workdir / f"{workload.name}.inputs.pt"
    torch.save({"inputs": workload.inputs, "expected": workload.expected, "atol": 1e-5,
                "rtol": 1e-4}, data)
    return spec, data


def request_body(peer: Peer, x: torch.Tensor) -> tuple[bytes, str]:
    raw = x.contiguous().numpy().tobytes()
    if peer.body == "bytes":
        return raw, "application/octet-stream"
    if peer.body == "triton":  # readiness only needs the status: JSON tensors are fine
        inputs = [{"name": "x", "shape": list(x.shape), "datatype": "FP32",
                   "data": x.flatten().tolist()}]
        return json.dumps({"inputs": inputs}).encode(), "application/json"
    return json.dumps({"b64": base64.b64encode(raw).decode()}).encode(), "application/json"


def wait_ready(peer: Peer, process: subprocess.Popen, url: str, workload: Workload) -> None:
    """Until one real inference answers 200: health endpoints can answer before the workers."""
    body, content_type = request_body(peer, workload.inputs[0])
    wait_answering(process, url, body, content_type, peer.start_timeout_s, peer.name)


def wait_answering(process: subprocess.Popen, url: str, body: bytes, content_type: str,
                   timeout: float, name: str) -> None:
    """Until POSTing ``body`` to ``url`` answers 200; RuntimeError naming ``name`` when its
    process exits first or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            request = urllib.request.Request(url, data=body, headers={"content-type": content_type})
            with urllib.request.urlopen(request, timeout=10) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with status {process.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} did not answer within {timeout:.0f} s")
        time.sleep(0.5)


def start_peer(peer: Peer, workdir: Path, workload: Workload, spec: Path, batch: int):
    port = free_port()
    env = {**os.environ, "BENCH_SPEC": str(spec), "BENCH_MAX_BATCH": str(batch),
           "BENCH_WAIT_MS": str(PEER_WAIT_MS), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT / "bench" / "peers")}
    log_path = workdir / f"{peer.name}-{workload.name}-{batch}.log"
    log = open(log_path, "wb")
    process = subprocess.Popen([str(peer_python(peer)), str(ROOT / "bench" / "peers" / f"{peer.name}_server.py"),
                                "--port", str(port)], cwd=workdir, env=env, stdout=log,
                               stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}{peer.path}"
    try:
        wait_ready(peer, process, url, workload)
    except RuntimeError as exc:
        stop_peer(process)
        tail = log_path.read_text(errors="replace")[-1500:]
        raise RuntimeError(f"{exc}\n{tail}") from None
    return process, url


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``: some peers start servers in sessions of their own."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def stop_peer(process: subprocess.Popen) -> None:
    """SIGTERM to the server (each script shuts its own pieces down), then SIGKILL to whatever
    of its process tree is left."""
    tree = descendants(process.pid)
    stop_process(process)
    for pid in tree:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass


def peer_point(peer: Peer, url: str, data: Path, concurrency: int, timing: Timing) -> dict:
    done = subprocess.run([str(peer_python(peer)), str(ROOT / "bench" / "peers" / "httpload.py"),
                           "--url", url, "--format", peer.body, "--data", str(data),
                           "--concurrency", str(concurrency), "--warmup", str(timing.warmup_s),
                           "--duration", str(timing.duration_s)],
                          capture_output=True, text=True,
                          timeout=timing.warmup_s + timing.duration_s + 120)
    if done.returncode != 0:
        return {"ok": 0, "errors": None, "rps": None, "p50_ms": None, "p99_ms": None,
                "first_error": "load generator failed: " + done.stderr.strip()[-300:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def bench_peer(peer: Peer, workdir: Path, workloads: dict[str, Workload], levels: list[int],
               timing: Timing, notes: list[str]) -> list[dict]:
    problem = install_peer(peer)
    if problem is not None:
        notes.append(f"{peer.name}: {problem}")
        print(f"note: {notes[-1]}", flush=True)
        return []
    rows = []
    for workload in workloads.values():
        spec, data = write_peer_files(workdir, workload)
        for batch in (1, BATCH_MAX) if workload.batchable else (1,):
            config = "batching off" if batch == 1 else f"batch {batch}, wait {PEER_WAIT_MS}ms"
            try:
                process, url = start_peer(peer, workdir, workload, spec, batch)
            except RuntimeError as exc:
                notes.append(f"{peer.name} {workload.name} {config}: did not start: "
                             f"{str(exc).splitlines()[0]}")
                print(f"note: {notes[-1]}\n{exc}", flush=True)
                continue
            try:
                for concurrency in levels:
                    rows.append(point(peer.name, peer.transport, config, workload, concurrency,
                                      peer_point(peer, url, data, concurrency, timing)))
            finally:
                stop_peer(process)
    return rows


# -- targets ----------------------------------------------------------------------------------


def find(rows: list[dict], system: str, workload: str, concurrency: int, config=None) -> list[dict]:
    return [row for row in rows if row["system"] == system and row["workload"] == workload
            and row["concurrency"] == concurrency and row.get("rps")
            and (config is None or config(row["config"]))]


def best(rows: list[dict], key: str = "rps") -> dict | None:
    if not rows:
        return None
    return max(rows, key=lambda row: row[key]) if key == "rps" else min(rows, key=lambda row: row[key])


def peer_rows(rows, workload, concurrency, batching: bool | None = None) -> list[dict]:
    found = []
    for name in PEERS:
        found += find(rows, name, workload, concurrency,
                      None if batching is None else (lambda c: c.startswith("batch ") == batching))
    return found


def mw(rows, workload, concurrency, config: str, system: str = "modelwarden") -> dict | None:
    """modelwarden's row: config "off", "one" (1 worker) or "on" (the better batching config);
    over ZeroMQ, or on the local frontend (``system`` LOCAL_SYSTEM)."""
    if config == "on":
        return best(find(rows, system, workload, concurrency,
                         lambda c: c.startswith("batch ") and "1 worker" not in c))
    label = "batching off, 1 worker" if config == "one" else "batching off"
    return best(find(rows, system, workload, concurrency, lambda c: c == label))


def gw(rows, workload, concurrency, transport: str, batched: bool) -> dict | None:
    """The gateway's row for one transport, batching off or on."""
    return best([row for row in find(rows, "gateway", workload, concurrency,
                                     lambda c: c.startswith("batch ") == batched)
                 if row["transport"] == transport])


def added_to_native(extra: dict | None, native: dict | None) -> float | None:
    """(extra p50 + native p50) / native p50: a gateway that adds ``extra`` to each native round
    trip, as a ratio of the native one; None where either was not measured."""
    if not extra or not native or extra.get("p50_ms") is None or not native.get("p50_ms"):
        return None
    return (extra["p50_ms"] + native["p50_ms"]) / native["p50_ms"]


def check(name: str, value: float | None, op: str, bound: float, how: str) -> dict:
    met = None if value is None else (value >= bound if op == ">=" else value <= bound)
    return {"target": name, "value": None if value is None else round(value, 3), "op": op,
            "bound": round(bound, 3), "met": met, "how": how}


def ratio(a: dict | None, b: dict | None, key: str = "rps") -> float | None:
    if a is None or b is None or not a.get(key) or not b.get(key):
        return None
    return a[key] / b[key]


def p50(row: dict | None) -> str:
    return f"{row['p50_ms']:.2f} ms" if row and row.get("p50_ms") is not None else "not measured"


def describe(row: dict | None) -> str:
    return f"{row['system']} {row['config']}" if row else "not measured"


def targets(rows: list[dict], workloads: dict[str, Workload], floor: dict | None = None) -> list[dict]:
    """``floor``: the C proxy's CPU per request (bench/payloads.py ``bench_proxy_cpu``), measured
    in this run when it measured modelwarden at W1@64."""
    report = []
    if "W2" in workloads:
        w2 = workloads["W2"]
        on, peer = mw(rows, "W2", 64, "on"), best(peer_rows(rows, "W2", 64, True))
        report.append(check("W2@64 batching on / best peer batching on", ratio(on, peer), ">=", 1.5,
                            f"{describe(on)} vs {describe(peer)}"))
        delay_ms = (on or {}).get("batching", {}).get("max_delay_us", 0) / 1000 if on else 0
        bound = delay_ms + 2 * (w2.batch_p50_ms or 0) + 2
        report.append(check("W2@64 batching on p99 (ms) <= max_delay + 2x batch compute + 2ms",
                            on and on.get("p99_ms"), "<=", bound,
                            f"{describe(on)}; batch of {BATCH_MAX} in-process {w2.batch_p50_ms} ms"))
        off1 = mw(rows, "W2", 1, "off")
        report.append(check("W2@1 p50 / in-process forward p50",
                            off1 and off1["p50_ms"] / w2.forward_p50_ms, "<=", 1.25,
                            f"in-process forward p50 {w2.forward_p50_ms} ms"))
        report.append(check("W2@8 2 workers / 1 worker", ratio(mw(rows, "W2", 8, "off"),
                                                              mw(rows, "W2", 8, "one")), ">=", 1.8,
                            "batching off"))
        lock = best(find(rows, "in-process", "W2", 8, lambda c: c.startswith("lock")))
        report.append(check("W2@8 modelwarden / in-process shared model + lock",
                            ratio(mw(rows, "W2", 8, "off"), lock), ">=", 1.0, "batching off"))
    if "W1" in workloads:
        report.append(check("W1@64 batching on / batching off",
                            ratio(mw(rows, "W1", 64, "on"), mw(rows, "W1", 64, "off")), ">=", 2.5,
                            describe(mw(rows, "W1", 64, "on"))))
        ours, peer = mw(rows, "W1", 1, "off"), best(peer_rows(rows, "W1", 1), "p50_ms")
        report.append(check("W1@1 p50 / best peer p50",
                            ratio(ours, peer, "p50_ms"), "<=", 0.5, f"vs {describe(peer)}"))
        for row in find(rows, "modelwarden", "W1", 64, lambda c: "1 worker" not in c):
            report.append(check(f"W1@64 supervisor CPU us/request ({row['config']})",
                                row.get("supervisor_cpu_us"), "<=", 60.0, "utime+stime / requests"))
        # The two frontends a client on the host may use: the loop serves both itself (ZMTP on
        # ipc://, the link's framing on unix://), so neither may cost more than the other beyond
        # this machine's noise between two points of one run (LOCAL_WITHIN).
        local1, local64 = mw(rows, "W1", 1, "off", LOCAL_SYSTEM), mw(rows, "W1", 64, "off", LOCAL_SYSTEM)
        if local1 is not None:
            report.append(check("W1@1 p50, local frontend / ZeroMQ", ratio(local1, ours, "p50_ms"),
                                "<=", LOCAL_WITHIN, f"batching off; unix:// p50 {p50(local1)} vs "
                                f"ipc:// p50 {p50(ours)}"))
        if local64 is not None:
            zeromq64 = mw(rows, "W1", 64, "off") or {}
            report.append(check("W1@64 supervisor CPU per request, local frontend / ZeroMQ",
                                ratio(local64, zeromq64, "supervisor_cpu_us"),
                                "<=", LOCAL_WITHIN, f"batching off; {local64.get('supervisor_cpu_us')} "
                                f"us vs {zeromq64.get('supervisor_cpu_us')} us"))
        if floor is not None:  # issue 24: the supervisor's CPU against a C broker's, one run
            proxy_us = floor["8"]["proxy_cpu_us"]
            for config, bound in (("off", 2.5), ("on", 1.5)):
                row = mw(rows, "W1", 64, config)
                cpu = row.get("supervisor_cpu_us") if row else None
                report.append(check(
                    f"W1@64 supervisor CPU / C zmq.proxy CPU at 8 in flight, batching {config}",
                    cpu / proxy_us if cpu else None, "<=", bound,
                    f"{cpu} us vs {proxy_us} us per request; one supervisor core routes about "
                    f"{1e6 / cpu:,.0f} requests/s" if cpu else "not measured"))
    if any(row["system"] == "gateway" for row in rows):
        grpc1, native1 = gw(rows, "W1", 1, "gRPC", False), mw(rows, "W1", 1, "off")
        report.append(check("W1@1 gateway gRPC p50 / native client p50",
                            ratio(grpc1, native1, "p50_ms"), "<=", 1.5,
                            f"batching off; tritonclient.grpc p50 {p50(grpc1)} vs modelwarden.Client "
                            f"p50 {p50(native1)}"))
        cxx = gw(rows, "W1", 1, PERF_ANALYZER, False)
        if cxx is not None:
            report.append(check("W1@1 gateway gRPC p50 with perf_analyzer (C++) / native p50",
                                ratio(cxx, native1, "p50_ms"), "<=", 1.5, f"p50 {p50(cxx)}"))
        empty = gw(rows, "W1", 1, EMPTY_CALL, False)
        report.append(check("W1@1 floor: (empty gRPC call p50 + native p50) / native p50",
                            added_to_native(empty, native1),
                            "<=", 1.5, f"ServerLive p50 {p50(empty)}: a gateway that is a client of "
                            "the frontend adds at least this to the native round trip"))
        compiled = gw(rows, "W1", 1, COMPILED_FLOOR, False)
        if compiled is not None:
            report.append(check("W1@1 floor of a compiled gRPC front: (C++ empty server p50 + "
                                "native p50) / native p50", added_to_native(compiled, native1), "<=", 1.5,
                                f"bench/grpc_floor.cc p50 {p50(compiled)} with perf_analyzer"))
        for batched in (False, True):
            rest, peer = gw(rows, "W1", 64, "REST binary", batched), best(peer_rows(rows, "W1", 64, batched))
            report.append(check(f"W1@64 gateway REST binary / fastest HTTP peer, batching "
                                f"{'on' if batched else 'off'}", ratio(rest, peer), ">=", 1.0,
                                f"{describe(rest)} vs {describe(peer)}"))
    if "W3" in workloads:
        for concurrency in sorted({row["concurrency"] for row in rows if row["workload"] == "W3"}):
            peer = best(peer_rows(rows, "W3", concurrency))
            report.append(check(f"W3@{concurrency} modelwarden / best peer",
                                ratio(mw(rows, "W3", concurrency, "off"), peer), ">=", 5.0,
                                f"vs {describe(peer)}"))
        report.append(check("W3 64 in flight / 8 in flight",
                            ratio(mw(rows, "W3", 64, "off"), mw(rows, "W3", 8, "off")), ">=", 0.8,
                            "modelwarden batching off"))
    return report


# -- report -----------------------------------------------------------------------------------


def print_table(rows: list[dict], workloads: dict[str, Workload]) -> None:
    print()
    for workload in workloads.values():
        line = f"{workload.name}: {workload.title} {workload.kwargs or ''}".rstrip()
        line += f"; in-process forward p50 {workload.forward_p50_ms} ms (1 thread)"
        if workload.batch_p50_ms:
            line += f", batch of {BATCH_MAX} {workload.batch_p50_ms} ms"
        print(line)
    header = (f"{'wl':3s} {'infl':>4s} {'system':17s} {'transport':21s} {'config':30s} "
              f"{'req/s':>9s} {'p50 ms':>8s} {'p99 ms':>8s} {'err':>4s} {'sup us/req':>10s} "
              f"{'of it sys':>8s}")
    print("\n" + header + "\n" + "-" * len(header))
    order = {name: n for n, name in enumerate(["modelwarden", LOCAL_SYSTEM, "gateway", "in-process",
                                                 *PEERS])}
    for row in sorted(rows, key=lambda r: (r["workload"], r["concurrency"], order.get(r["system"], 99))):
        cpu = row.get("supervisor_cpu_us")
        print(f"{row['workload']:3s} {row['concurrency']:>4d} {row['system']:17s} "
              f"{row['transport']:21s} {row['config']:30s} {row.get('rps') or 0:>9.1f} "
              f"{cell(row.get('p50_ms'))} {cell(row.get('p99_ms'))} "
              f"{row.get('errors') if row.get('errors') is not None else '-':>4} "
              f"{cpu if cpu is not None else '':>10} {row.get('supervisor_sys_us') or '':>8}")


def cell(value) -> str:
    return f"{value:8.2f}" if value is not None else f"{'-':>8s}"


def print_targets(report: list[dict]) -> None:
    print()
    for row in report:
        verdict = "----" if row["met"] is None else ("PASS" if row["met"] else "MISS")
        value = "n/a" if row["value"] is None else f"{row['value']:.2f}"
        print(f"{verdict} {row['target']:62s} = {value:>7s} (target {row['op']} {row['bound']}) "
              f"[{row['how']}]")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="0.3 s warm-up + 1.2 s window per point (a smoke run)")
    parser.add_argument("--only", default=",".join(SYSTEMS),
                        help="comma-separated systems to run (default: all)")
    parser.add_argument("--workloads", default="W1,W2,W3", help="comma-separated, of W1,W2,W3")
    parser.add_argument("--concurrency", default="1,8,64", help="requests in flight per point")
    parser.add_argument("--no-peers", action="store_true", help="no mosec, litserve, ray, pytriton")
    parser.add_argument("--json", default=str(ROOT / "bench" / "results" / "serving.json"))
    args = parser.parse_args(argv)
    args.systems = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = set(args.systems) - set(SYSTEMS)
    workloads = [name.strip().upper() for name in args.workloads.split(",") if name.strip()]
    if unknown or not set(workloads) <= {"W1", "W2", "W3"}:
        parser.error(f"unknown system or workload: {sorted(unknown) or workloads}")
    if args.no_peers:
        args.systems = [name for name in args.systems if name not in PEERS]
    args.workload_names = workloads
    args.levels = [int(level) for level in args.concurrency.split(",")]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    timing = Timing(0.3, 1.2) if args.quick else Timing(1.0, 4.0)
    started = time.monotonic()
    measured_on = machine()
    workdir = Path(tempfile.mkdtemp(prefix="mwsrv-", dir="/tmp"))
    notes: list[str] = []
    rows: list[dict] = []
    floor = None
    try:
        workloads = make_workloads(args.workload_names)
        if "modelwarden" in args.systems:
            print("modelwarden (ZeroMQ ipc, 2 workers x 1 thread)", flush=True)
            rows += bench_modelwarden(workdir, workloads, args.levels, timing, notes)
            if "W1" in workloads and 64 in args.levels:
                floor = bench_proxy_cpu(workdir, multiprocessing.get_context("spawn"),
                                        2000 if args.quick else 20000)
                print("the floor, a C zmq.proxy's CPU per 1 KiB request: " + ", ".join(
                    f"{row['proxy_cpu_us']} us at {n} in flight" for n, row in floor.items()),
                    flush=True)
        if "gateway" in args.systems:
            print("modelwarden's KServe v2 gateway (REST and gRPC, 2 workers x 1 thread)", flush=True)
            rows += bench_gateway(workdir, workloads, args.levels, timing, notes)
        if "inprocess" in args.systems:
            print("in-process alternatives", flush=True)
            rows += bench_inprocess(workloads, args.levels, timing)
        for name in args.systems:
            if name in PEERS:
                print(f"{name} ({PEERS[name].transport}, 2 workers x 1 thread)", flush=True)
                rows += bench_peer(PEERS[name], workdir, workloads, args.levels, timing, notes)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print_table(rows, workloads)
    report = targets(rows, workloads, floor)
    write_results(args.json, rows, report, notes, started, {
        "machine": measured_on, "command": command(), "proxy_floor": floor,
        "timing": {"warmup_s": timing.warmup_s, "duration_s": timing.duration_s},
        "workloads": {w.name: {"title": w.title, "kind": w.kind, "kwargs": w.kwargs,
                               "input_shape": w.input_shape, "forward_p50_ms": w.forward_p50_ms,
                               "batch_p50_ms": w.batch_p50_ms} for w in workloads.values()},
        "peers": {name: {"requirements": list(PEER_COMMON + peer.requirements),
                         "transport": peer.transport} for name, peer in PEERS.items()
                  if name in args.systems}})
    return 0


def write_results(path: str, rows: list[dict], report: list[dict], notes: list[str],
                  started: float, head: dict) -> None:
    """Print the targets and notes, then write ``head`` and the run's points, targets, notes
    and duration as the benchmark's JSON (what bench/report.py draws)."""
    print_targets(report)
    for note in notes:
        print(f"note: {note}")
    elapsed = round(time.monotonic() - started, 1)
    print(f"\n{len(rows)} points in {elapsed} s")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**head, "points": rows, "targets": report, "notes": notes,
                               "elapsed_s": elapsed}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
