"""The client's share of a round trip: where a request's time goes on the client side.

    python bench/client_profile.py [--workers 2] [--seconds 4] [--profile] [--only NAME]

Starts one daemon serving the identity model (``forward(x) = x``, 1 thread per worker) and runs,
each for ``--seconds``:
  rt-1KiB            one client, 1 KiB, one request at a time (``Client.infer``)
  submit-1KiB-64     1 KiB, 64 in flight through ``Client.submit`` (the client's I/O thread)
  async-1KiB-64      1 KiB, 64 in flight through ``AsyncClient`` (64 tasks on one event loop)
  submit-4MiB-8/-64  W3 of issue 9: 4 MiB over shared memory, 8 and 64 in flight
  async-4MiB-8/-64   the same through AsyncClient
  threads-4MiB-64    the same, 64 threads each calling ``Client.infer``
Without ``--warm`` a concurrent point starts cold: its first burst grows the client's arena (one
4 MiB buffer per request in flight), which is what a short run mostly measures. Per point:
requests/s, p50, p99, and the CPU per request of this process (all its threads) and of
the supervisor (from /proc/<pid>/stat). ``--profile`` prints the client's top functions
(cProfile, cumulative) for rt-1KiB and submit-1KiB-64.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from modelwarden.client.client import AsyncClient, Client  # noqa: E402
from bench import payloads  # noqa: E402


cpu_seconds = payloads.cpu_seconds


def start_daemon(workdir: Path, workers: int) -> subprocess.Popen:
    return payloads.start_daemon(workdir, workers, max_queue=4096)  # 64 in flight per client


def summary(latencies_ns: list[int], elapsed: float, cpu: tuple[float, float]) -> dict:
    latencies_ns.sort()
    n = len(latencies_ns)
    return {"rps": round(n / elapsed, 1), "p50_us": round(latencies_ns[n // 2] / 1000, 1),
            "p99_us": round(latencies_ns[min(n - 1, int(n * 0.99))] / 1000, 1),
            "client_cpu_us": round(cpu[0] / n * 1e6, 1), "supervisor_cpu_us": round(cpu[1] / n * 1e6, 1),
            "n": n}


class Meter:
    """CPU of this process and of the supervisor across one measured window."""

    def __init__(self, supervisor: int) -> None:
        self.supervisor = supervisor

    def __enter__(self) -> "Meter":
        self.started = (time.perf_counter(), time.process_time(), cpu_seconds(self.supervisor))
        return self

    def __exit__(self, *exc) -> None:
        now = (time.perf_counter(), time.process_time(), cpu_seconds(self.supervisor))
        self.elapsed = now[0] - self.started[0]
        self.cpu = (now[1] - self.started[1], now[2] - self.started[2])


def run_sequential(client: Client, x: torch.Tensor, seconds: float, meter: Meter) -> dict:
    for _ in range(50):
        client.infer("identity", x)
    latencies = []
    with meter:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            started = time.perf_counter_ns()
            client.infer("identity", x)
            latencies.append(time.perf_counter_ns() - started)
    return summary(latencies, meter.elapsed, meter.cpu)


def run_submit(client: Client, x: torch.Tensor, inflight: int, seconds: float, meter: Meter,
               warm: float = 0.0) -> dict:
    """Closed loop: each completion submits the next request, ``inflight`` at all times."""
    if warm:
        run_submit(client, x, inflight, warm, Meter(meter.supervisor))
    latencies: list[int] = []
    lock = threading.Condition()
    state = {"open": 0, "stop": False}

    def launch() -> None:
        started = time.perf_counter_ns()
        future = client.submit("identity", x)
        future.add_done_callback(lambda f, started=started: done(f, started))

    def done(future, started: int) -> None:
        future.result()
        latencies.append(time.perf_counter_ns() - started)
        with lock:
            if state["stop"]:
                state["open"] -= 1
                lock.notify()
                return
        launch()

    for _ in range(inflight * 2):  # warm the arena
        client.infer("identity", x)
    with meter:
        state["open"] = inflight
        for _ in range(inflight):
            launch()
        time.sleep(seconds)
        with lock:
            state["stop"] = True
            lock.wait_for(lambda: state["open"] == 0, timeout=60)
    return summary(latencies, meter.elapsed, meter.cpu)


def run_threads(client: Client, x: torch.Tensor, inflight: int, seconds: float, meter: Meter,
                warm: float = 0.0) -> dict:
    if warm:
        run_threads(client, x, inflight, warm, Meter(meter.supervisor))
    latencies: list[int] = []
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            started = time.perf_counter_ns()
            client.infer("identity", x)
            latencies.append(time.perf_counter_ns() - started)

    threads = [threading.Thread(target=loop) for _ in range(inflight)]
    with meter:
        for thread in threads:
            thread.start()
        time.sleep(seconds)
        stop.set()
        for thread in threads:
            thread.join()
    return summary(latencies, meter.elapsed, meter.cpu)


def run_async(endpoint: str, x: torch.Tensor, inflight: int, seconds: float, meter: Meter,
              warm: float = 0.0) -> dict:
    async def main() -> dict:
        latencies: list[int] = []
        async with AsyncClient(endpoint) as client:
            await client.hello()
            for _ in range(inflight * 2):
                await client.infer("identity", x)

            async def loop(end: float) -> None:
                while time.perf_counter() < end:
                    started = time.perf_counter_ns()
                    await client.infer("identity", x)
                    latencies.append(time.perf_counter_ns() - started)

            if warm:
                end = time.perf_counter() + warm
                await asyncio.gather(*(loop(end) for _ in range(inflight)))
                latencies.clear()
            with meter:
                end = time.perf_counter() + seconds
                await asyncio.gather(*(loop(end) for _ in range(inflight)))
        return summary(latencies, meter.elapsed, meter.cpu)

    return asyncio.run(main())


def profiled(call, top: int = 25) -> dict:
    profile = cProfile.Profile()
    profile.enable()
    result = call()
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(top)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--only", action="append", help="run only these points (repeatable)")
    parser.add_argument("--warm", type=float, default=0.0,
                        help="run each concurrent point this long before measuring (the first "
                        "burst at N in flight grows the client's arena to N buffers)")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="mwcp-", dir="/tmp"))
    daemon = start_daemon(workdir, args.workers)
    endpoint = f"ipc://{workdir}/run/frontend.sock"
    meter = Meter(daemon.pid)
    small, big = torch.randn(256), torch.randn(1024 * 1024)
    wrap = profiled if args.profile else (lambda call: call())
    points = {
        "rt-1KiB": lambda c: wrap(lambda: run_sequential(c, small, args.seconds, meter)),
        "submit-1KiB-64": lambda c: wrap(lambda: run_submit(c, small, 64, args.seconds, meter, args.warm)),
        "async-1KiB-64": lambda c: run_async(endpoint, small, 64, args.seconds, meter, args.warm),
        "submit-4MiB-8": lambda c: run_submit(c, big, 8, args.seconds, meter, args.warm),
        "submit-4MiB-64": lambda c: run_submit(c, big, 64, args.seconds, meter, args.warm),
        "async-4MiB-8": lambda c: run_async(endpoint, big, 8, args.seconds, meter, args.warm),
        "async-4MiB-64": lambda c: run_async(endpoint, big, 64, args.seconds, meter, args.warm),
        "threads-4MiB-64": lambda c: run_threads(c, big, 64, args.seconds, meter, args.warm),
    }
    try:
        for name, point in points.items():
            if args.only and name not in args.only:
                continue
            with Client(endpoint) as client:  # a fresh client (and arena) per point
                result = point(client)
            print(f"{name:16s} {result['rps']:>9.1f} req/s  p50 {result['p50_us']:>9.1f} us  "
                  f"p99 {result['p99_us']:>9.1f} us  client CPU {result['client_cpu_us']:>7.1f} us/req  "
                  f"supervisor CPU {result['supervisor_cpu_us']:>6.1f} us/req  (n={result['n']})",
                  flush=True)
    finally:
        daemon.terminate()
        daemon.wait(30)
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
