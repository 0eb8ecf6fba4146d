"""Payload transport benchmark: modelwarden against the alternatives, in one run.

    python bench/payloads.py [--quick] [--json PATH]
    python bench/payloads.py --cpu-against CHECKOUT|uncompiled [--turns N] [--json PATH]

Round trips of an identity model (forward(x) = x, no copy) for payloads of 1 KiB, 1 MiB and
64 MiB, single client, sequential. Prints a table (p50, p99, requests/s, MB/s), the ratios the
targets are stated in, and writes everything as JSON (default bench/results/payloads.json).

Paths measured:
  mw-shm-fresh    modelwarden on ipc:// (ZeroMQ's wire, ZMTP), shared memory, an ordinary
                  tensor per call (one copy in)
  mw-shm-zero     modelwarden, shared memory, a tensor from client.empty() reused (no copy)
  mw-inline       modelwarden on ipc://, inline ZMTP frames (shared memory off)
  mw-local        modelwarden on its local frontend (unix://: the link's framing), shared memory on
(The client and the supervisor read and write both frontends themselves: no libzmq runs in
either on ipc:// or unix://.)
  zmq-reqrep      bare pyzmq REQ/REP between two processes
  zmq-proxy       the same through a C-level zmq.proxy(ROUTER, DEALER) broker process
  py-broker       the same through the smallest Python broker (a poll loop forwarding frames
                  between ROUTER and DEALER, parsing nothing): the floor for any Python router
  procpool        concurrent.futures.ProcessPoolExecutor (numpy arrays, pickled)
  tmp-fresh       torch.multiprocessing queues, a fresh tensor per call
  tmp-shared      torch.multiprocessing queues, one tensor already in shared memory
  in-process      calling the model in this process
  memcpy          one copy of the payload: memcpy (ctypes.memmove) into a preallocated buffer
  copy-threads    the same copy by torch's copy_ on all intra-op threads
The targets compare against the faster of memcpy and copy-threads.

After the table comes "where the time goes": the CPU time (user + system, all threads) that the
client, the supervisor and the worker each spend per 1 KiB request, over ipc:// and over unix://.

``--cpu-against`` measures only that, for issue 24's client and worker targets (each at most
0.4x the CPU of the path before the change): N turns, each this checkout's ``--cpu-only`` then
the other's (another checkout, compiled in place, run by its own bench/payloads.py: ``git
worktree add /tmp/base COMMIT`` and ``python setup.py build_ext --inplace`` there; or
``uncompiled``, a copy of this checkout without its compiled modules), side by side. A process's
CPU is read in clock ticks (10 ms), so one turn's ratio moves by several percent: the medians of
the turns' ratios are stated, for this checkout over ipc:// and over unix:// against the other
over ipc://.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch
import zmq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SIZES = {"1KiB": 1024, "1MiB": 1024**2, "64MiB": 64 * 1024**2}
ITERATIONS = {"1KiB": 2000, "1MiB": 300, "64MiB": 40}
QUICK = {"1KiB": 300, "1MiB": 40, "64MiB": 8}


# -- measurement -------------------------------------------------------------------------------


def measure(call, iterations: int, warmup: int = 3) -> dict:
    for _ in range(warmup):
        call()
    samples = []
    for _ in range(iterations):
        started = time.perf_counter_ns()
        call()
        samples.append(time.perf_counter_ns() - started)
    samples.sort()
    p50 = samples[len(samples) // 2] / 1000
    p99 = samples[min(len(samples) - 1, int(len(samples) * 0.99))] / 1000
    return {"p50_us": round(p50, 1), "p99_us": round(p99, 1),
            "rps": round(1e9 / statistics.fmean(samples), 1), "n": iterations}


def payload(nbytes: int) -> torch.Tensor:
    count = nbytes // 4
    shape = (4096, count // 4096) if count >= 4096 * 4096 else (count,)
    return torch.randn(shape)


# -- the alternatives, each in its own processes ------------------------------------------------


def _rep_server(endpoint: str) -> None:
    sock = zmq.Context().socket(zmq.REP)
    sock.connect(endpoint) if "backend" in endpoint else sock.bind(endpoint)
    while True:
        sock.send(sock.recv(copy=False), copy=False)


def _proxy(frontend: str, backend: str) -> None:
    context = zmq.Context()
    front, back = context.socket(zmq.ROUTER), context.socket(zmq.DEALER)
    front.bind(frontend)
    back.bind(backend)
    zmq.proxy(front, back)


def _python_broker(frontend: str, backend: str) -> None:
    from modelwarden.shared.sockets import recv_parts, send_parts

    context = zmq.Context()
    front, back = context.socket(zmq.ROUTER), context.socket(zmq.DEALER)
    front.bind(frontend)
    back.bind(backend)
    poller = zmq.Poller()
    poller.register(front, zmq.POLLIN)
    poller.register(back, zmq.POLLIN)
    while True:
        for sock, _ in poller.poll():
            send_parts(back if sock is front else front, recv_parts(sock))


def _identity(x):
    return x


def _tmp_echo(inbox, outbox) -> None:
    while True:
        item = inbox.get()
        if item is None:
            return
        outbox.put(item)


def bench_zmq(workdir: Path, spawn, sizes, iterations) -> dict:
    results = {"zmq-reqrep": {}, "zmq-proxy": {}, "py-broker": {}}
    direct = f"ipc://{workdir}/direct.sock"
    front, back = f"ipc://{workdir}/front.sock", f"ipc://{workdir}/backend.sock"
    py_front, py_back = f"ipc://{workdir}/pyfront.sock", f"ipc://{workdir}/pybackend.sock"
    processes = [spawn.Process(target=_rep_server, args=(direct,), daemon=True),
                 spawn.Process(target=_proxy, args=(front, back), daemon=True),
                 spawn.Process(target=_rep_server, args=(back,), daemon=True),
                 spawn.Process(target=_python_broker, args=(py_front, py_back), daemon=True),
                 spawn.Process(target=_rep_server, args=(py_back,), daemon=True)]
    for process in processes:
        process.start()
    context = zmq.Context()
    try:
        for name, endpoint in (("zmq-reqrep", direct), ("zmq-proxy", front), ("py-broker", py_front)):
            sock = context.socket(zmq.REQ)
            sock.connect(endpoint)
            for size, nbytes in sizes.items():
                data = np.random.default_rng(0).bytes(nbytes)

                def call(sock=sock, data=data):
                    sock.send(data, copy=False)
                    sock.recv(copy=False)

                results[name][size] = measure(call, iterations[size], warmup=20)
            sock.close(0)
    finally:
        for process in processes:
            process.kill()
        context.term()
    return results


FLOOR_IN_FLIGHT = (1, 8)


def bench_proxy_cpu(workdir: Path, spawn, count: int) -> dict:
    """The floor: a C ``zmq.proxy`` broker's CPU per request (all its threads, user + system,
    from /proc), ROUTER -> DEALER, REQ clients, two REP echoes, 1 KiB, at 1 and 8 in flight.
    It does what our supervisor does per request minus everything that is ours: two hops."""
    # "backend" in the name: _rep_server connects to it (and binds anything else)
    front, back = f"ipc://{workdir}/floor-front.sock", f"ipc://{workdir}/floor-backend.sock"
    proxy = spawn.Process(target=_proxy, args=(front, back), daemon=True)
    echoes = [spawn.Process(target=_rep_server, args=(back,), daemon=True) for _ in range(2)]
    for process in (proxy, *echoes):
        process.start()
    context = zmq.Context()
    data = np.random.default_rng(0).bytes(SIZES["1KiB"])
    out = {}
    try:
        for in_flight in FLOOR_IN_FLIGHT:
            sockets = [context.socket(zmq.REQ) for _ in range(in_flight)]
            for sock in sockets:
                sock.connect(front)
                sock.send(data)  # warm: the connection made, the echoes reached
                sock.recv()

            def client(sock: zmq.Socket, n: int) -> None:
                for _ in range(n):
                    sock.send(data, copy=False)
                    sock.recv(copy=False)

            each = max(1, count // in_flight)
            before, started = cpu_seconds(proxy.pid), time.perf_counter()
            threads = [threading.Thread(target=client, args=(sock, each)) for sock in sockets]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            spent, wall = cpu_seconds(proxy.pid) - before, time.perf_counter() - started
            out[str(in_flight)] = {"proxy_cpu_us": round(spent / (each * in_flight) * 1e6, 1),
                                   "rps": round(each * in_flight / wall, 1), "n": each * in_flight}
            for sock in sockets:
                sock.close(0)
    finally:
        for process in (proxy, *echoes):
            process.kill()
        context.term()
    return out


def bench_uncompiled_cpu(workdir: Path, quick: bool) -> dict | str:
    """cpu-per-request again, every process on the uncompiled path: a copy of the checkout
    without the compiled modules on PYTHONPATH (the client here, the daemon and its worker).
    A string says why not (not a checkout, or this tree is not compiled)."""
    from modelwarden import compiled
    from modelwarden.testing import copy_checkout

    if compiled.COMPILED_STATE not in compiled.report().values():
        return "this tree runs uncompiled already: nothing to compare"
    if not (ROOT / ".git").exists():
        return "not a git checkout: no uncompiled copy to make"
    tree = workdir / "uncompiled"
    copy_checkout(ROOT, tree)
    return cpu_of_tree(tree, quick)


# Issue 24: a 1 KiB round trip's CPU in the client and in the worker, each <= 0.4x the path before
CPU_TARGETS = {"client_us": 0.4, "worker_us": 0.4}
CPU_PARTS = ("client_us", "supervisor_us", "worker_us", "wall_us")


def cpu_of_tree(tree: Path, quick: bool = False) -> dict:
    """``--cpu-only``'s row, measured by ``tree``'s own bench/payloads.py (its daemon, its
    worker and its client: that tree's request path throughout)."""
    done = subprocess.run([sys.executable, str(tree / "bench" / "payloads.py"), "--cpu-only",
                           *(["--quick"] if quick else [])],
                          cwd=tree, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(tree)})
    if done.returncode != 0:
        raise RuntimeError(f"--cpu-only in {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def cpu_targets(rows: list[dict]) -> tuple[dict, list[dict]]:
    """(per transport and process, the median of the turns' ratios; issue 24's targets on
    them): a slow turn slows both checkouts, so each turn's own ratio is what is kept."""
    medians = {over: {part: statistics.median(row["ratios"][over][part] for row in rows)
                      for part in CPU_PARTS}
               for over in rows[0]["ratios"]}
    report = [{"target": f"{part[:-3]} CPU per 1 KiB round trip over {over}://, this / the other "
                         "(median of the turns)",
               "value": medians[over][part], "op": "<=", "bound": bound,
               "met": medians[over][part] <= bound}
              for over in medians for part, bound in CPU_TARGETS.items()]
    return medians, report


def cpu_against(other: str, turns: int, json_path: str | None) -> int:
    """``--cpu-against``: this checkout's CPU per 1 KiB round trip over the other's, in turns."""
    from bench.machine import command, machine
    from modelwarden.testing import copy_checkout

    workdir = Path(tempfile.mkdtemp(prefix="mwcpu-", dir="/tmp"))
    try:
        if other == "uncompiled":
            tree = workdir / "uncompiled"
            copy_checkout(ROOT, tree)
        else:
            tree = Path(other).resolve()
        rows = []
        for turn in range(1, turns + 1):
            ours, theirs = cpu_of_tree(ROOT), cpu_of_tree(tree)
            row = {"turn": turn, "this": ours, "other": theirs,
                   "ratios": {over: {part: round(mine[part] / theirs[part], 3) for part in CPU_PARTS}
                              for over, mine in (("ipc", ours), ("unix", ours.get("unix")))
                              if mine is not None}}
            rows.append(row)
            print(f"turn {turn}: other {theirs.get('request_path')}: "
                  + "; ".join(f"{over} " + ", ".join(f"{part[:-3]} {value:.2f}x"
                                                      for part, value in ratios.items())
                              for over, ratios in row["ratios"].items()), flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    medians, report = cpu_targets(rows)
    print()
    for row in report:
        print(f"{'MET ' if row['met'] else 'MISS'} {row['target']:70s} {row['value']:.2f} "
              f"(target {row['op']} {row['bound']})")
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps({"machine": machine(), "command": command(),
                                               "other": other, "turns": rows, "medians": medians,
                                               "targets": report}, indent=2) + "\n")
        print(f"\nwrote {json_path}")
    return 0


def cpu_only(quick: bool) -> int:
    """``--cpu-only``: one JSON line, this process's request path's cpu-per-request."""
    from modelwarden import compiled
    from modelwarden.client.client import Client

    workdir = Path(tempfile.mkdtemp(prefix="mwb-", dir="/tmp"))
    daemon = start_daemon(workdir)
    try:
        with Client(f"ipc://{workdir}/run/frontend.sock") as client:
            for _ in range(200):
                client.infer("identity", payload(SIZES["1KiB"]))
            row = cpu_per_request(daemon.pid, workdir, client, count=600 if quick else 3000)
        with Client(f"unix://{workdir}/run/local.sock") as client:  # the local frontend
            for _ in range(200):
                client.infer("identity", payload(SIZES["1KiB"]))
            row["unix"] = cpu_per_request(daemon.pid, workdir, client, count=600 if quick else 3000)
        row["request_path"] = compiled.summary()
        print(json.dumps(row))
    finally:
        daemon.terminate()
        daemon.wait(30)
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


def bench_procpool(spawn, sizes, iterations) -> dict:
    out = {}
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as pool:
        for size, nbytes in sizes.items():
            array = np.random.default_rng(0).standard_normal(nbytes // 8)
            out[size] = measure(lambda: pool.submit(_identity, array).result(),
                                max(5, iterations[size] // 4))
    return out


def bench_torch_mp(sizes, iterations) -> dict:
    import torch.multiprocessing as tmp

    context = tmp.get_context("spawn")
    inbox, outbox = context.Queue(), context.Queue()
    process = context.Process(target=_tmp_echo, args=(inbox, outbox), daemon=True)
    process.start()
    results = {"tmp-fresh": {}, "tmp-shared": {}}
    try:
        for size, nbytes in sizes.items():
            def fresh(nbytes=nbytes):
                inbox.put(torch.empty(nbytes // 4).fill_(1.0))
                outbox.get()

            shared = payload(nbytes).share_memory_()

            def already_shared(shared=shared):
                inbox.put(shared)
                outbox.get()

            results["tmp-fresh"][size] = measure(fresh, max(5, iterations[size] // 2))
            results["tmp-shared"][size] = measure(already_shared, iterations[size])
    finally:
        inbox.put(None)
        process.join(10)
    return results


def bench_local(sizes, iterations) -> dict:
    import ctypes

    from examples.models import make_identity

    model = make_identity()
    results = {"in-process": {}, "memcpy": {}, "copy-threads": {}}
    for size, nbytes in sizes.items():
        x = payload(nbytes)
        source = np.random.default_rng(0).standard_normal(nbytes // 8)
        target = np.ones_like(source)  # touched: no page faults in the measurement
        with torch.inference_mode():
            results["in-process"][size] = measure(lambda: model(x), iterations[size])
        results["memcpy"][size] = measure(
            lambda: ctypes.memmove(target.ctypes.data, source.ctypes.data, nbytes), iterations[size])
        source_t, target_t = torch.from_numpy(source), torch.from_numpy(target)
        results["copy-threads"][size] = measure(lambda: target_t.copy_(source_t), iterations[size])
    return results


# -- modelwarden ---------------------------------------------------------------------------------


CONFIG = """
[daemon]
runtime_dir = "{runtime}"
frontend = ["ipc://{runtime}/frontend.sock", "unix://{runtime}/local.sock"]
heartbeat_interval = 1.0
log_level = "WARNING"
python_path = ["{root}"]

[[models]]
name = "identity"
source = "python:examples.models:make_identity"
workers = {workers}
threads = 1
warmup = 0
max_queue = {max_queue}
[models.probe]
interval = 0.0
"""


def start_daemon(workdir: Path, workers: int = 1, max_queue: int = 1024) -> subprocess.Popen:
    """The daemon serving the identity model (1 thread per worker, no probes), once it answers."""
    config = workdir / "bench.toml"
    config.write_text(CONFIG.format(runtime=workdir / "run", root=ROOT, workers=workers,
                                    max_queue=max_queue))
    daemon = subprocess.Popen([sys.executable, "-m", "modelwarden", "serve", "--config", str(config)],
                              cwd=ROOT)
    return wait_until_serving(daemon, f"ipc://{workdir}/run/frontend.sock")


def wait_until_serving(daemon: subprocess.Popen, endpoint: str,
                       timeout: float = 120.0) -> subprocess.Popen:
    """The daemon, once its ``identity`` model answers (RuntimeError if it never does)."""
    from modelwarden.client.client import Client

    with Client(endpoint, timeout=2) as client:
        deadline = time.monotonic() + timeout
        while True:
            try:
                client.infer("identity", torch.zeros(1), timeout=2)
                return daemon
            except Exception:
                if time.monotonic() > deadline or daemon.poll() is not None:
                    raise RuntimeError("the daemon did not come up") from None


def bench_modelwarden(workdir: Path, sizes, iterations) -> dict:
    from modelwarden.client.client import Client

    daemon = start_daemon(workdir)
    endpoint = f"ipc://{workdir}/run/frontend.sock"
    results = {"mw-shm-fresh": {}, "mw-shm-zero": {}, "mw-inline": {}, "mw-local": {}}
    try:
        with Client(endpoint) as shared, Client(endpoint, shm=False) as inline, \
                Client(f"unix://{workdir}/run/local.sock") as local:
            for size, nbytes in sizes.items():
                x = payload(nbytes)
                zero = shared.empty(x.shape)
                zero.copy_(x)
                results["mw-shm-fresh"][size] = measure(lambda: shared.infer("identity", x), iterations[size])
                results["mw-shm-zero"][size] = measure(lambda: shared.infer("identity", zero), iterations[size])
                results["mw-inline"][size] = measure(lambda: inline.infer("identity", x), iterations[size])
                # the local frontend (unix://): shared memory as on ipc://, no ZeroMQ
                results["mw-local"][size] = measure(lambda: local.infer("identity", x), iterations[size])
                for client in (shared, local):
                    if not torch.equal(client.infer("identity", x), x):
                        raise AssertionError(f"identity changed the payload at {size}")
            results["cpu-per-request"] = cpu_per_request(daemon.pid, workdir, shared)
            results["cpu-per-request-local"] = cpu_per_request(daemon.pid, workdir, local)
    finally:
        daemon.terminate()
        daemon.wait(30)
    return results


def cpu_seconds(pid: int) -> float:
    return sum(cpu_times(pid))


def cpu_times(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of every thread of ``pid`` so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def cpu_per_request(supervisor: int, workdir: Path, client, count: int = 3000) -> dict:
    """CPU time per 1 KiB round trip in each process (all threads: ZeroMQ's I/O thread too)."""
    from modelwarden.client.client import control_request

    status = control_request(f"ipc://{workdir}/run/control.sock", {"type": "status"})["status"]
    worker = status["workers"][0]["pid"]
    x = payload(SIZES["1KiB"])
    before = (time.process_time(), cpu_seconds(supervisor), cpu_seconds(worker), time.perf_counter())
    for _ in range(count):
        client.infer("identity", x)
    after = (time.process_time(), cpu_seconds(supervisor), cpu_seconds(worker), time.perf_counter())
    spent = [(b - a) / count * 1e6 for a, b in zip(before, after)]
    return {"client_us": round(spent[0], 1), "supervisor_us": round(spent[1], 1),
            "worker_us": round(spent[2], 1), "wall_us": round(spent[3], 1), "n": count}


# -- report --------------------------------------------------------------------------------------


def ratios(results: dict) -> list[dict]:
    def p50(path, size):
        if path == "copy":
            return min(p50("memcpy", size), p50("copy-threads", size))
        return results[path][size]["p50_us"]

    checks = [
        ("fresh 64MiB <= 3x one 64MiB copy", p50("mw-shm-fresh", "64MiB") / p50("copy", "64MiB"), "<=", 3.0),
        ("tmp fresh 64MiB / fresh 64MiB >= 5", p50("tmp-fresh", "64MiB") / p50("mw-shm-fresh", "64MiB"), ">=", 5.0),
        ("inline 64MiB / fresh 64MiB >= 5", p50("mw-inline", "64MiB") / p50("mw-shm-fresh", "64MiB"), ">=", 5.0),
        ("zero-copy 64MiB <= 2x our 1KiB", p50("mw-shm-zero", "64MiB") / p50("mw-shm-fresh", "1KiB"), "<=", 2.0),
        ("zero-copy 64MiB < tmp already-shared", p50("mw-shm-zero", "64MiB") / p50("tmp-shared", "64MiB"), "<", 1.0),
        ("our 1KiB <= 1.2x zmq.proxy 1KiB", p50("mw-shm-fresh", "1KiB") / p50("zmq-proxy", "1KiB"), "<=", 1.2),
        # issue 24's bound for the 1 KiB round trip, on the local frontend (no ZeroMQ hop)
        ("our 1KiB over unix:// <= 1.5x zmq.proxy 1KiB",
         p50("mw-local", "1KiB") / p50("zmq-proxy", "1KiB"), "<=", 1.5),
    ]
    report = []
    for name, value, op, target in checks:
        met = value <= target if op == "<=" else (value >= target if op == ">=" else value < target)
        report.append({"target": name, "ratio": round(value, 3), "op": op, "bound": target, "met": met})
    return report


def p50_of(results: dict, path: str, size: str) -> float:
    return results[path][size]["p50_us"]


def print_table(results: dict, sizes) -> None:
    print(f"{'path':14s} {'size':>6s} {'p50':>11s} {'p99':>11s} {'req/s':>9s} {'MB/s':>9s}")
    for path, by_size in results.items():
        if path.startswith(("cpu-per-request", "zmq-proxy-cpu")):
            continue
        for size in sizes:
            row = by_size.get(size)
            if row is None:
                continue
            mbps = row["rps"] * SIZES[size] / 1e6
            print(f"{path:14s} {size:>6s} {row['p50_us']:>9.1f}us {row['p99_us']:>9.1f}us "
                  f"{row['rps']:>9.1f} {mbps:>9.1f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations (a smoke run)")
    parser.add_argument("--json", default=str(ROOT / "bench" / "results" / "payloads.json"))
    parser.add_argument("--cpu-only", action="store_true",
                        help="print one JSON line: CPU per 1 KiB round trip in each process")
    parser.add_argument("--cpu-against", metavar="CHECKOUT|uncompiled",
                        help="only the CPU per 1 KiB round trip, this checkout's over another's "
                             "(or over this one uncompiled), in turns; issue 24's client and "
                             "worker targets")
    parser.add_argument("--turns", type=int, default=5, help="turns of --cpu-against")
    args = parser.parse_args()
    if args.cpu_only:
        return cpu_only(args.quick)
    if args.cpu_against:
        return cpu_against(args.cpu_against, args.turns,
                           None if args.json == parser.get_default("json") else args.json)
    from bench.machine import command, machine

    measured_on = machine()
    iterations = QUICK if args.quick else ITERATIONS
    spawn = multiprocessing.get_context("spawn")
    workdir = Path(tempfile.mkdtemp(prefix="mwb-", dir="/tmp"))
    results: dict = {}
    try:
        results.update(bench_modelwarden(workdir, SIZES, iterations))
        results.update(bench_zmq(workdir, spawn, SIZES, iterations))
        results["zmq-proxy-cpu"] = bench_proxy_cpu(workdir, spawn, 2000 if args.quick else 20000)
        results["cpu-per-request-uncompiled"] = bench_uncompiled_cpu(workdir, args.quick)
        results.update(bench_torch_mp(SIZES, iterations))
        results["procpool"] = bench_procpool(spawn, SIZES, iterations)
        results.update(bench_local(SIZES, iterations))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print_table(results, SIZES)
    report = ratios(results)
    cpu = results["cpu-per-request"]
    floor = p50_of(results, "py-broker", "1KiB") / p50_of(results, "zmq-proxy", "1KiB")
    print(f"\nthe smallest Python broker (parsing nothing) takes {floor:.2f}x the C proxy's 1 KiB "
          "round trip: the floor for any router written in Python on this machine")
    print(f"where the time goes, per 1 KiB round trip ({cpu['wall_us']} us wall): CPU "
          f"client {cpu['client_us']} us, supervisor {cpu['supervisor_us']} us, "
          f"worker {cpu['worker_us']} us (all threads, user + system)")
    floor = results["zmq-proxy-cpu"]
    print("the floor, a C zmq.proxy broker's CPU per 1 KiB request: "
          + ", ".join(f"{row['proxy_cpu_us']} us at {n} in flight ({row['rps']:.0f} req/s)"
                      for n, row in floor.items())
          + f"; our supervisor, sequential: {cpu['supervisor_us'] / floor['1']['proxy_cpu_us']:.2f}x "
            "the floor at 1 in flight")
    local = results["cpu-per-request-local"]
    print(f"the same over unix:// (the local frontend, {local['wall_us']} us wall): CPU client "
          f"{local['client_us']} us, supervisor {local['supervisor_us']} us, worker "
          f"{local['worker_us']} us")
    uncompiled = results["cpu-per-request-uncompiled"]
    if isinstance(uncompiled, dict):
        for name, ours in (("", cpu), (" over unix://", local)):
            print(f"compiled{name} / uncompiled request path over ipc://, CPU per 1 KiB round "
                  "trip (same run): "
                  + ", ".join(f"{who} {ours[f'{who}_us'] / uncompiled[f'{who}_us']:.2f}x"
                              for who in ("client", "supervisor", "worker"))
                  + f", wall {ours['wall_us'] / uncompiled['wall_us']:.2f}x")
    else:
        print(f"compiled / uncompiled: not measured ({uncompiled})")
    print()
    for row in report:
        print(f"{'MET ' if row['met'] else 'MISS'} {row['target']:42s} ratio {row['ratio']:.3f} "
              f"(target {row['op']} {row['bound']})")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"machine": measured_on, "command": command(),
                                           "sizes": SIZES, "iterations": iterations,
                                           "results": results, "targets": report}, indent=2))
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
